"""The Lightning strategy: TorchRec sharding, sharded checkpoints, and the hooks of the fault-tolerance layer."""

from lightning_dlrover.strategy.dlrover import DLRoverStrategy
from lightning_dlrover.strategy.sharding import TableConstraint

__all__ = ["DLRoverStrategy", "TableConstraint"]
