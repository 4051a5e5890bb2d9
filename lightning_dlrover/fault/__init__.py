"""Fault tolerance: parity placement, erasure-coded embedding state, the per-step commit protocol and its
manager (spill, restore, fallback), fault injection. Exports are imported when first used (the launchers
use :mod:`.membership` without Lightning or TorchRec)."""

from typing import TYPE_CHECKING

from lightning_dlrover._lazy import exports

if TYPE_CHECKING:
    from lightning_dlrover.fault.coded_embeddings import CodedEmbeddings
    from lightning_dlrover.fault.coded_state import CodedState
    from lightning_dlrover.fault.injector import FaultInjector
    from lightning_dlrover.fault.points import FAULT_ENV
    from lightning_dlrover.fault.launcher import elastic_trainer_args
    from lightning_dlrover.fault.manager import FaultManager
    from lightning_dlrover.fault.placement import ParityConfig, ParityPlacement
    from lightning_dlrover.fault.recovery import RecoveryReport, Unrecoverable
    from lightning_dlrover.fault.replicated_state import ReplicatedSnapshot

__getattr__, __dir__ = exports(__name__, {
    "CodedEmbeddings": "lightning_dlrover.fault.coded_embeddings",
    "CodedState": "lightning_dlrover.fault.coded_state",
    "FAULT_ENV": "lightning_dlrover.fault.points",
    "FaultInjector": "lightning_dlrover.fault.injector",
    "elastic_trainer_args": "lightning_dlrover.fault.launcher",
    "FaultManager": "lightning_dlrover.fault.manager",
    "ParityConfig": "lightning_dlrover.fault.placement",
    "ParityPlacement": "lightning_dlrover.fault.placement",
    "RecoveryReport": "lightning_dlrover.fault.recovery",
    "Unrecoverable": "lightning_dlrover.fault.recovery",
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
