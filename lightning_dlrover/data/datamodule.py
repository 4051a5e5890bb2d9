"""Lightning data module and a resumable per-rank loader over a :class:`BatchSource`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from torchrec.datasets.utils import Batch

from lightning_dlrover.data.sources import NUM_SPARSE, BatchSource, CriteoTSV, SyntheticCriteo, rank_slice


class ResumableLoader:
    """Iterates one rank's slice of a :class:`BatchSource` and remembers how far it got.

    Its ``state_dict`` (``{"next_batch": int}``, a global batch index) is saved by Lightning in every
    checkpoint; after ``load_state_dict`` the next epoch iteration starts from that batch, on any world size.
    """

    def __init__(self, source: BatchSource, rank: int, world_size: int) -> None:
        rank_slice(source.global_batch_size, rank, world_size)  # fail now, not at the first batch
        self.source, self.rank, self.world_size = source, rank, world_size
        self._next_batch = 0
        self._resume_from = 0

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Iterator[Batch]:
        start, self._resume_from = self._resume_from, 0
        self._next_batch = start
        for batch in self.source.iter_rank_batches(start, self.rank, self.world_size):
            self._next_batch += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Position in the epoch as a global batch index."""
        return {"next_batch": self._next_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next iteration start at global batch ``state["next_batch"]``."""
        self._resume_from = self._next_batch = int(state["next_batch"]) % max(len(self.source), 1)


class DLRMDataModule(pl.LightningDataModule):
    """Criteo-format click data for :class:`~lightning_dlrover.models.DLRMModule`.

    Synthetic by default; set ``criteo_paths`` (and optionally ``val_criteo_paths``) to train on real
    Criteo Kaggle/Terabyte TSV files.

    Args:
        num_embeddings_per_feature: table size of each of the 26 categorical features (must match the model).
        global_batch_size: samples per step summed over all ranks; must be divisible by the world size.
        train_batches: global batches per training epoch (synthetic data).
        val_batches: global batches per validation run (synthetic data); 0 disables validation.
        seed: seed of the synthetic stream (validation uses ``seed + 1``).
        alpha: power-law exponent of synthetic ids.
        criteo_paths: Criteo TSV files for training.
        val_criteo_paths: Criteo TSV files for validation.
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
    ) -> None:
        super().__init__()
        if len(num_embeddings_per_feature) != NUM_SPARSE:
            raise ValueError(
                f"data.num_embeddings_per_feature has {len(num_embeddings_per_feature)} entries; "
                f"Criteo has {NUM_SPARSE} categorical features."
            )
        if global_batch_size < 1:
            raise ValueError(f"data.global_batch_size={global_batch_size} must be positive.")
        self.save_hyperparameters()
        self._train_loader: ResumableLoader | None = None

    def _source(self, train: bool) -> BatchSource:
        hp = self.hparams
        paths = hp.criteo_paths if train else hp.val_criteo_paths
        if paths:
            return CriteoTSV(paths, hp.num_embeddings_per_feature, hp.global_batch_size)
        return SyntheticCriteo(
            hp.num_embeddings_per_feature,
            hp.global_batch_size,
            hp.train_batches if train else hp.val_batches,
            seed=hp.seed if train else hp.seed + 1,
            alpha=hp.alpha,
        )

    def _loader(self, train: bool) -> ResumableLoader:
        trainer = self.trainer
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        return ResumableLoader(self._source(train), rank, world_size)

    def train_dataloader(self) -> ResumableLoader:
        """The rank's training loader; the same object across epochs so its position is checkpointed."""
        if self._train_loader is None:
            self._train_loader = self._loader(train=True)
        return self._train_loader

    def val_dataloader(self) -> ResumableLoader | list:
        """The rank's validation loader, or none when validation is disabled."""
        if not self.hparams.val_criteo_paths and self.hparams.val_batches == 0:
            return []
        return self._loader(train=False)
