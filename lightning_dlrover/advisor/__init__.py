"""Resource advisor (DLRover-RM): a fitted resource-performance model, job history, warm start, recommendations,
stragglers, out-of-memory forecasts, hot ranks and sharding re-plans. Exports are imported when first used
(SQLAlchemy with a history, Lightning with the callback)."""

from typing import TYPE_CHECKING

from lightning_dlrover._lazy import exports

if TYPE_CHECKING:
    from lightning_dlrover.advisor.callback import ResourceAdvisor
    from lightning_dlrover.advisor.control import BatchSizeControl, DataWorkersControl
    from lightning_dlrover.advisor.detectors import OOMForecaster, StragglerDetector
    from lightning_dlrover.advisor.history import JobHistory
    from lightning_dlrover.advisor.model import JobShape, Observation, PerformanceModel
    from lightning_dlrover.advisor.recommend import Recommendation, recommend
    from lightning_dlrover.advisor.resources import Machine, ResourceConfig, SearchSpace
    from lightning_dlrover.advisor.signature import JobSignature

__getattr__, __dir__ = exports(__name__, {
    "ResourceAdvisor": "lightning_dlrover.advisor.callback",
    "BatchSizeControl": "lightning_dlrover.advisor.control",
    "DataWorkersControl": "lightning_dlrover.advisor.control",
    "OOMForecaster": "lightning_dlrover.advisor.detectors",
    "StragglerDetector": "lightning_dlrover.advisor.detectors",
    "JobShape": "lightning_dlrover.advisor.model",
    "Observation": "lightning_dlrover.advisor.model",
    "PerformanceModel": "lightning_dlrover.advisor.model",
    "Recommendation": "lightning_dlrover.advisor.recommend",
    "recommend": "lightning_dlrover.advisor.recommend",
    "Machine": "lightning_dlrover.advisor.resources",
    "ResourceConfig": "lightning_dlrover.advisor.resources",
    "SearchSpace": "lightning_dlrover.advisor.resources",
    "JobSignature": "lightning_dlrover.advisor.signature",
    "JobHistory": "lightning_dlrover.advisor.history",
})  # fmt: skip
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
