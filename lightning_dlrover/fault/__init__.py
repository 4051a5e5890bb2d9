"""Fault tolerance: parity placement, erasure-coded embedding state, the per-step commit protocol and its
manager (spill, restore, fallback), fault injection."""

from lightning_dlrover.fault.coded_embeddings import CodedEmbeddings
from lightning_dlrover.fault.coded_state import CodedState
from lightning_dlrover.fault.injector import FAULT_ENV, FaultInjector
from lightning_dlrover.fault.launcher import elastic_trainer_args
from lightning_dlrover.fault.manager import FaultManager
from lightning_dlrover.fault.placement import ParityConfig, ParityPlacement
from lightning_dlrover.fault.recovery import RecoveryReport, Unrecoverable
from lightning_dlrover.fault.replicated_state import ReplicatedSnapshot

__all__ = [
    "FAULT_ENV",
    "CodedEmbeddings",
    "CodedState",
    "FaultInjector",
    "FaultManager",
    "ParityConfig",
    "ParityPlacement",
    "RecoveryReport",
    "ReplicatedSnapshot",
    "Unrecoverable",
    "elastic_trainer_args",
]
