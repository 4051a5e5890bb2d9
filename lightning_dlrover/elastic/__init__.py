"""Elastic scaling with batch size: the multi-job allocator (devices and batch sizes across jobs)."""

from lightning_dlrover.elastic.allocator import Allocation, Job, allocate

__all__ = ["Allocation", "Job", "allocate"]
