"""Wires in-process recovery (:mod:`lightning_dlrover.fault.inplace.protocol`) into a Lightning fit.

Under ``lightning-dlrover launch`` the world group is reconfigurable; a survivor whose step fails on a lost
peer is restored to the last committed step and its fit loop runs again, and a replacement joins at the
start of its fit loop. Everything else in the strategy is unchanged.

A shrink plan (no spare, none wanted: see :mod:`lightning_dlrover.fault.inplace.shrink`) is run with the
:class:`Resharder`: the committed state is kept as spills in memory, the world group is reconfigured to the smaller
world with this rank's new number, the environment, Lightning's ranks and the data loader follow, the model's tables
are sharded anew for the smaller world (TorchRec's ``DistributedModelParallel.reshard`` moves shards within a fixed
world only: see :mod:`~lightning_dlrover.fault.inplace.shrink`) and filled by the restart path's decode and re-shard,
the optimizers are set up again, and the fit loop resumes at the committed step with the same global batch (or the one
an ``ElasticBatchScaler`` picks for the new world size: the fit loop's run calls ``on_train_start`` again).

A grow (``launch --regrow``) runs the same way at a step boundary every rank agreed on (:class:`ResizeRequested`, raised
after a commit whose vote carried the launcher's request): the tables are planned for the larger world first (the
joining ranks read that plan), and every rank, running or joining, then builds its sharded model alone before they
restore the committed state together.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from lightning_dlrover import lightning_glue as glue
from lightning_dlrover import worker_env
from lightning_dlrover.fault import VERIFY_RESIZE_ENV, FaultManager, ResizeRequested, Host, ReshardRequested
from lightning_dlrover.monitor import emit, state_digest
from lightning_dlrover.strategy import process_exit, shard_model
from lightning_dlrover.strategy.sharding import TableConstraint, describe_plan

if TYPE_CHECKING:
    from lightning_dlrover.fault.inplace.protocol import InProcessRecovery
    from lightning_dlrover.fault.report import RecoveryReport
    from lightning_dlrover.strategy.dlrover import DLRoverStrategy


def install(trainer: pl.Trainer, host: Host, recovery: InProcessRecovery) -> None:
    """Makes ``trainer``'s fit loop recover lost peers in process (and, on a replacement, join first)."""
    strategy: DLRoverStrategy = trainer.strategy  # type: ignore[assignment]

    def resume(report: RecoveryReport) -> None:
        for optimizer in trainer.optimizers:  # a failed step may have left gradients behind
            optimizer.zero_grad(set_to_none=True)
        assert report.meta is not None
        glue.load_trainer_state(trainer, report.meta)

    def recover(error: BaseException) -> bool:
        model = strategy.model
        before = verify_digest(strategy) if isinstance(error, (ResizeRequested, ReshardRequested)) else None
        report = recovery.recover(host, error)
        if report is None:
            return False
        if strategy.model is model:  # (a shrink built a new one)
            glue.reset_inner_ddp(model)
        resume(report)
        if before is not None and recovery.resized:
            verified(strategy, report, before)
        return True

    def join() -> None:
        report = recovery.join(host)
        resume(report)
        if recovery.resized and verify_digest(strategy) is not None:  # (the running ranks' digest before is theirs)
            verified(strategy, report, None)

    def leave() -> None:  # a rank a shrink the job asked for retires: its last save counts, then it ends
        strategy.checkpointing.wait()
        process_exit.leave()

    recovery.resharder, recovery.leave = Resharder(trainer, strategy), leave
    replacement = FaultManager.joining()
    if replacement:
        trainer.num_sanity_val_steps = 0  # the survivors are past it
    glue.rerun_fit_loop(trainer, recover, before_first_run=join if replacement else None)


class Resharder:
    """Re-shards a survivor's model for a new world size (a shrink or grow in process) or a new plan (a re-plan): the
    environment, Lightning's ranks and the data follow, the tables are sharded anew (uninitialised: the committed state
    is restored into them afterwards) and the optimizers are set up again. Raises on any failure: the caller writes the
    spills of the committed state and the launcher restarts every worker from them."""

    def __init__(self, trainer: pl.Trainer, strategy: DLRoverStrategy) -> None:
        self.trainer, self.strategy = trainer, strategy
        #: A re-plan that would move the pooled embeddings' key order is undone (the old plan and constraints back).
        self.keep_order: dict[str, Any] | None = None  # the constraints before the re-plan, while one is asked for

    def plan(self, world_size: int) -> Any:
        module = self.strategy.lightning_module
        shard_model.unshard(self.strategy, module)
        return shard_model.plan_for(self.strategy, module, world_size)

    def reshard(self, rank: int, world_size: int, plan: Any | None = None, local_world_size: int | None = None) -> str:
        strategy, module = self.strategy, self.strategy.lightning_module
        order = shard_model.pooled_keys(strategy)
        kept, old_plan, self.keep_order = self.keep_order, strategy._dmp.plan, None
        kept = kept if world_size == strategy.world_size else None  # (a re-plan's; a shrink or grow moves on)
        renumber(strategy, rank, world_size, local_world_size)
        if plan is None:  # a shrink or re-plan: the ranks plan together in the (new) world
            shard_model.unshard(strategy, module)
            strategy._dmp = strategy.model = shard_model.shard(strategy, module, initialise=False)
        else:  # a grow: the joining ranks build alone (collectives answered locally), and so do these, at once
            with strategy.fault.building_alone():
                strategy._dmp = strategy.model = shard_model.shard(strategy, module, initialise=False, plan=plan)
        if (new := shard_model.pooled_keys(strategy)) != order and kept is not None:  # back to the old plan
            emit("replan_refused", step=strategy.fault.committed_step, before=order, after=new,
                 message="not re-planning in process: the new plan would order the pooled embeddings anew "
                 f"(to {new}), which a model reading them by position (KeyedTensor.values()) would see as "
                 "permuted features; the tables stay where they were" if strategy.is_global_zero else None)
            strategy.constraints = kept
            shard_model.unshard(strategy, module)
            strategy._dmp = strategy.model = shard_model.shard(strategy, module, initialise=False, plan=old_plan)
        strategy.setup_optimizers(self.trainer)
        shard_model.say_if_reordered(strategy, order, strategy.fault.committed_step, "re-sharded in process")
        return describe_plan(strategy._dmp.plan)


def request_resize(strategy: DLRoverStrategy, world_size: int) -> str | None:
    """Asks the launcher to shrink or grow the job to ``world_size`` ranks in process (see
    ``DLRoverStrategy.resize_in_process``); why it cannot, or ``None``."""
    recovery = strategy.fault.in_process_recovery()
    if recovery is None:
        return "the job does not run under lightning-dlrover launch with in-process recovery"
    return recovery.ask_to_resize(world_size)


def request_replan(strategy: DLRoverStrategy, pooling_factors: Mapping[str, float], keep_feature_order: bool) -> bool:
    """Puts measured ``pooling_factors`` (ids per sample, by table) into ``strategy``'s planner constraints and asks for
    the tables to be planned and sharded anew at the next commit boundary (see ``DLRoverStrategy.replan_in_process``).
    ``False``, and nothing changes, unless the job recovers in process. Raises ``ValueError`` for an unknown table."""
    recovery = strategy.fault.in_process_recovery()
    if recovery is None or recovery.resharder is None or strategy.parity is None or strategy._dmp is None:
        return False
    tables = {table for module_plan in strategy._dmp.plan.plan.values() for table in module_plan}  # type: ignore[union-attr]
    if unknown := sorted(set(pooling_factors) - tables):
        raise ValueError(f"replan_in_process: the model has no tables {unknown}; its tables are {sorted(tables)}")
    recovery.resharder.keep_order = dict(strategy.constraints) if keep_feature_order else None  # type: ignore[attr-defined]
    for table, factor in pooling_factors.items():
        old = strategy.constraints.get(table, TableConstraint())
        strategy.constraints[table] = dataclasses.replace(old, pooling_factors=[float(factor)])
    strategy.fault.request_reshard()
    return True


def verify_digest(strategy: DLRoverStrategy) -> str | None:
    """With ``$LIGHTNING_DLROVER_VERIFY_RESIZE=1`` (drills, tests): the digest of the whole training state (a collective
    that gathers every table on rank 0), else ``None``."""
    return state_digest(strategy.training_state()) if os.environ.get(VERIFY_RESIZE_ENV) == "1" else None


def verified(strategy: DLRoverStrategy, report: RecoveryReport, before: str | None) -> None:
    """After a grow or re-shard, with ``$LIGHTNING_DLROVER_VERIFY_RESIZE=1``: the ``resize_verified`` event (rank 0
    compares the running ranks' digest of the committed state before it with the digest after it)."""
    after = verify_digest(strategy) if before is not None else None
    if before is not None and strategy.is_global_zero:
        emit("resize_verified", step=report.step, world_size=strategy.world_size, before=before, after=after,
             equal=before == after, message=f"the state at step {report.step} after the re-shard "
             f"{'equals' if before == after else 'DIFFERS FROM'} the committed state before it ({before[:12]})")


def renumber(strategy: Any, rank: int, world_size: int, local_world_size: int | None = None) -> None:
    """Makes this process rank ``rank`` of ``world_size`` for everything that reads the rank and world size: the
    launcher's environment (Lightning's cluster environment reads it), the strategy's devices and ranks, and
    Lightning's ``rank_zero_only``. One machine (``local_world_size`` ``None``): the local rank is the rank; else (a
    machine joined the job) this machine's ranks keep their local ranks."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    if local_world_size is None:
        os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    fit_devices(strategy, local_world_size or world_size)


def fit_devices(strategy: Any, local_world_size: int | None = None) -> None:
    """Gives ``strategy`` one device per rank of this machine's ``local_world_size`` (default: ``$LOCAL_WORLD_SIZE``;
    more than the trainer was built with after a grow past the launch size: CPU, or the next device indices) and sets
    its ranks anew."""
    local_world_size = local_world_size or worker_env.local_world_size()
    devices = list(strategy.parallel_devices)
    first = devices[0]
    devices += [first if first.type == "cpu" else torch.device(first.type, i)
                for i in range(len(devices), local_world_size)]
    strategy.parallel_devices = devices[:local_world_size]
    strategy.set_world_ranks()
