"""``lightning-dlrover fit``: LightningCLI for the DLRM (``lightning-dlrover fit --config configs/demo.yaml``), and its
``validate``, ``test`` and ``predict`` (``--ckpt_path``: a checkpoint directory; ``predict`` writes
``--predictions.out``, see :class:`~lightning_dlrover.models.PredictionWriter`)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_dlrover  # noqa: F401  (registers strategy="dlrover")
from lightning_dlrover.checkpoint.directory import check_path
from lightning_dlrover.data import DLRMDataModule
from lightning_dlrover.data.sources import rank_slice
from lightning_dlrover.data.tsv_parse import MalformedLine
from lightning_dlrover.elastic.scaler import ElasticBatchScaler
from lightning_dlrover.fault import elastic_trainer_args
from lightning_dlrover.models import DLRMModule, PredictionWriter
from lightning_dlrover.models.predictions import require_pyarrow
from lightning_dlrover.strategy import DLRoverStrategy
from lightning_dlrover.strategy.launcher import AddonConfigError, StrategyConfigError


class DLRoverCLI(LightningCLI):
    """LightningCLI for :class:`DLRMModule` and :class:`DLRMDataModule`; the data takes its table sizes from the model."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.num_embeddings_per_feature", "data.num_embeddings_per_feature")
        # predict's output (--predictions.out, --predictions.format): a callback of every subcommand, idle outside predict
        parser.add_lightning_class_args(PredictionWriter, "predictions")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parses the command line, then refuses a ``ckpt_path`` that is no checkpoint directory and ``test``/``predict``
        without one (before LightningCLI reads a checkpoint file's hyper-parameters, and before any rank starts)."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        if subcommand in ("test", "predict") and config.get("ckpt_path") is None:
            _refuse(f"{subcommand} needs --ckpt_path: the checkpoint directory of a fit (e.g. "
                    "<default_root_dir>/lightning_logs/version_0/checkpoints/last.ckpt); without one it would "
                    f"{subcommand} an untrained model.", subcommand)
        ckpt_path = config.get("ckpt_path")
        strategy = config.trainer.get("strategy")
        dlrover = "dlrover" in str(getattr(strategy, "class_path", strategy)).lower()
        if dlrover and ckpt_path is not None and str(ckpt_path) not in ("last", "best", "hpc", "registry"):
            try:
                check_path(Path(ckpt_path))
            except FileNotFoundError as err:
                _refuse(f"--ckpt_path: {err}", subcommand)

    def before_instantiate_classes(self) -> None:
        """Under ``torchrun``, takes ``devices`` and ``num_nodes`` from the worker group (it may have shrunk or grown).
        Refuses, in this process before any rank starts, what would fail in every rank: a bad add-on option, Parquet
        without pyarrow."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        for key, value in elastic_trainer_args().items():
            config.trainer[key] = value
        check_addons(config.trainer.get("callbacks"), self.subcommand)
        writer = config.get("predictions")
        if writer is not None and (writer.get("format") == "parquet" or str(writer.get("out")).endswith(".parquet")):
            try:
                require_pyarrow()
            except ImportError as err:
                _refuse(f"predictions: {err}", self.subcommand)
        if self.subcommand == "predict" and config.get("return_predictions") is None:
            config.return_predictions = False  # the writer streams them to a file; do not also hold them all

    def before_fit(self) -> None:
        """Rejects a config the job cannot run (the tables named in the strategy, its sharding types, the embedding
        optimizer, a global batch the world size does not divide) in this process, before the trainer starts the
        other ranks: each would fail the same way in its set-up, after seconds of start-up."""
        if isinstance(self.trainer.strategy, DLRoverStrategy):
            try:
                self.trainer.strategy.check_model(self.model)
            except ValueError as err:  # each message names the field and the fix: one line, not a traceback
                _refuse(str(err))
        if not any(isinstance(c, ElasticBatchScaler) for c in self.trainer.callbacks):  # it may fit the batch to the world
            self._check_batch("fit")
        # The add-ons' own checks (what the world size or the outside world can refuse) run once, in the strategy's
        # launcher before it starts the ranks; :func:`fit` turns their AddonConfigError into the one-line error.

    def before_test(self) -> None:
        """Refuses a global batch the world size does not divide before the ranks start."""
        self._check_batch("test")

    def before_predict(self) -> None:
        """Refuses a global batch the world size does not divide before the ranks start."""
        self._check_batch("predict")

    def _check_batch(self, command: str) -> None:
        try:
            rank_slice(self.datamodule.hparams.global_batch_size, 0, self.trainer.world_size)
        except ValueError as err:
            _refuse(str(err), command)


def _refuse(message: str, command: str | None = "fit") -> None:
    """Ends the command with one line on stderr and exit status 2 (a usage error), before any rank starts."""
    print(f"lightning-dlrover {command or 'fit'}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def check_addons(callbacks: Any, command: str | None = "fit") -> None:
    """Builds each of the package's add-on callbacks of the config once (``class_path: lightning_dlrover...``), so a
    bad option ends the command with one line naming it (not jsonargparse's dump of every type it tried)."""
    for entry in callbacks if isinstance(callbacks, list) else [callbacks] if callbacks else []:
        class_path = getattr(entry, "class_path", None)
        if not isinstance(class_path, str) or not class_path.startswith("lightning_dlrover."):
            continue
        module, name = class_path.rsplit(".", 1)
        init_args = getattr(entry, "init_args", None)
        kwargs = init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args or {})
        try:
            getattr(importlib.import_module(module), name)(**kwargs)
        except (ValueError, TypeError) as err:
            _refuse(f"trainer.callbacks: {'' if str(err).startswith(name) else f'{name}: '}{err}", command)


def fit(args: list[str] | None) -> None:
    """Runs LightningCLI with ``args`` (e.g. ``["fit", "--config", "configs/demo.yaml"]``; ``None``: the command line).

    A malformed data line (``data.pipeline.on_error: raise``) ends the command with its one-line message (file, line,
    what is wrong, how to go on) and exit status 1, not the trainer's traceback around it. From Python, ``Trainer.fit``
    raises the :class:`~lightning_dlrover.data.tsv_parse.MalformedLine` itself. An add-on that refuses its config
    (:class:`~lightning_dlrover.strategy.launcher.AddonConfigError`, raised before any rank starts) ends it with one
    line per refusal and exit status 2; so does a strategy option the world size cannot run
    (:class:`~lightning_dlrover.strategy.launcher.StrategyConfigError`)."""
    try:
        DLRoverCLI(
            DLRMModule,
            DLRMDataModule,
            args=args,
            parser_kwargs={"prog": "lightning-dlrover"},
            save_config_kwargs={"overwrite": True},  # a restarted elastic worker rewrites the same config
        )
    except MalformedLine as err:
        print(f"lightning-dlrover fit: error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    except (AddonConfigError, StrategyConfigError) as err:
        words = [str(a) for a in (sys.argv[1:] if args is None else args)]
        command = next((w for w in words if w in ("fit", "validate", "test", "predict")), "fit")
        if isinstance(err, AddonConfigError):
            _refuse("trainer.callbacks: " + str(err).replace("\n", "\ntrainer.callbacks: "), command)
        _refuse(str(err), command)
