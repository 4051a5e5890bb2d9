"""Resource advisor (DLRover-RM): a fitted resource-performance model, job history, warm start, recommendations,
stragglers, out-of-memory forecasts, hot ranks and sharding re-plans."""

from lightning_dlrover.advisor.callback import ResourceAdvisor
from lightning_dlrover.advisor.control import BatchSizeControl, DataWorkersControl
from lightning_dlrover.advisor.detectors import OOMForecaster, StragglerDetector
from lightning_dlrover.advisor.model import JobShape, Observation, PerformanceModel
from lightning_dlrover.advisor.recommend import Recommendation, recommend
from lightning_dlrover.advisor.resources import Machine, ResourceConfig, SearchSpace
from lightning_dlrover.advisor.signature import JobSignature


def __getattr__(name: str):
    if name == "JobHistory":  # SQLAlchemy is imported when a history is used, not with the package
        from lightning_dlrover.advisor.history import JobHistory

        return JobHistory
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BatchSizeControl",
    "DataWorkersControl",
    "JobHistory",
    "JobShape",
    "JobSignature",
    "Machine",
    "OOMForecaster",
    "Observation",
    "PerformanceModel",
    "Recommendation",
    "ResourceAdvisor",
    "ResourceConfig",
    "SearchSpace",
    "StragglerDetector",
    "recommend",
]
