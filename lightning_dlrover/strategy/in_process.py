"""Wires in-process recovery (:mod:`lightning_dlrover.fault.inplace.protocol`) into a Lightning fit.

Under ``lightning-dlrover launch`` the world group is reconfigurable; a survivor whose step fails on a lost
peer is restored to the last committed step and its fit loop runs again, and a replacement joins at the
start of its fit loop. Everything else in the strategy is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import lightning.pytorch as pl
from torchrec.distributed.types import ShardingPlan

from lightning_dlrover import lightning_glue as glue
from lightning_dlrover.fault import FaultManager, Host
from lightning_dlrover.torchrec_glue import skip_collective_validation_broadcast

if TYPE_CHECKING:
    from lightning_dlrover.fault.inplace.protocol import InProcessRecovery
    from lightning_dlrover.fault.report import RecoveryReport


def install(trainer: pl.Trainer, host: Host, recovery: InProcessRecovery) -> None:
    """Makes ``trainer``'s fit loop recover lost peers in process (and, on a replacement, join first)."""

    def resume(report: RecoveryReport) -> None:
        for optimizer in trainer.optimizers:  # a failed step may have left gradients behind
            optimizer.zero_grad(set_to_none=True)
        assert report.meta is not None
        glue.load_trainer_state(trainer, report.meta)

    def recover(error: BaseException) -> bool:
        report = recovery.recover(host, error)
        if report is None:
            return False
        glue.reset_inner_ddp(trainer.strategy.model)
        resume(report)
        return True

    def join() -> None:
        resume(recovery.join(host))

    replacement = FaultManager.joining()
    if replacement:
        trainer.num_sanity_val_steps = 0  # the survivors are past it
    glue.rerun_fit_loop(trainer, recover, before_first_run=join if replacement else None)


def shared_plan(manager: FaultManager, compute: Callable[[], ShardingPlan], global_rank: int) -> ShardingPlan:
    """The sharding plan: computed by the planner's collective, and kept in the launcher's store for replacements,
    which read it instead (the survivors are not running the planner)."""

    def before_reading() -> None:
        # DistributedModelParallel's constructor broadcasts TorchRec's collective-validation flag from rank 0
        # once per process; the survivors are not listening, so the replacement keeps the default (off).
        skip_collective_validation_broadcast()

    return manager.shared_plan(compute, global_rank, before_reading)
