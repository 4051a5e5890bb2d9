"""In-process recovery: survivors stay in ``fit`` while a replacement takes a lost rank's place.

Under ``lightning-dlrover launch`` (see :mod:`.supervisor`) a lost rank no longer stops
the job. The sequence, on every rank:

1. **Detect.** A survivor's collective fails (gloo reports a closed peer within milliseconds; a silent peer at
   the collective timeout). The launcher that saw the process die publishes a :class:`~lightning_dlrover.fault.
   membership.Plan`: the lost ranks and the spare taking each one.
2. **Wait for the replacement.** A hot spare (a process of the same program, blocked before its process group
   with everything imported) takes the rank number, builds its trainer and model while *joining* (its
   set-up collectives are answered locally, see :class:`~lightning_dlrover.fault.inplace.process_group.ReconfigurableGroup`).
3. **Rebuild the communicator.** Everyone connects generation ``g + 1`` of the world group (same ranks,
   same world size; TorchRec's modules keep their group object).
4. **Decode.** :meth:`~lightning_dlrover.fault.FaultManager.rejoin`: survivors roll back to the last committed step in memory, the
   replacement's embedding shards and optimizer state are decoded from parity, the dense and trainer state
   come from a survivor, and parity is encoded afresh.
5. **Resume.** Lightning's loops are restored to the committed step and the fit loop runs again from there.

Anything that goes wrong on the way (no plan, a loss parity cannot cover, a second failure) raises the
original error: the process leaves ``fit``, spills, and the launcher restarts every worker (today's path).

With no spare and none wanted (``launch --spares 0 --no-cold-start``) the plan is a shrink: no replacement, and the
survivors go on at the smaller world size in their own processes (:mod:`.shrink`; the strategy's ``resharder`` does it).
With ``launch --regrow`` the launcher then starts a process in the background and, once it waits ready, publishes a
*grow* plan: the ranks learn it in a commit's vote, so all of them stop at the same step boundary, and the new process
joins them at the larger world size (:meth:`InProcessRecovery.grow`). A job can ask for a shrink or a grow itself
(:meth:`InProcessRecovery.ask_to_resize`, e.g. the advisor's ranks per machine): the launcher answers with a shrink plan
the ranks learn the same way (the highest ranks retire and the others shrink as after a loss, :mod:`.shrink`), or with
grow plans, one new process at a time, up to ``launch --max-nproc-per-node`` ranks (:mod:`.grow`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from lightning_dlrover.fault.host import Host
from lightning_dlrover.fault.inplace import join, membership, retire, shrink, spare
from lightning_dlrover.fault.inplace.process_group import BACKEND, ReconfigurableGroup, register
from lightning_dlrover.fault.report import RecoveryReport, ReshardRequested, ResizeRequested
from lightning_dlrover.fault.restart.renumber import survivor_ranks
from lightning_dlrover.log import get_logger
from lightning_dlrover.monitor import emit
from lightning_dlrover.worker_env import local_world_size, restart_count

Plan = TypeVar("Plan")
log = get_logger(__name__)


class Rejoiner(Protocol):
    """What in-process recovery needs of the commit protocol (:class:`~lightning_dlrover.fault.FaultManager` is one)."""

    committed_step: int
    parity: Any  # the ParityConfig, or None
    resize_poll: Callable[[], bool] | None

    @property
    def has_committed_state(self) -> bool: ...

    def reach(self, phase: str, step: int) -> None: ...

    def leave_behind(self) -> list[Any]: ...

    def write_left_behind(self, spills: list[Any]) -> None: ...

    def restore_in_place(self, host: Host, spills: list[Any]) -> RecoveryReport: ...

    def rejoin(self, host: Host, survivor: bool, lost: list[int]) -> RecoveryReport: ...


class Resharder(Protocol):
    """What a resize in process needs of the strategy (``strategy/in_process.py`` is one)."""

    def plan(self, world_size: int) -> Any:
        """Puts the model's unsharded tables back and plans their sharding for ``world_size`` ranks (a collective over
        the current world); kept in the launcher's store for the ranks that join."""

    def reshard(self, rank: int, world_size: int, plan: Any | None = None, local_world_size: int | None = None) -> str:
        """Makes this process ``rank`` of ``world_size`` (of ``local_world_size`` ranks on its machine; ``None``: one
        machine) and shards its model anew for that world with fresh optimizers (planned with the strategy's
        constraints now, unless ``plan``); with ``plan`` (a grow), alone: the joining ranks build theirs at the same
        time, so collectives are answered locally, as a replacement's are. Returns the new plan in words."""


@dataclass
class JoinTimes:
    """Wall-clock marks of one in-process recovery on one rank (``time.time()``; ``None`` when not seen here)."""

    lost_at: float | None = None  # the launcher saw the process die
    failed_at: float | None = None  # this survivor's collective failed
    connected_at: float | None = None  # generation g + 1 of the world group is up
    restored_at: float | None = None  # decode, dense and trainer state done


def process_group_backend(requested: str | None) -> str | None:
    """The backend for ``init_process_group``: the reconfigurable one under ``lightning-dlrover launch``.

    Raises ``ValueError`` under ``launch`` for any other backend (e.g. ``"nccl"``): the reconfigurable world group
    wraps gloo, and another backend would leave the job without in-process recovery (it used to, silently)."""
    if not membership.enabled():
        return requested
    if requested not in (None, "gloo", BACKEND):
        raise ValueError(
            f"process_group_backend={requested!r} under `lightning-dlrover launch`: in-process recovery runs on gloo "
            "only (its world group is a reconfigurable gloo group; recovery under NCCL is designed, not built: see "
            "docs/gpu.md). Leave process_group_backend unset (or 'gloo') and train on CPU under `launch`, or run the "
            "job under `torchrun` (a lost rank restarts every worker)."
        )
    register()
    return BACKEND


def transport(backend: str) -> str:
    """The backend that carries ``backend``'s collectives (the reconfigurable group wraps gloo)."""
    return "gloo" if backend == BACKEND else backend


def shared_plan(compute: Callable[[], Plan], global_rank: int, before_reading: Callable[[], None]) -> Plan:
    """The sharding plan: ``compute()`` (the planner's collective) kept in the launcher's store for replacements,
    which read it instead after ``before_reading()`` (the survivors are not running the planner)."""
    if not membership.enabled():
        return compute()
    store, launch = membership.connect(), restart_count()
    if membership.is_joining():
        before_reading()
        return membership.read_sharding_plan(store, launch)  # type: ignore[return-value]
    plan = compute()
    if global_rank == 0:
        membership.publish_sharding_plan(store, launch, plan)
    return plan


def world_group() -> ReconfigurableGroup | None:
    """The job's world group when it is reconfigurable (in-process recovery on), else ``None``."""
    group = dist.group.WORLD if dist.is_initialized() else None
    return group if isinstance(group, ReconfigurableGroup) else None


def joining() -> bool:
    """Whether this process is a replacement whose set-up runs before it joins the survivors."""
    group = world_group()
    return group is not None and group.joining


def announce_device(device_type: str) -> None:
    """Under ``lightning-dlrover launch``, on a worker whose ranks run on ``device_type`` other than ``"cpu"``: tells the
    launcher, which then gives a replacement only a free device slot (see :mod:`.supervisor`). Nothing on CPU."""
    if membership.enabled() and device_type != "cpu" and not os.environ.get(membership.SPARE_ENV):
        membership.publish_device(membership.connect(), restart_count(), device_type)


def take_rank_if_spare() -> membership.Assignment | None:
    """On a hot spare: blocks until the launcher hands it a lost rank and makes this process that rank's worker
    (before its process group starts). ``None`` on an ordinary worker."""
    index = os.environ.get(membership.SPARE_ENV)
    if not index:
        return None
    store = membership.connect()
    assignment = spare.take_rank(store, int(index))  # (a spare forked from the zygote took it before its program ran)
    membership.become(assignment)
    membership.announce_ready(store, restart_count(), assignment)
    return assignment


class InProcessRecovery:
    """The survivor and replacement sides of in-process recovery for one commit protocol (a :class:`Rejoiner`)."""

    def __init__(self, manager: Rejoiner, assignment: membership.Assignment | None = None) -> None:
        self.manager = manager
        # The launcher assigns a spare when it publishes the plan: the loss time of this rank's recovery.
        self.times = JoinTimes(lost_at=assignment.assigned_at if assignment is not None else None)
        self._store = membership.connect() if membership.enabled() else None
        self._group = world_group()
        self._told = -1  # the last generation whose first commit this rank told the launcher
        #: Set by the strategy: re-shards the model for a shrink or grow; the committed state is restored into it
        #: afterwards. ``None``: shrink plans are refused.
        self.resharder: Resharder | None = None
        self.resized = False  # this process took part in a grow or re-shard (running or joining) in its last recovery
        self.resize_asked: int | None = None  # the world size this job asked the launcher for and has not reached
        #: Set by the strategy: ends this process at once, a rank retired by a shrink the job asked for.
        self.leave: Callable[[], None] | None = None
        if self._store is not None and self._group is not None:
            manager.resize_poll = self._resize_requested

    def _resize_requested(self) -> bool:
        """On rank 0 at each commit, of a job with room to grow (short of its launch size after a shrink, launched
        with ``--max-nproc-per-node`` or ``--max-nnodes``) or that asked for a shrink: whether the launcher published
        the plan that resizes it (one store look-up)."""
        group = self._group
        if group is None or self._store is None or group.rank() != 0 or group.joining:
            return False
        if not (self.resize_asked is not None or group.size() < group.capacity):
            return False
        try:
            return membership.resize_requested(self._store, restart_count(), group.generation)
        except RuntimeError:  # the launcher's store is gone: nobody can join any more
            return False

    def ask_to_resize(self, world_size: int) -> str | None:
        """Asks the launcher to shrink or grow the job to ``world_size`` ranks in process (every rank, at the same
        step): the highest ranks retire, or new processes join, at a commit boundary once it publishes the plan. Why it
        cannot, or ``None``."""
        parity = self.manager.parity
        why = retire.ask(self._store, self._group, world_size, (parity.k, parity.r) if parity else None,
                         self.resharder is not None and self.leave is not None)
        if why is None:
            self.resize_asked = world_size
        return why

    def committed(self, step: int) -> None:
        """After each commit: tells the launcher the first step committed in each generation of the world group
        (its hot spares start only then, see :mod:`.supervisor`); nothing on later steps."""
        group = self._group
        if group is None or self._store is None or group.generation == self._told or group.joining:
            return
        self._told = group.generation
        try:
            membership.publish_committed(self._store, restart_count(), group.generation, step)
        except RuntimeError as err:  # the launcher's store is gone: it cannot start spares any more anyway
            log.warning(f"could not tell the launcher that step {step} committed ({err}); its hot spares stay unstarted")

    def recover(self, host: Host, error: BaseException) -> RecoveryReport | None:
        """On a survivor whose step failed with ``error``: waits for the launcher's plan, rebuilds the world group
        with the replacements and restores the committed step. ``None`` (the caller re-raises ``error``) when this
        is not a peer loss the job can recover in process."""
        group = world_group()
        if group is None or self._store is None or not isinstance(error, RuntimeError):
            return None
        if not self.manager.has_committed_state:  # lost in the first step: the job starts again from the beginning
            emit("in_process_refused", why="nothing committed yet", error=str(error)[:200],
                 message=f"rank {host.global_rank}: a rank was lost before the first commit: restarting the job")
            return None
        self.times = JoinTimes(failed_at=time.time())
        self.resized = isinstance(error, ReshardRequested)
        if self.resized:
            return self.reshard(host)
        plan = membership.wait_for_plan(self._store, restart_count(), group.generation + 1)
        if plan is None:
            emit("in_process_refused", why="no recovery plan from the launcher", error=str(error)[:200],
                 message=f"rank {host.global_rank}: {type(error).__name__} and no rank reported lost: not recovering in process")
            return None
        if plan.refused or plan.world_size == self.resize_asked:  # (a grow by several ranks: one plan per rank)
            self.resize_asked = None
        if plan.asked and host.global_rank in plan.lost and isinstance(error, ResizeRequested):
            retire.retire(host, plan, self.manager.committed_step, self.leave)  # (does not return)
        if host.global_rank in plan.lost or plan.refused:
            return None  # a rank the launcher believes dead must not come back; a shrink it refused (it said why)
        if (plan.grow or plan.asked) != isinstance(error, ResizeRequested):  # a loss while the job resizes: restart
            emit("in_process_refused", why="a rank was lost while the job resized", error=str(error)[:200],
                 message=f"rank {host.global_rank}: {type(error).__name__} while generation {plan.generation} "
                 "resizes the job: not recovering in process")
            return None
        self.times.lost_at = plan.reported_at
        self.resized = plan.grow or plan.asked
        if plan.grow:
            return self.grow(host, plan)
        if plan.shrinks:
            return self._shrink(host, plan, group.size())
        if not membership.wait_for_replacements(self._store, restart_count(), plan):
            emit("in_process_refused", why="the replacement did not start in time", error=str(error)[:200],
                 message=f"rank {host.global_rank}: no replacement for ranks {plan.lost}: not recovering in process")
            return None
        group.reconfigure(plan.generation)
        self.times.connected_at = time.time()
        self.manager.reach("during_recovery", self.manager.committed_step)
        return self._restore(host, survivor=True, lost=plan.lost)

    def _shrink(self, host: Host, plan: membership.Plan, world_size: int) -> RecoveryReport | None:
        """The survivors go on without ``plan.lost`` at ``plan.world_size`` ranks; ``None`` when refused (the caller
        re-raises the original error; the launcher's restart path takes over)."""
        parity = self.manager.parity
        refused = shrink.refusal(world_size, plan.lost, (parity.k, parity.r) if parity is not None else None)
        if refused is None and self.resharder is None:
            refused = shrink.NO_SHRINKER, "this strategy cannot re-shard its model in process"
        if refused is not None:
            if host.is_global_zero or host.global_rank == min(set(range(world_size)) - set(plan.lost)):
                shrink.refuse(world_size, plan.lost, *refused, step=self.manager.committed_step)
            return None
        old_rank, group = host.global_rank, world_group()
        assert group is not None and plan.world_size is not None
        spills = self.manager.leave_behind()  # the restart path's spills, kept in memory
        try:
            rank = survivor_ranks(world_size, plan.lost)[old_rank]
            group.reconfigure(plan.generation, rank=rank, world_size=plan.world_size)
            self.times.connected_at = time.time()
            self.manager.reach("during_recovery", self.manager.committed_step)
            self.resharder.reshard(rank, plan.world_size)
            report = self.manager.restore_in_place(host, spills)
        except Exception as err:  # noqa: BLE001 - half-way: the restart path takes over from the state before it
            self.manager.write_left_behind(spills)
            shrink.refuse(world_size, plan.lost, shrink.FAILED, f"it failed half-way on rank {old_rank} "
                          f"({type(err).__name__}: {str(err)[:200]})", step=self.manager.committed_step)
            return None
        self.times.restored_at = time.time()
        if self._store is not None:
            membership.report_restored(self._store, restart_count(), plan.generation)
        t = self.times
        emit("shrunk_in_process", step=report.step, old_rank=old_rank, old_world_size=world_size,
             world_size=plan.world_size, lost_ranks=plan.lost, decode_s=report.decode_s, reshard_s=report.reshard_s,
             lost_at=t.lost_at, failed_at=t.failed_at, connected_at=t.connected_at, restored_at=t.restored_at,
             message=f"shrunk in process from {world_size} to {plan.world_size} ranks without ranks {plan.lost} at step "
             f"{report.step}; {report}" if host.is_global_zero else None)
        return report

    def grow(self, host: Host, plan: membership.Plan) -> RecoveryReport | None:
        """On a rank of the running job, at the step boundary of a grow request: the committed state is kept as
        spills in memory, the tables are planned for ``plan.world_size`` ranks (published for the joining ranks),
        the world group takes the joining ranks in, every rank shards anew and the state is re-sharded onto the
        larger world (the joining ranks hold nothing). ``None`` when it fails half-way: the spills are written and
        the launcher's restart path takes over from them."""
        group, old_world = world_group(), host.world_size
        assert group is not None and plan.world_size is not None and self.resharder is not None
        assert self._store is not None
        spills = self.manager.leave_behind()
        try:
            sharding = self.resharder.plan(plan.world_size)
            if not membership.wait_for_replacements(self._store, restart_count(), plan):
                raise RuntimeError(f"the ranks joining generation {plan.generation} did not start in time")
            group.reconfigure(plan.generation, rank=host.global_rank, world_size=plan.world_size)
            self.times.connected_at = time.time()
            self.manager.reach("during_recovery", self.manager.committed_step)
            local = local_world_size() if join.from_another_machine(self._store, restart_count(), plan) else None
            self.resharder.reshard(host.global_rank, plan.world_size, sharding, local)
            report = self.manager.restore_in_place(host, spills)
        except Exception as err:  # noqa: BLE001 - half-way: the restart path takes over from the state before it
            self.manager.write_left_behind(spills)
            emit("grow_failed", step=self.manager.committed_step, generation=plan.generation,
                 error=f"{type(err).__name__}: {str(err)[:200]}",
                 message=f"rank {host.global_rank}: growing to {plan.world_size} ranks failed half-way ({err}); the "
                 "committed state is spilled and every worker restarts from it")
            return None
        return self._grown(host, plan, old_world, report, survivor=True)

    def reshard(self, host: Host) -> RecoveryReport | None:
        """On every rank, at the commit boundary they agreed on: plans the tables anew at the same world size (the
        strategy's constraints changed: the advisor's re-plan) and restores the committed state into the new layout.
        ``None`` when it fails half-way: the spills are written and the launcher's restart path takes over."""
        group = world_group()
        assert group is not None and self.resharder is not None
        spills = self.manager.leave_behind()
        try:
            placement = self.resharder.reshard(host.global_rank, host.world_size)
            report = self.manager.restore_in_place(host, spills)
        except Exception as err:  # noqa: BLE001 - half-way: the restart path takes over from the state before it
            self.manager.write_left_behind(spills)
            emit("reshard_failed", step=self.manager.committed_step, error=f"{type(err).__name__}: {str(err)[:200]}",
                 message=f"rank {host.global_rank}: re-sharding in process failed half-way ({err}); the committed "
                 "state is spilled and every worker restarts from it")
            return None
        self.times.restored_at = time.time()
        emit("resharded_in_process", step=report.step, world_size=host.world_size, sharding=placement,
             decode_s=report.decode_s, reshard_s=report.reshard_s, failed_at=self.times.failed_at,
             restored_at=self.times.restored_at, message=f"re-sharded in process at step {report.step} in "
             f"{self.times.restored_at - self.times.failed_at:.2f} s: {placement}" if host.is_global_zero else None)
        return report

    def _grown(self, host: Host, plan: membership.Plan, old_world: int, report: RecoveryReport,
               survivor: bool) -> RecoveryReport:
        self.times.restored_at = time.time()
        if self._store is not None:
            membership.report_restored(self._store, restart_count(), plan.generation)
        t = self.times
        emit("grown_in_process", step=report.step, survivor=survivor, old_world_size=old_world,
             world_size=plan.world_size, joined_ranks=sorted(plan.replacements), decode_s=report.decode_s,
             reshard_s=report.reshard_s, lost_at=t.lost_at, failed_at=t.failed_at, connected_at=t.connected_at,
             restored_at=t.restored_at,
             message=f"grown in process from {old_world} to {plan.world_size} ranks at step {report.step} (ranks "
             f"{sorted(plan.replacements)} joined); {report}" if host.is_global_zero else None)
        return report

    def join(self, host: Host) -> RecoveryReport:
        """On a replacement, at the start of its fit loop: joins the survivors' generation of the world group
        and receives the committed state."""
        group = world_group()
        assert group is not None and group.joining
        group.joining = False
        membership.joined()
        self.times.connected_at = time.time()
        plan = membership.wait_for_plan(self._store, restart_count(), group.generation) if self._store else None
        if plan is not None and plan.grow:  # the running ranks re-shard their committed state onto this one too
            self.resized = True
            report = self.manager.restore_in_place(host, [])
            return self._grown(host, plan, report.world_size, report, survivor=False)
        return self._restore(host, survivor=False, lost=plan.lost if plan is not None else [host.global_rank])

    def _restore(self, host: Host, survivor: bool, lost: list[int]) -> RecoveryReport:
        report = self.manager.rejoin(host, survivor=survivor, lost=lost)
        self.times.restored_at = time.time()
        group = world_group()
        if self._store is not None and group is not None:
            membership.report_restored(self._store, restart_count(), group.generation)
        t = self.times
        emit("recovered_in_process", step=report.step, survivor=survivor, lost_ranks=lost, decode_s=report.decode_s,
             reshard_s=report.reshard_s, lost_at=t.lost_at, failed_at=t.failed_at, connected_at=t.connected_at,
             restored_at=t.restored_at,
             message=f"rank {host.global_rank} ({'survivor' if survivor else 'replacement'}) recovered in process at "
             f"step {report.step}: ranks {lost} replaced; {report}" if host.is_global_zero else None)
        return report
