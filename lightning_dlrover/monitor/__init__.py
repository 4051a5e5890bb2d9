"""Observing training: per-rank throughput, step-time breakdown, resource use, and state digests."""

from lightning_dlrover.monitor.digest import StateDigest, training_state_digest
from lightning_dlrover.monitor.throughput import RankThroughput, StepTimer, ThroughputMonitor, ThroughputSummary

__all__ = [
    "RankThroughput",
    "StateDigest",
    "StepTimer",
    "ThroughputMonitor",
    "ThroughputSummary",
    "training_state_digest",
]
