"""Elastic scaling with batch size: batch policies and LR rules, goodput, the multi-job allocator and simulator.
Exports are imported when first used (``simulate`` needs neither Lightning nor TorchRec)."""

from typing import TYPE_CHECKING

from lightning_dlrover._lazy import exports

if TYPE_CHECKING:
    from lightning_dlrover.elastic.allocator import Allocation, Job, allocate
    from lightning_dlrover.elastic.batch import (
        BatchDecision,
        BatchRange,
        choose_batch,
        decide,
        lr_factor,
        scale_learning_rates,
    )
    from lightning_dlrover.elastic.scaler import ElasticBatchScaler

__getattr__, __dir__ = exports(__name__, {
    "Allocation": "lightning_dlrover.elastic.allocator",
    "Job": "lightning_dlrover.elastic.allocator",
    "allocate": "lightning_dlrover.elastic.allocator",
    "ElasticBatchScaler": "lightning_dlrover.elastic.scaler",
    "BatchDecision": "lightning_dlrover.elastic.batch",
    "BatchRange": "lightning_dlrover.elastic.batch",
    "choose_batch": "lightning_dlrover.elastic.batch",
    "decide": "lightning_dlrover.elastic.batch",
    "lr_factor": "lightning_dlrover.elastic.batch",
    "scale_learning_rates": "lightning_dlrover.elastic.batch",
})  # fmt: skip
__all__ = ["Allocation", "BatchDecision", "BatchRange", "ElasticBatchScaler", "Job", "allocate", "choose_batch", "decide", "lr_factor",
           "scale_learning_rates"]
