"""The check ``DLRoverStrategy`` runs at its first set-up under an elastic launcher (``torchrun --nnodes MIN:MAX``):
the batch and the parity must fit every world size the job may take."""

from __future__ import annotations

from typing import Any

from lightning_dlrover.strategy.sharding import check_elastic_sizes
from lightning_dlrover.worker_env import node_range


def check_elastic_range(strategy: Any, trainer: Any) -> None:
    """Raises ``ValueError`` (see :func:`~lightning_dlrover.strategy.sharding.check_elastic_sizes`) when the data
    module's global batch or ``strategy``'s parity does not fit a world size of the launcher's node range."""
    nodes = node_range()
    if nodes is None:
        return
    sizes = [n * strategy.num_processes for n in range(nodes[0], nodes[1] + 1)]
    hparams = getattr(trainer.datamodule, "hparams", {}) if trainer.datamodule is not None else {}
    parity = (strategy.parity.k, strategy.parity.r) if strategy.parity is not None else None
    check_elastic_sizes(sizes, hparams.get("global_batch_size"), parity)
