"""lightning-dlrover: fault-tolerant, self-tuning training of TorchRec DLRMs in PyTorch Lightning."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dlrover.advisor import ResourceAdvisor
from lightning_dlrover.elastic.scaler import ElasticBatchScaler
from lightning_dlrover.fault import FaultInjector, ParityConfig, elastic_trainer_args
from lightning_dlrover.monitor import StateDigest, ThroughputMonitor
from lightning_dlrover.pipeline import PipelineTuner
from lightning_dlrover.strategy import DLRoverStrategy, TableConstraint

DLRoverStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
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
