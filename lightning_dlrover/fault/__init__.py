"""Fault tolerance. A strategy talks to :class:`FaultManager` only (with :class:`ParityConfig` and
:class:`FaultInjector`); below it, one room each:

- :mod:`.commit`: the per-step commit protocol (what a committed step holds, the vote);
- :mod:`.coding`: the erasure-coded embedding state (chunks, undo log, placement, delta exchange, decode);
- :mod:`.restart`: recovery across a restart of every worker (spills, renumbering, re-shard, fallback);
- :mod:`.inplace`: in-process recovery under ``lightning-dlrover launch`` (membership, reconfigurable group,
  survivor/replacement protocol, the launcher's supervisor, shrink and grow);
- :mod:`.points` / :mod:`.injector`: the drill vocabulary and the fault injector.

Exports are imported when first used (the launchers use :mod:`.inplace` without Lightning or TorchRec)."""

from typing import TYPE_CHECKING

from lightning_dlrover._lazy import exports

if TYPE_CHECKING:
    from lightning_dlrover.fault.coding.coded_embeddings import CodedEmbeddings
    from lightning_dlrover.fault.coding.coded_state import CodedState
    from lightning_dlrover.fault.coding.placement import ParityConfig, ParityPlacement
    from lightning_dlrover.fault.host import Host
    from lightning_dlrover.fault.injector import FaultInjector
    from lightning_dlrover.fault.manager import FaultManager
    from lightning_dlrover.fault.points import FAULT_ENV, VERIFY_RESIZE_ENV
    from lightning_dlrover.fault.replicated_state import ReplicatedSnapshot
    from lightning_dlrover.fault.report import RecoveryReport, ReshardRequested, ResizeRequested, Unrecoverable
    from lightning_dlrover.worker_env import elastic_trainer_args

__getattr__, __dir__ = exports(__name__, {
    "CodedEmbeddings": "lightning_dlrover.fault.coding.coded_embeddings",
    "CodedState": "lightning_dlrover.fault.coding.coded_state",
    "FAULT_ENV": "lightning_dlrover.fault.points",
    "VERIFY_RESIZE_ENV": "lightning_dlrover.fault.points",
    "ResizeRequested": "lightning_dlrover.fault.report",
    "ReshardRequested": "lightning_dlrover.fault.report",
    "FaultInjector": "lightning_dlrover.fault.injector",
    "Host": "lightning_dlrover.fault.host",
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
    "ResizeRequested",
    "Host",
    "ParityConfig",
    "ParityPlacement",
    "RecoveryReport",
    "ReplicatedSnapshot",
    "ReshardRequested",
    "Unrecoverable",
    "VERIFY_RESIZE_ENV",
    "elastic_trainer_args",
]
