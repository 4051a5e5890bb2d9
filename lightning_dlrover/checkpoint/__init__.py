"""Sharded checkpoint backends and the sharding-independent state digest."""

from lightning_dlrover.checkpoint.backends import BACKENDS, CheckpointBackend, DCPBackend, TorchSnapshotBackend, get_backend
from lightning_dlrover.checkpoint.digest import state_digest

__all__ = ["BACKENDS", "CheckpointBackend", "DCPBackend", "TorchSnapshotBackend", "get_backend", "state_digest"]
