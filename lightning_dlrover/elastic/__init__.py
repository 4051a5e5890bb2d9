"""Elastic scaling with batch size: batch policies and LR rules, goodput, the multi-job allocator and simulator."""

from lightning_dlrover.elastic.allocator import Allocation, Job, allocate
from lightning_dlrover.elastic.scaler import ElasticBatchScaler
from lightning_dlrover.elastic.batch import BatchDecision, BatchRange, choose_batch, decide, lr_factor, scale_learning_rates

__all__ = ["Allocation", "BatchDecision", "BatchRange", "ElasticBatchScaler", "Job", "allocate", "choose_batch", "decide", "lr_factor",
           "scale_learning_rates"]
