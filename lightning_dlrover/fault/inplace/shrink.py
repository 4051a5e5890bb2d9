"""Shrink in process: a rank lost with no spare (and none wanted) leaves the survivors training at ``N - 1``.

The restart path already shrinks (``torchrun --nnodes MIN:MAX``: survivors spill, every worker restarts at the
smaller size and decodes and re-shards from the spills, :mod:`lightning_dlrover.fault.restart`). In process, the
survivors do the same work without leaving their processes:

1. the launcher (``launch --spares 0 --no-cold-start``, one machine) publishes a
   :class:`~lightning_dlrover.fault.inplace.membership.Plan` with no replacement and a smaller ``world_size``
   (``shrink_planned``); the survivors take the ranks :func:`~lightning_dlrover.fault.restart.renumber.survivor_ranks`
   gives them (in order, gaps closed: what the restarted job numbers them);
2. each survivor checks that the shrink can run (:func:`refusal`): below ``k + r`` ranks the parity of the smaller
   world cannot be placed (the launcher has checked the memory: see below); a refused shrink emits
   ``shrink_refused`` and raises the original error, and the launcher's restart path takes over;
3. each survivor keeps its committed state as the restart path's spills, in memory (``FaultManager.leave_behind``),
   and the world group is reconfigured to the new generation with the new rank and world size
   (:meth:`~lightning_dlrover.fault.inplace.process_group.ReconfigurableGroup.reconfigure`);
4. the strategy's ``resharder`` renumbers the process (environment, Lightning's ranks, the data loader) and shards the
   model anew for the smaller world, with fresh optimizers (``strategy/in_process.py``, ``strategy/shard_model.py``);
   DDP's average is set to the live world size;
5. ``FaultManager.restore_in_place`` decodes the lost ranks and re-shards every rank's committed state from the
   spills (the restart path's :func:`~lightning_dlrover.fault.restart.reshard.restore`), encodes parity for the new
   group, and the fit loop resumes at the committed step (``shrunk_in_process``) with the same global batch, or the
   one ``ElasticBatchScaler``'s rule gives (its ``on_train_start`` sees the committed world size in its state).

A shrink that fails half-way writes the spills it kept (the state before it) and raises the original error
(``shrink_refused`` with ``why`` ``failed``): the launcher restarts every worker and they restore from the spills.

Before publishing a shrink plan the launcher checks that this machine's memory can take it
(:func:`memory_refusal`); when it cannot, the plan it publishes says so (``refused``), it emits ``shrink_refused``
(``why`` ``would_not_fit``) and the survivors leave at once, so the restart path takes over without waiting.

Not built: a shrink across several machines (the launcher shrinks only a one-machine job).

Why not TorchRec's ``DistributedModelParallel.reshard`` (``torchrec/distributed/sharding/dynamic_sharding.py``, 1.8):
it moves shards between the ranks of a fixed world. Its communication (``prepare_comm_ops``) is sized by the
sharded module's ``env.world_size`` and sends each moved shard from the rank that holds it; a lost rank holds
nothing (its shards come from the parity decode), and the sharded modules' input and output all-to-alls keep the
old world size. The shrink therefore rebuilds the sharded modules for the new plan and fills them from the decoded
state (the restart path's :func:`~lightning_dlrover.fault.restart.reshard.restore`, fed by the survivors' spills
kept in memory: its tested code, without writing the files).
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import TYPE_CHECKING

import psutil

from lightning_dlrover.fault.coding import reserve
from lightning_dlrover.fault.inplace import membership
from lightning_dlrover.fault.restart.renumber import survivor_ranks
from lightning_dlrover.monitor import emit

if TYPE_CHECKING:
    from lightning_dlrover.fault.inplace.supervisor import Supervisor

#: ``why`` values of the ``shrink_refused`` event.
BELOW_PARITY = "below_parity"
WOULD_NOT_FIT = "would_not_fit"
NO_PARITY = "no_parity"
NO_SHRINKER = "no_shrinker"  # the strategy cannot re-shard its model in process
FAILED = "failed"  # the shrink failed half-way: the survivors wrote the spills of the committed state and stop


def refusal(world_size: int, lost: list[int], parity: tuple[int, int] | None,
            asked: bool = False) -> tuple[str, str] | None:
    """Why the ``world_size - len(lost)`` survivors cannot go on in process without ``lost``: ``(why, message)``, or
    ``None`` when they can (each survivor checks; whether they fit in memory the launcher checks, see
    :func:`memory_refusal`).

    Args:
        world_size: ranks before the loss.
        lost: the lost ranks.
        parity: the job's ``(k, r)``; ``None`` without parity (nothing to decode the lost shards from).
        asked: a shrink the job asked for (:mod:`.retire`: ``lost`` retire; no spare to suggest).
    """
    survivors = len(survivor_ranks(world_size, lost))
    if parity is None:
        return NO_PARITY, (f"the job has no parity, so the {'retiring' if asked else 'lost'} ranks' shards cannot be "
                           "decoded: pass DLRoverStrategy(parity=ParityConfig(...)) to shrink in process")
    k, r = parity
    if survivors < k + r:
        remedy = f"ask for {k + r} ranks or more" if asked else "lower k, or keep a spare (launch --spares 1)"
        return BELOW_PARITY, (f"{survivors} {'ranks' if asked else 'survivors'} are fewer than k + r = {k + r}, which "
                              f"the parity of the smaller world needs (k={k}, r={r}): {remedy}")
    return None


def job_memory() -> tuple[int, int]:
    """``(used, available)``: the bytes the calling launcher and every process below it hold (their proportional set
    sizes: pages the ranks share with the zygote they were forked from count once), and the bytes the machine can
    still hand out. Reading a process's PSS walks its page tables (~10 ms for a 500 MB rank): once per shrink."""
    used = 0
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # (gone meanwhile)
            info = process.memory_full_info()
            used += getattr(info, "pss", info.rss)
    return used, psutil.virtual_memory().available


def memory_shortfall(state_bytes: int, world_size: int, limit_bytes: int | None, used_bytes: int,
                     available_bytes: int) -> tuple[int, int, int] | None:
    """``(need, limit, headroom)`` when this machine cannot take a resize of a ``world_size``-rank job whose ranks build
    their new shares (the whole state, ``state_bytes x world_size``) beside their committed state, else ``None``
    (``None`` too when no state size was published: nothing is known). ``limit``: the job's memory limit here
    (``None``: the machine's memory); ``headroom``: what it may still allocate under it and under what the machine
    can hand out."""
    limit_bytes = limit_bytes or psutil.virtual_memory().total
    headroom = min(limit_bytes - used_bytes, available_bytes)
    need = state_bytes * world_size
    return None if not state_bytes or need <= headroom else (need, limit_bytes, headroom)


def memory_refusal(state_bytes: int, world_size: int, lost: list[int], limit_bytes: int | None, used_bytes: int,
                   available_bytes: int, asked: bool = False) -> tuple[str, str] | None:
    """Why this machine's memory cannot take the shrink (the launcher's check, so that every survivor gets the same
    answer in the plan): ``(WOULD_NOT_FIT, message)``, or ``None``.

    Each survivor builds its share of the smaller world's state (``state_bytes x world_size / survivors``: tables,
    optimizer state and parity share, ``state_bytes`` being a rank's now) while it keeps its own committed state
    until the restore has filled the new one: the survivors together need ``state_bytes x world_size`` more.

    Args:
        state_bytes: the largest rank's coded state and parity share (what the ranks publish for hot spares).
        world_size: ranks before the loss; lost: the lost ranks.
        limit_bytes: the memory the job may use on this machine (``launch --memory-limit-gb``; default its cgroup
            limit, else the machine's memory; ``None``: the machine's).
        used_bytes: what the job's processes on this machine hold now (resident); available_bytes: what the machine
            can still hand out.
        asked: a shrink the job asked for (:mod:`.retire`; no spare to suggest).
    """
    survivors = len(survivor_ranks(world_size, lost))
    short = memory_shortfall(state_bytes, world_size, limit_bytes, used_bytes, available_bytes)
    if short is None:
        return None
    need, limit_bytes, headroom = short
    mib = 2**20
    return WOULD_NOT_FIT, (f"the {survivors} survivors would allocate {need / mib:.0f} MiB for the smaller world's "
                           f"shares (each keeps its own state until the restore) and this machine has "
                           f"{max(headroom, 0) / mib:.0f} MiB left under the job's memory limit of "
                           f"{limit_bytes / mib:.0f} MiB ({used_bytes / mib:.0f} MiB in use): "
                           + ("" if asked else "keep a spare (launch --spares 1) or ")
                           + "give the job more memory (launch --memory-limit-gb)")


def refuse(world_size: int, lost: list[int], why: str, message: str, step: int | None = None,
           asked: bool = False) -> None:
    """Says (``shrink_refused``) that the survivors of ``lost`` do not shrink in process, and why: the launcher's
    restart path takes over (``asked``: a shrink the job asked for, which trains on as it is)."""
    emit("shrink_refused", step=step, why=why, world_size=world_size, lost_ranks=sorted(lost),
         message=f"not shrinking in process to {world_size - len(lost)} ranks without ranks {sorted(lost)}: {message}; "
         + (f"the job trains on at {world_size} ranks" if asked else "restarting every worker instead"))


def shrink_in_process(sup: Supervisor, lost: list[int], asked: bool = False) -> int | None:
    """The launcher's side: no spare for ``lost``, none to start: the survivors go on without them, unless this
    machine's memory cannot take it (the plan then says so and the survivors leave); the plan's generation.
    ``asked``: the job asked for it (:mod:`.retire`): ``lost`` are alive and retire; a refusal publishes no plan
    (``None``: the job trains on as it is)."""
    refused = memory_refusal(reserve.published(sup.store, sup.restarts), sup.live_world, lost,
                             sup.args.memory_limit_bytes, *job_memory(), asked=asked)
    if refused is not None:
        refuse(sup.live_world, lost, *refused, asked=asked)
        if asked:
            return None
        return membership.publish_shrink_plan(sup.store, sup.restarts, lost, sup.live_world, refused[0]).generation
    numbers = survivor_ranks(sup.live_world, lost)
    now = time.monotonic()
    sup.retiring += [(w, now) for w in sup.workers if w.rank in lost]  # (asked: alive, they end on their own)
    sup.workers = [w for w in sup.workers if w.rank not in lost]
    plan = membership.publish_shrink_plan(sup.store, sup.restarts, lost, sup.live_world, asked=asked)
    for w in [w for w in sup.workers if w.rank is not None]:
        w.rank = numbers[w.rank]
        membership.publish_worker(sup.store, sup.restarts, w.rank, socket.gethostname(), w.process.pid)
    sup.live_world = len(numbers)
    sup.publish_ranks()
    how = "retire as the job asked" if asked else "lost, no spare"
    emit("shrink_planned", generation=plan.generation, lost_ranks=plan.lost, world_size=sup.live_world, asked=asked,
         pids={str(w.rank): w.process.pid for w in sup.workers if w.rank is not None},
         message=f"generation {plan.generation}: ranks {plan.lost} {how}: shrinking to {len(numbers)} ranks")
    return plan.generation
