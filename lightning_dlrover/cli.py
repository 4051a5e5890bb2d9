"""``lightning-dlrover`` command line: LightningCLI for the DLRM (``lightning-dlrover fit --config configs/demo.yaml``)."""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_dlrover  # noqa: F401  (registers strategy="dlrover")
from lightning_dlrover.data import DLRMDataModule
from lightning_dlrover.models import DLRMModule


class DLRoverCLI(LightningCLI):
    """LightningCLI for :class:`DLRMModule` and :class:`DLRMDataModule`; the data takes its table sizes from the model."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.num_embeddings_per_feature", "data.num_embeddings_per_feature")


def main(args: list[str] | None = None) -> None:
    """Runs the CLI (``args`` defaults to ``sys.argv[1:]``)."""
    DLRoverCLI(
        DLRMModule,
        DLRMDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},  # a restarted elastic worker rewrites the same config
    )
