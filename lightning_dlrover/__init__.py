"""lightning-dlrover: fault-tolerant, self-tuning training of TorchRec DLRMs in PyTorch Lightning.

The exports below are imported when first used (the launchers need neither Lightning nor TorchRec);
``Trainer(strategy="dlrover")`` works after ``import lightning_dlrover`` (see :mod:`._registration`)."""

from typing import TYPE_CHECKING

from lightning_dlrover._lazy import exports
from lightning_dlrover._registration import register_when_lightning_loads

if TYPE_CHECKING:
    from lightning_dlrover.advisor import ResourceAdvisor
    from lightning_dlrover.elastic.scaler import ElasticBatchScaler
    from lightning_dlrover.fault import FaultInjector, ParityConfig, elastic_trainer_args
    from lightning_dlrover.monitor import StateDigest, ThroughputMonitor
    from lightning_dlrover.pipeline_tuner import PipelineTuner
    from lightning_dlrover.strategy import DLRoverStrategy, TableConstraint

register_when_lightning_loads()

__version__ = "0.1.0"
__getattr__, __dir__ = exports(__name__, {
    "ElasticBatchScaler": "lightning_dlrover.elastic.scaler",
    "DLRoverStrategy": "lightning_dlrover.strategy",
    "FaultInjector": "lightning_dlrover.fault",
    "ParityConfig": "lightning_dlrover.fault",
    "PipelineTuner": "lightning_dlrover.pipeline_tuner",
    "ResourceAdvisor": "lightning_dlrover.advisor",
    "StateDigest": "lightning_dlrover.monitor",
    "TableConstraint": "lightning_dlrover.strategy",
    "ThroughputMonitor": "lightning_dlrover.monitor",
    "elastic_trainer_args": "lightning_dlrover.fault",
})  # fmt: skip
__all__ = [
    "ElasticBatchScaler",
    "DLRoverStrategy",
    "FaultInjector",
    "ParityConfig",
    "PipelineTuner",
    "ResourceAdvisor",
    "StateDigest",
    "TableConstraint",
    "ThroughputMonitor",
    "__version__",
    "elastic_trainer_args",
]
