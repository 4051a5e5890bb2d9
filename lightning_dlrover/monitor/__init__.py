"""Observing training: per-rank throughput, step-time breakdown, resource use, and state digests. Exports are
imported when first used (:mod:`.events` alone needs neither Lightning nor torch)."""

from typing import TYPE_CHECKING

from lightning_dlrover._lazy import exports

if TYPE_CHECKING:
    from lightning_dlrover.monitor.digest import StateDigest, state_digest, training_state_digest
    from lightning_dlrover.monitor.events import Event, emit, read_events
    from lightning_dlrover.monitor.steps import StepRecord
    from lightning_dlrover.monitor.throughput import RankThroughput, StepTimer, ThroughputMonitor, ThroughputSummary

__getattr__, __dir__ = exports(__name__, {
    "StateDigest": "lightning_dlrover.monitor.digest",
    "state_digest": "lightning_dlrover.monitor.digest",
    "training_state_digest": "lightning_dlrover.monitor.digest",
    "Event": "lightning_dlrover.monitor.events",
    "emit": "lightning_dlrover.monitor.events",
    "read_events": "lightning_dlrover.monitor.events",
    "StepRecord": "lightning_dlrover.monitor.steps",
    "RankThroughput": "lightning_dlrover.monitor.throughput",
    "StepTimer": "lightning_dlrover.monitor.throughput",
    "ThroughputMonitor": "lightning_dlrover.monitor.throughput",
    "ThroughputSummary": "lightning_dlrover.monitor.throughput",
})  # fmt: skip
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
