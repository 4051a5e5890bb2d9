"""Observing training: per-rank throughput, step-time breakdown, resource use, and state digests."""

from lightning_dlrover.monitor.digest import StateDigest, state_digest, training_state_digest
from lightning_dlrover.monitor.events import Event, emit, read_events
from lightning_dlrover.monitor.steps import StepRecord
from lightning_dlrover.monitor.throughput import RankThroughput, StepTimer, ThroughputMonitor, ThroughputSummary

__all__ = [
    "Event",
    "emit",
    "read_events",
    "state_digest",
    "RankThroughput",
    "StateDigest",
    "StepRecord",
    "StepTimer",
    "ThroughputMonitor",
    "ThroughputSummary",
    "training_state_digest",
]
