"""Lightning data module over a :class:`SampleSource`: the resumable per-rank loader (:mod:`.loader`), or the staged
loader (:mod:`.staged`, imported only when ``pipeline`` is set)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_dlrover.data.eval_loader import EvalLoader
from lightning_dlrover.data.loader import ResumableLoader
from lightning_dlrover.data.sources import NUM_SPARSE, CriteoTSV, SampleSource, SyntheticCriteo

if TYPE_CHECKING:
    from lightning_dlrover.data.staged import PipelineConfig


class DLRMDataModule(pl.LightningDataModule):
    """Criteo-format click data for :class:`~lightning_dlrover.models.DLRMModule`.

    Synthetic by default; set ``criteo_paths`` (and optionally ``val_criteo_paths``) to train on real
    Criteo Kaggle/Terabyte TSV files, and ``test_criteo_paths`` to test on a held-out day. ``test`` and ``predict``
    read every sample of their set exactly once, at any world size (:class:`~lightning_dlrover.data.EvalLoader`).

    Args:
        num_embeddings_per_feature: table size of each of the 26 categorical features (must match the model).
        global_batch_size: samples per step summed over all ranks; must be divisible by the world size.
        train_batches: global batches per training epoch (synthetic data).
        val_batches: global batches per validation run (synthetic data); 0 disables validation.
        test_batches: global batches of the test set (synthetic data), also the samples ``predict`` reads by default.
        seed: seed of the synthetic stream (validation: samples of ``seed + 1``, test: of ``seed + 2``, labelled by
            the same function).
        alpha: power-law exponent of synthetic ids.
        criteo_paths: Criteo TSV files for training.
        val_criteo_paths: Criteo TSV files for validation.
        test_criteo_paths: Criteo TSV files for ``test`` (e.g. the day after the training days), also what
            ``predict`` reads unless ``predict_criteo_paths`` is set.
        predict_criteo_paths: Criteo TSV files for ``predict`` (one prediction per line, in file order).
        pipeline: train on ``criteo_paths`` through the staged parallel pipeline
            (:class:`~lightning_dlrover.data.staged.PipelinedLoader`): workers per stage and prefetch depth
            (``read``, ``parse``, ``transform``, ``assemble``, ``prefetch``), and optionally ``chunk_rows`` and
            ``on_error`` (``raise`` or ``skip``); ``None``: the in-process loader. Same batches either way. With
            no stage and no ``prefetch`` named (e.g. ``{}``) the pipeline starts from what suits the machine
            (:func:`~lightning_dlrover.data.staged.for_machine`: everything inline in one prefetch thread when a
            CPU trainer's threads use every core, else one worker per stage and 2 batches prefetched).
    """

    def __init__(
        self,
        num_embeddings_per_feature: list[int],
        global_batch_size: int = 1024,
        train_batches: int = 1000,
        val_batches: int = 10,
        seed: int = 0,
        alpha: float = 1.5,
        criteo_paths: list[str] | None = None,
        val_criteo_paths: list[str] | None = None,
        test_batches: int = 10,
        test_criteo_paths: list[str] | None = None,
        predict_criteo_paths: list[str] | None = None,
        pipeline: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if len(num_embeddings_per_feature) != NUM_SPARSE:
            raise ValueError(
                f"data.num_embeddings_per_feature has {len(num_embeddings_per_feature)} entries; "
                f"Criteo has {NUM_SPARSE} categorical features."
            )
        if global_batch_size < 1:
            raise ValueError(f"data.global_batch_size={global_batch_size} must be positive.")
        if test_batches < 0:
            raise ValueError(f"data.test_batches={test_batches} must be >= 0.")
        if pipeline is not None and not criteo_paths:
            raise ValueError("data.pipeline reads TSV files: set data.criteo_paths too (or remove data.pipeline).")
        self.save_hyperparameters()
        self._train_loader: ResumableLoader | None = None

    def _source(self, train: bool, split: str | None = None) -> SampleSource:
        hp = self.hparams
        split = split or ("train" if train else "val")
        paths = {"train": hp.criteo_paths, "val": hp.val_criteo_paths, "test": hp.test_criteo_paths,
                 "predict": hp.predict_criteo_paths or hp.test_criteo_paths}[split]
        if paths:
            return CriteoTSV(paths, hp.num_embeddings_per_feature)
        batches = {"train": hp.train_batches, "val": hp.val_batches}.get(split, hp.test_batches)
        return SyntheticCriteo(
            hp.num_embeddings_per_feature,
            hp.global_batch_size * batches,
            seed=hp.seed + {"train": 0, "val": 1}.get(split, 2),
            alpha=hp.alpha,
            label_seed=hp.seed,  # validation and test: other samples, the same labelling function
        )

    def _loader(self, train: bool) -> ResumableLoader:
        trainer = self.trainer
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        if train and self.hparams.pipeline is not None:
            from lightning_dlrover.data.staged import pipelined_loader

            return pipelined_loader(self._source(train), rank, world_size, self.hparams.global_batch_size,
                                    self.hparams.pipeline, self._machine_pipeline())
        return ResumableLoader(self._source(train), rank, world_size, self.hparams.global_batch_size)

    def _machine_pipeline(self) -> PipelineConfig | None:
        """The pipeline's start when ``data.pipeline`` names no workers: for this node's ranks and each trainer's
        threads (a CPU trainer's intra-op threads, one for an accelerator); ``None`` when it names some."""
        from lightning_dlrover.data.staged.config import STAGES, for_machine
        from lightning_dlrover.machine import available_cores

        if {*STAGES, "prefetch"} & set(self.hparams.pipeline):
            return None
        trainer = self.trainer
        ranks = max(trainer.num_devices, 1) if trainer else 1
        threads = torch.get_num_threads() if trainer is None or trainer.strategy.root_device.type == "cpu" else 1
        config = for_machine(ranks, threads)
        rank_zero_info(f"data.pipeline names no workers: starting at {config.short()} ({ranks} rank(s) on "
                       f"{available_cores()} cores, {threads} trainer thread(s) each)")
        return config

    def train_dataloader(self) -> ResumableLoader:
        """The rank's training loader; the same object across epochs so its position is checkpointed, built anew when
        the rank or world size changed (a shrink in process: the position is restored into the new one)."""
        trainer = self.trainer
        place = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        loader = self._train_loader
        if loader is None or (getattr(loader, "rank", place[0]), getattr(loader, "world_size", place[1])) != place:
            self._train_loader = self._loader(train=True)
        return self._train_loader

    def teardown(self, stage: str) -> None:
        """At the end of fit: reports the malformed lines the staged loader skipped since its last report."""
        report = getattr(self._train_loader, "report_skipped", None)
        if stage == "fit" and report is not None:
            report("fit")

    def val_dataloader(self) -> ResumableLoader | list:
        """The rank's validation loader, or none when validation is disabled."""
        if not self.hparams.val_criteo_paths and self.hparams.val_batches == 0:
            return []
        return self._loader(train=False)

    def _eval_loader(self, split: str) -> EvalLoader:
        trainer = self.trainer
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        source = self._source(False, split)
        if len(source) == 0:
            raise ValueError(
                f"`{split}` has no samples: set data.test_criteo_paths (a held-out TSV day file"
                f"{', or data.predict_criteo_paths' if split == 'predict' else ''}) or data.test_batches > 0 "
                "(synthetic data)."
            )
        return EvalLoader(source, rank, world_size, self.hparams.global_batch_size)

    def test_dataloader(self) -> EvalLoader:
        """The rank's slice of the test set: ``test_criteo_paths``, else ``test_batches`` synthetic global batches."""
        return self._eval_loader("test")

    def predict_dataloader(self) -> EvalLoader:
        """The rank's slice of the samples to predict: ``predict_criteo_paths``, else the test set."""
        return self._eval_loader("predict")
