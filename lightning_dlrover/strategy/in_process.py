"""Wires in-process recovery (:mod:`lightning_dlrover.fault.inplace.protocol`) into a Lightning fit.

Under ``lightning-dlrover launch`` the world group is reconfigurable; a survivor whose step fails on a lost
peer is restored to the last committed step and its fit loop runs again, and a replacement joins at the
start of its fit loop. Everything else in the strategy is unchanged.

A shrink plan (no spare, none wanted: see :mod:`lightning_dlrover.fault.inplace.shrink`) is run by :func:`shrinker`:
the committed state is kept as spills in memory, the world group is reconfigured to the smaller world with this
rank's new number, the environment, Lightning's ranks and the data loader follow, the model's tables are sharded anew
for the smaller world (TorchRec's ``DistributedModelParallel.reshard`` moves shards within a fixed world only: see
:mod:`~lightning_dlrover.fault.inplace.shrink`) and filled by the restart path's decode and re-shard, the optimizers
are set up again, and the fit loop resumes at the committed step with the same global batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

from lightning_dlrover import lightning_glue as glue
from lightning_dlrover.fault import FaultManager, Host
from lightning_dlrover.strategy import shard_model

if TYPE_CHECKING:
    from lightning_dlrover.fault.inplace.protocol import InProcessRecovery
    from lightning_dlrover.fault.report import RecoveryReport
    from lightning_dlrover.strategy.dlrover import DLRoverStrategy


def install(trainer: pl.Trainer, host: Host, recovery: InProcessRecovery) -> None:
    """Makes ``trainer``'s fit loop recover lost peers in process (and, on a replacement, join first)."""

    def resume(report: RecoveryReport) -> None:
        for optimizer in trainer.optimizers:  # a failed step may have left gradients behind
            optimizer.zero_grad(set_to_none=True)
        assert report.meta is not None
        glue.load_trainer_state(trainer, report.meta)

    def recover(error: BaseException) -> bool:
        model = trainer.strategy.model
        report = recovery.recover(host, error)
        if report is None:
            return False
        if trainer.strategy.model is model:  # (a shrink built a new one)
            glue.reset_inner_ddp(model)
        resume(report)
        return True

    def join() -> None:
        resume(recovery.join(host))

    recovery.shrinker = shrinker(trainer, trainer.strategy)  # type: ignore[arg-type]
    replacement = FaultManager.joining()
    if replacement:
        trainer.num_sanity_val_steps = 0  # the survivors are past it
    glue.rerun_fit_loop(trainer, recover, before_first_run=join if replacement else None)


def shrinker(trainer: pl.Trainer, strategy: DLRoverStrategy) -> Callable[[int, int], None]:
    """Makes a survivor of a shrink rank ``rank`` of ``world_size`` and shards its model anew for that world, with
    fresh optimizers (the fault manager then restores the committed state into it). Raises on any failure: the caller
    re-raises the original error and the launcher restarts every worker."""

    def run(rank: int, world_size: int) -> None:
        renumber(strategy, rank, world_size)
        module = strategy.lightning_module
        shard_model.unshard(strategy, module)
        strategy._dmp = strategy.model = shard_model.shard(strategy, module, initialise=False)  # the restore fills it
        strategy.setup_optimizers(trainer)

    return run


def renumber(strategy: Any, rank: int, world_size: int) -> None:
    """Makes this process rank ``rank`` of ``world_size`` for everything that reads the rank and world size: the
    launcher's environment (Lightning's cluster environment reads it), the strategy's devices and ranks, and
    Lightning's ``rank_zero_only``. One machine: the local rank is the rank."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    strategy.parallel_devices = strategy.parallel_devices[:world_size]
    strategy.set_world_ranks()
