"""Fault tolerance: parity placement over ranks, erasure-coded embedding state, the per-step commit protocol."""

from lightning_dlrover.fault.coded_embeddings import CodedEmbeddings
from lightning_dlrover.fault.coded_state import CodedState
from lightning_dlrover.fault.placement import ParityConfig, ParityPlacement
from lightning_dlrover.fault.replicated_state import ReplicatedSnapshot

__all__ = ["CodedEmbeddings", "CodedState", "ParityConfig", "ParityPlacement", "ReplicatedSnapshot"]
