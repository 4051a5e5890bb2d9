"""Sharded checkpoint backends and the checkpoint directory format."""

from lightning_dlrover.checkpoint.backends import (
    BACKENDS,
    CheckpointBackend,
    DCPBackend,
    TorchSnapshotBackend,
    get_backend,
)
from lightning_dlrover.checkpoint.sharded import complete_sharded_state, flatten

__all__ = [
    "BACKENDS",
    "CheckpointBackend",
    "DCPBackend",
    "TorchSnapshotBackend",
    "complete_sharded_state",
    "flatten",
    "get_backend",
]
