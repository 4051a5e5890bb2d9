"""The launcher's side of a grow in process: after a shrink, the job grows back to its launch size (``launch --regrow``),
or it grows to the size it asked for (``DLRoverStrategy.resize_in_process``, up to ``launch --max-nproc-per-node``
ranks), without a restart.

The survivors of a shrink train on at once; meanwhile the launcher starts a process of the same program as a spare
(forked from its warm zygote, or a fresh interpreter) at normal priority. Once that spare waits set up (``waiting/<i>``
in the store) and no recovery runs, the launcher publishes a grow plan (:func:`~.membership.publish_grow_plan`): the
spare takes the next rank number, and rank 0 sees the request at its next commit and says so in the commit's vote,
so every rank stops at the same step boundary. The running ranks then plan the tables for the larger world, rebuild
the world group with the new rank, shard anew and restore the committed state onto the larger world in their own
processes; the new rank receives its shards (see :meth:`~.protocol.InProcessRecovery.grow`). One rank joins per
plan, until the job is at its target size: the launch size, or the size it asked for. The world group cannot grow
beyond its capacity (its C++ size is fixed when it is built): the launch size, or ``--max-nproc-per-node`` ranks.
A shrink the job asked for sets the target to its smaller size (``--regrow`` does not undo it).

The edges: a loss while the spare waits is covered by it as by any hot spare (the job is then no longer short); a
spare that dies before it joins is started again once (then the launcher gives up, with ``grow_abandoned``); a loss
while the job grows is a loss during a recovery (every worker restarts from its spills); a job that finishes before
the grow took place ends as it is (the waiting rank is stopped, ``grow_abandoned``); a grow this machine's memory
cannot take is not published (:func:`memory_refusal`: the waiting process is stopped, ``grow_abandoned`` with ``why``
``would_not_fit``), and the job trains on at its size.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_dlrover.fault.coding import reserve
from lightning_dlrover.fault.inplace import membership
from lightning_dlrover.fault.inplace.shrink import WOULD_NOT_FIT, job_memory, memory_shortfall
from lightning_dlrover.fault.inplace.spare import SETUP_ENV
from lightning_dlrover.fault.inplace.workers import Worker
from lightning_dlrover.monitor.events import emit

if TYPE_CHECKING:
    from lightning_dlrover.fault.inplace.supervisor import Supervisor

MAX_SPARE_DEATHS = 2  # spares started for a grow that died before joining: then the launcher stops trying
GAVE_UP = "gave_up"  # ``why`` of a ``grow_abandoned`` but for memory: spares that died, or a job that finished first


@dataclass
class Regrow:
    """One machine's grow to its target size (after a shrink with ``launch --regrow``, or asked for by the job),
    advanced by :meth:`tick`."""

    spare: Worker | None = None  # started for the grow, not yet handed a rank
    joining: Worker | None = None  # handed the new rank; the job has not restored at the larger size yet
    deaths: int = 0
    abandoned: bool = False
    target: int = 0  # the world size to grow to (0: the launch size)
    asked: bool = False  # the job asked for a grow it has not reached (else only ``--regrow`` grows)

    def ask(self, sup: Supervisor, world_size: int) -> None:
        """The job asked to grow to ``world_size`` ranks (``asked: True``) or shrink to it (``False``, after its shrink
        plan): the target from now on, also for ``--regrow``; a grow given up before is tried again."""
        self.target, self.asked = world_size, world_size > sup.live_world
        if self.asked:
            self.abandoned, self.deaths = False, 0

    def tick(self, sup: Supervisor, recovering: int | None) -> int | None:
        """One look, from the supervisor's loop: starts the spare after a shrink, publishes the grow plan once it
        waits and no recovery runs; returns the grow's generation when it published one (a recovery in progress)."""
        if self.joining is not None and (recovering is None or self.joining not in sup.workers):
            self.joining = None  # the job restored at the larger size (or every worker restarted)
        if self.spare is not None and (self.spare.rank is not None or self.spare not in sup.workers):
            died = self.spare.rank is None and self.spare.process.poll() is not None
            self.spare = None  # taken by a replacement as any hot spare, died, or stopped by a restart
            self.deaths += died
            if self.deaths >= MAX_SPARE_DEATHS:
                self.abandon(f"the process started to join died {self.deaths} times before it joined")
        target = self.target or sup.world_size
        self.asked = self.asked and sup.live_world < target
        if (not (sup.args.regrow or self.asked) or self.abandoned or sup.live_world >= target or sup._finished
                or self.joining is not None):
            return None
        if self.spare is None:
            # it sets up its trainer and model before it waits: on the core the lost rank left, not in the grow's pause
            self.spare = sup.spawn(None, 0, extra_env={SETUP_ENV: "early"})
            emit("grow_started", spare=self.spare.spare, spare_pid=self.spare.process.pid, world_size=sup.live_world,
                 target_world_size=target, asked=self.asked, message=f"the job runs at {sup.live_world} of {target} "
                 f"ranks: started a process (pid {self.spare.process.pid}) to join it once it is set up")
            return None
        if recovering is not None or not membership.is_waiting(sup.store, sup.restarts, self.spare.spare):
            return None
        worker, self.spare = self.spare, None
        refused = memory_refusal(reserve.published(sup.store, sup.restarts), sup.live_world,
                                 sup.args.memory_limit_bytes, *job_memory())
        if refused is not None:
            worker.process.kill()  # (its memory back to the job; the supervisor drops a dead spare from its pool)
            worker.process.wait()
            self.abandon(refused, why=WOULD_NOT_FIT)
            return None
        rank = sup.live_world
        plan = membership.publish_grow_plan(sup.store, sup.restarts, sup.live_world, {rank: worker.spare})
        worker.rank, self.joining = rank, worker
        membership.publish_worker(sup.store, sup.restarts, rank, socket.gethostname(), worker.process.pid)
        sup.live_world = plan.world_size
        sup.publish_ranks()
        emit("grow_planned", generation=plan.generation, joined_ranks=[rank], world_size=plan.world_size,
             pids={str(rank): worker.process.pid}, message=f"generation {plan.generation}: rank {rank} joins at the "
             f"next commit (the job grows to {plan.world_size} ranks)")
        return plan.generation

    def abandon(self, message: str, why: str = GAVE_UP) -> None:
        """Gives the grow up (said once; ``why``: :data:`GAVE_UP` or ``would_not_fit``); the job trains on at its
        size."""
        if not self.abandoned:
            self.abandoned = True
            emit("grow_abandoned", why=why, reason=message, message=f"not growing the job: {message}")

    def finished_without(self, ranks: list[Worker]) -> bool:
        """Whether every one of ``ranks`` finished but the rank handed to a joining process, which the others never took
        in: the job ended before the grow took place, and that process is stopped."""
        pending = self.joining
        if pending is None or not all(w.process.poll() == 0 for w in ranks if w is not pending):
            return False
        pending.process.kill()
        pending.process.wait()
        pending.rank, self.joining = None, None  # (not a failed rank)
        self.abandon("the job finished before the new rank joined it")
        return True


def memory_refusal(state_bytes: int, world_size: int, limit_bytes: int | None, used_bytes: int,
                   available_bytes: int) -> str | None:
    """Why this machine's memory cannot take growing a ``world_size``-rank job by one rank, or ``None``.

    The running ranks and the new one build their shares of the larger world (the whole state, ``state_bytes x
    world_size``, ``state_bytes`` being the largest rank's coded state and parity share now) while each running rank
    keeps its committed state until the restore has filled the new shares. ``used_bytes`` includes the new process,
    already set up (arguments as :func:`~.shrink.memory_refusal`'s)."""
    short = memory_shortfall(state_bytes, world_size, limit_bytes, used_bytes, available_bytes)
    if short is None:
        return None
    need, limit_bytes, headroom = short
    mib = 2**20
    return (f"the {world_size + 1} ranks of the larger world would allocate {need / mib:.0f} MiB for their shares "
            f"(each running rank keeps its own state until the restore) and this machine has {max(headroom, 0) / mib:.0f}"
            f" MiB left under the job's memory limit of {limit_bytes / mib:.0f} MiB ({used_bytes / mib:.0f} MiB in use, "
            "the process set up to join included): give the job more memory (launch --memory-limit-gb)")
