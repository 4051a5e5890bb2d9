"""``lightning-dlrover fit``: LightningCLI for the DLRM (``lightning-dlrover fit --config configs/demo.yaml``)."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_dlrover  # noqa: F401  (registers strategy="dlrover")
from lightning_dlrover.data import DLRMDataModule
from lightning_dlrover.data.sources import rank_slice
from lightning_dlrover.elastic.scaler import ElasticBatchScaler
from lightning_dlrover.fault import elastic_trainer_args
from lightning_dlrover.models import DLRMModule
from lightning_dlrover.strategy import DLRoverStrategy
from lightning_dlrover.strategy.launcher import validate_addons


class DLRoverCLI(LightningCLI):
    """LightningCLI for :class:`DLRMModule` and :class:`DLRMDataModule`; the data takes its table sizes from the model."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.num_embeddings_per_feature", "data.num_embeddings_per_feature")

    def before_instantiate_classes(self) -> None:
        """Under ``torchrun``, takes ``devices`` and ``num_nodes`` from the worker group (it may have shrunk or grown)."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        for key, value in elastic_trainer_args().items():
            config.trainer[key] = value
        check_addons(config.trainer.get("callbacks"))

    def before_fit(self) -> None:
        """Rejects a config the job cannot run (the tables named in the strategy, its sharding types, the embedding
        optimizer, a global batch the world size does not divide) in this process, before the trainer starts the
        other ranks: each would fail the same way in its set-up, after seconds of start-up."""
        if isinstance(self.trainer.strategy, DLRoverStrategy):
            self.trainer.strategy.check_model(self.model)
        if not any(isinstance(c, ElasticBatchScaler) for c in self.trainer.callbacks):  # it may fit the batch to the world
            rank_slice(self.datamodule.hparams.global_batch_size, 0, self.trainer.world_size)
        try:  # add-ons: what the world size or the outside world can refuse (the strategy's launcher checks it too)
            validate_addons(self.trainer.callbacks, self.trainer.world_size)
        except ValueError as err:
            _refuse("trainer.callbacks: " + str(err).replace("\n", "\ntrainer.callbacks: "))


def _refuse(message: str) -> None:
    """Ends the command with one line on stderr and exit status 2 (a usage error), before any rank starts."""
    print(f"lightning-dlrover fit: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def check_addons(callbacks: Any) -> None:
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
            _refuse(f"trainer.callbacks: {'' if str(err).startswith(name) else f'{name}: '}{err}")


def fit(args: list[str] | None) -> None:
    """Runs LightningCLI with ``args`` (e.g. ``["fit", "--config", "configs/demo.yaml"]``; ``None``: the command line)."""
    DLRoverCLI(
        DLRMModule,
        DLRMDataModule,
        args=args,
        parser_kwargs={"prog": "lightning-dlrover"},
        save_config_kwargs={"overwrite": True},  # a restarted elastic worker rewrites the same config
    )
