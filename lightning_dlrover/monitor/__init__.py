"""Per-rank throughput, step-time breakdown and resource use of training."""

from lightning_dlrover.monitor.throughput import RankThroughput, StepTimer, ThroughputMonitor, ThroughputSummary

__all__ = ["RankThroughput", "StepTimer", "ThroughputMonitor", "ThroughputSummary"]
