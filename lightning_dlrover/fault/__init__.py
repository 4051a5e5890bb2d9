"""Fault tolerance: parity placement, erasure-coded embedding state, the per-step commit protocol and its
manager (spill, restore, fallback), fault injection. Exports are imported when first used (the launchers
use :mod:`.membership` without Lightning or TorchRec)."""

from typing import TYPE_CHECKING

from lightning_dlrover._lazy import exports

if TYPE_CHECKING:
    from lightning_dlrover.fault.coding.coded_embeddings import CodedEmbeddings
    from lightning_dlrover.fault.coding.coded_state import CodedState
    from lightning_dlrover.fault.injector import FaultInjector
    from lightning_dlrover.fault.points import FAULT_ENV
    from lightning_dlrover.worker_env import elastic_trainer_args
    from lightning_dlrover.fault.manager import FaultManager
    from lightning_dlrover.fault.coding.placement import ParityConfig, ParityPlacement
    from lightning_dlrover.fault.report import RecoveryReport, Unrecoverable
    from lightning_dlrover.fault.replicated_state import ReplicatedSnapshot

__getattr__, __dir__ = exports(__name__, {
    "CodedEmbeddings": "lightning_dlrover.fault.coding.coded_embeddings",
    "CodedState": "lightning_dlrover.fault.coding.coded_state",
    "FAULT_ENV": "lightning_dlrover.fault.points",
    "FaultInjector": "lightning_dlrover.fault.injector",
    "elastic_trainer_args": "lightning_dlrover.worker_env",
    "FaultManager": "lightning_dlrover.fault.manager",
    "ParityConfig": "lightning_dlrover.fault.coding.placement",
    "ParityPlacement": "lightning_dlrover.fault.coding.placement",
    "RecoveryReport": "lightning_dlrover.fault.report",
    "Unrecoverable": "lightning_dlrover.fault.report",
    "ReplicatedSnapshot": "lightning_dlrover.fault.replicated_state",
})  # fmt: skip
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
