"""The supervisor of one machine's workers under ``lightning-dlrover launch``: keeps survivors running when a rank is lost.

``torchrun`` stops every worker of the job when one fails. This launcher does not: when one of its
workers dies it hands the lost rank to a hot spare (a process of the same program waiting with everything
imported) or to a freshly started process, and publishes a recovery plan in its store; the survivors, who
saw their collective fail, roll back to the last committed step in memory, rebuild their communicator
with the replacement and go on inside ``fit`` (see :mod:`.protocol`). If the
in-process path fails (a loss parity cannot cover, a second loss during recovery, no replacement) the
launcher falls back to what ``torchrun`` does: it restarts every worker, which restore from their spills
or the newest checkpoint. Workers see the same environment ``torchrun`` gives them and, as ``torchrun``'s, each runs
in a session of its own: Linux's autogroup scheduler shares the CPU equally among sessions, so on a machine that runs
anything else, ranks left in the launcher's session would train on one session's share between them all. A worker is
SIGKILLed when its launcher dies (``PR_SET_PDEATHSIG``); a launcher stopped by SIGTERM or SIGHUP stops its workers.

A machine lost with its launcher is noticed by the launcher on machine 0 (the store's host): every launcher
beats a counter in the store, and when one stops for ``--node-timeout`` seconds machine 0 hands that
machine's ranks to its own spares, as for a lost process. Losing machine 0 loses the store: the job fails. A machine
may also join the running job, up to ``--max-nnodes`` (:mod:`.join`).

A replacement takes the lost rank's device slot (``LOCAL_RANK``: with GPUs, the device) when no live rank on this
machine holds it. On CPU a slot can be shared (a lost machine's ranks run beside machine 0's); when the job's ranks
said they run on GPUs (:func:`.membership.publish_device`) a replacement that would share a GPU is refused
(``in_process_refused`` with ``why`` ``device_taken``) and every worker restarts instead (:meth:`Supervisor.shared_devices`).

Being ready costs the job nothing measurable: the ranks start alone, and a launcher starts its hot spares only once the
job has committed its first step (the ranks say so in the store, :func:`.membership.publish_committed`), at the lowest
CPU priority (:mod:`.priority`); a waiting spare blocks in the store and uses no CPU. The spares that replace the ones
a recovery used start the same way, after the first step committed by the recovered job. A rank lost before then is
taken by a process started at the loss (what ``--spares 0`` does). Workers are forked from a warm process that
imported torch, TorchRec and Lightning once (:mod:`.zygote`: why that is safe), so none of them imports those itself.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from torch.distributed import TCPStore

from lightning_dlrover import worker_env
from lightning_dlrover.fault.inplace import join, membership, priority, process_group, retire, zygote
from lightning_dlrover.fault.inplace.grow import Regrow
from lightning_dlrover.fault.inplace.shrink import shrink_in_process
from lightning_dlrover.fault.inplace.store import serve_store  # noqa: F401  (imported from here by cli/ and tests)
from lightning_dlrover.fault.inplace.workers import SupervisorConfig, Worker
from lightning_dlrover.log import get_logger
from lightning_dlrover.monitor.events import emit

log = get_logger(__name__)


@dataclass
class Supervisor:
    """Starts, watches and replaces this machine's workers."""

    args: SupervisorConfig
    store: TCPStore
    run_id: str
    restarts: int = 0
    workers: list[Worker] = field(default_factory=list)
    lost_nodes: set[int] = field(default_factory=set)
    _seen: dict[int, tuple[int, float]] = field(default_factory=dict)  # node -> (beats, when they last changed)
    _last_beat: float = 0.0
    _store_lost: bool = False
    _finished: bool = False  # this machine's ranks all finished
    _owed: int = 0  # hot spares to start once generation ``_gate`` of the world group has committed a step
    _gate: int = 0
    _priority_refused: str | None = None  # why spares run at normal priority (said once)
    _priority_said: bool = False
    _zygote: zygote.Zygote | None = None
    _zygote_state: str = "unstarted"  # unstarted | up | lost | off
    _reaped_at: float = 0.0
    live_world: int = 0  # the world size now (smaller than ``world_size`` after a shrink in process)
    regrow: Regrow = field(default_factory=Regrow)  # back to ``world_size`` after a shrink (``--regrow``)
    retiring: list[tuple[Worker, float]] = field(default_factory=list)  # ranks a shrink retires; since (monotonic)
    asked_answered: tuple[int, int] = (-1, 0)  # (generation, world size) of the last resize request answered
    joined: set[int] = field(default_factory=set)  # on machine 0: machines that joined the running job (:mod:`.join`)
    offered: list[int] = field(default_factory=list)  # on a joining machine: its spares offered, not yet ranks
    capacity: int = 0  # the job's world group's C++ size, when a joining machine read it (0: from the options)

    @property
    def world_size(self) -> int:
        """The launch's world size; on a machine that joined the job, the job's size when it joined."""
        return self.live_world if join.joining_machine(self) else self.args.nnodes * self.args.nproc_per_node

    def job_env(self) -> dict[str, str]:
        """What every worker of this machine is told alike (the zygote imports with it)."""
        a = self.args
        host, _, port = a.master.rpartition(":")
        env = dict(os.environ)
        env.update(
            WORLD_SIZE=str(self.world_size), LOCAL_WORLD_SIZE=str(a.nproc_per_node), GROUP_RANK=str(a.node_rank),
            MASTER_ADDR=host, MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True",
            **{worker_env.RUN_ID: self.run_id, membership.STORE_ENV: a.master,
               process_group.MAX_WORLD_ENV: str(self.capacity or join.capacity(self))},
        )  # fmt: skip
        env.update(join.room_env(self))
        if "OMP_NUM_THREADS" not in os.environ and a.nproc_per_node > 1:  # as torchrun does: no oversubscribed cores
            env["OMP_NUM_THREADS"] = "1"  # (read when OpenMP and OpenBLAS load: the zygote must import with it)
        return env

    def env(self, rank: int | None, local_rank: int, spare: int | None) -> dict[str, str]:
        env = self.job_env()
        env.update(RANK=str(rank if rank is not None else self.world_size - 1),
                   LOCAL_RANK=str(local_rank if rank is not None else 0),
                   **{worker_env.RESTART_COUNT: str(self.restarts)})
        if spare is not None:
            env[membership.SPARE_ENV] = str(spare)
        return env

    def fork(self, env: dict[str, str], idle: bool) -> zygote.ForkedProcess | None:
        """A worker forked from the zygote (started at the first call); ``None`` where the zygote is off, lost, or
        cannot run the program: the caller then starts a fresh interpreter."""
        if not self.args.zygote or self._zygote_state in ("lost", "off") or not zygote.forkable(self.args.program):
            return None
        try:
            if self._zygote is None:
                self._zygote = zygote.Zygote.start(self.job_env())
                self._zygote_state = "up"
            timeout = float(os.environ.get(membership.START_TIMEOUT_ENV, "600"))
            forked = self._zygote.fork(self.args.program, env, idle, ready_timeout=timeout)
        except zygote.ZygoteError as err:
            self.lose_zygote(str(err))
            return None
        if (ready := self._zygote.ready) is not None and not ready.get("said"):
            ready["said"] = True
            emit("zygote_ready", zygote_pid=ready["pid"], import_s=ready["import_s"], preloaded=ready["preloaded"],
                 failed=ready["failed"], message=f"workers are forked from a warm process (pid {ready['pid']}) that "
                 f"imported {', '.join(ready['preloaded'])} in {ready['import_s']:.1f} s"
                 + (f" (not imported: {ready['failed']})" if ready["failed"] else ""))
        return forked

    def lose_zygote(self, why: str) -> None:
        """The zygote cannot fork any more: every later worker is started as a fresh interpreter (said once)."""
        if self._zygote_state == "lost":
            return
        self._zygote_state = "lost"
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        emit("zygote_lost", why=why, message=f"the warm process workers are forked from failed: {why}; starting each "
             "later worker as a fresh interpreter (it imports torch, TorchRec and Lightning itself: slower to be ready)")

    def spawn(self, rank: int | None, local_rank: int, idle: bool = False, extra_env: dict[str, str] | None = None) -> Worker:
        """Starts the rank ``rank``, or a spare when ``rank`` is ``None`` (``idle``: at the lowest CPU priority)."""
        spare = membership.register_spare(self.store, self.restarts) if rank is None else None
        env = {**self.env(rank, local_rank, spare), **(extra_env or {})}
        # each worker in a session of its own, as torchrun starts them: the kernel's autogroup scheduler gives every
        # session an equal CPU share, so workers left in the launcher's session would share one share among them all
        process = self.fork(env, idle)
        if process is None:
            process = subprocess.Popen([sys.executable, *self.args.program], env=env, start_new_session=True,
                                       preexec_fn=zygote.die_with_launcher(os.getpid()))
        worker = Worker(process, rank, spare, forked=isinstance(process, zygote.ForkedProcess))
        if idle and self._priority_refused is None and not worker.forked:  # (a forked one lowered itself)
            self._priority_refused = priority.lower(worker.process.pid)
        self.workers.append(worker)
        if rank is not None:
            membership.publish_worker(self.store, self.restarts, rank, socket.gethostname(), worker.process.pid)
        return worker

    def start(self) -> None:
        a = self.args
        if join.joining_machine(self):  # its processes join the running job (join.offer), no rank of its own yet
            return
        join.publish_capacity(self.store, self.restarts, join.capacity(self))
        first = a.node_rank * a.nproc_per_node
        for local in range(a.nproc_per_node):
            self.spawn(first + local, local)
        self._owed, self._gate, self.live_world = a.spares, 0, self.world_size  # spares: after the first commit
        self.asked_answered, self.regrow, self.joined = (-1, 0), Regrow(), set()  # (a full restart: the launch's size)
        self.publish_ranks()

    def start_spares(self) -> None:
        """Starts the hot spares owed to the pool once the ranks committed a step in generation ``_gate``."""
        if not self._owed or self._store_lost or self._finished:
            return
        step = membership.committed(self.store, self.restarts, self._gate)
        if step is None:
            return
        if self._priority_refused is None and not self._priority_said:
            self._priority_refused = priority.can_restore()
        spares = [self.spawn(None, 0, idle=True) for _ in range(self._owed)]
        self._owed = 0
        how = "normal" if self._priority_refused else "idle"
        emit("spares_started", step=step, spares=[w.spare for w in spares], pids=[w.process.pid for w in spares],
             generation=self._gate, priority=how, forked=all(w.forked for w in spares),
             message=f"{len(spares)} hot spare(s) started after step {step} committed, at {how} CPU priority"
             + (f" ({self._priority_refused})" if self._priority_refused and not self._priority_said else ""))
        self._priority_said = self._priority_said or bool(self._priority_refused)

    def publish_ranks(self) -> None:
        ranks = [w.rank for w in self.workers if w.rank is not None]
        membership.publish_node_ranks(self.store, self.restarts, self.args.node_rank, ranks)

    def stop(self, grace: float = 0.0, keep_zygote: bool = False) -> None:
        """Stops every worker: SIGTERM first when ``grace`` > 0 (as ``torchrun`` does: a survivor spills its committed
        state for the restart), SIGKILL for whatever is left after ``grace`` seconds; and the zygote, unless
        ``keep_zygote`` (a full restart forks the new workers from it)."""
        if grace > 0:
            for worker in self.workers:
                if worker.process.poll() is not None:
                    continue
                if worker.rank is None:  # an idle spare holds no state: it goes at once
                    worker.process.kill()
                else:
                    worker.process.terminate()
            deadline = time.time() + grace
            for worker in self.workers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.process.wait(timeout=max(deadline - time.time(), 0.01))
        self.workers += [w for w, _ in self.retiring]
        self.retiring = []
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.kill()
        for worker in self.workers:
            worker.process.wait()
        self.workers = []
        if not keep_zygote and self._zygote is not None:
            self._zygote.close()
            self._zygote, self._zygote_state = None, "off"

    def device_slots(self, lost: list[int]) -> dict[int, int | None]:
        """The device slot (``LOCAL_RANK``) each of the ``lost`` ranks' replacements takes on this machine: the lost
        rank's own slot (``rank % nproc_per_node``) when no live rank here (or earlier in ``lost``) holds it, else
        ``None``: a rank of a lost machine finds its slot taken by this machine's rank of the same local index."""
        n = self.args.nproc_per_node
        held = {w.rank % n for w in self.workers
                if w.rank is not None and w.rank not in lost and w.process.poll() is None}
        slots: dict[int, int | None] = {}
        for rank in sorted(lost):
            slots[rank] = None if rank % n in held else rank % n
            held.add(rank % n)
        return slots

    def shared_devices(self, lost: list[int]) -> dict[int, int]:
        """``{lost rank: its device slot}`` for each lost rank whose replacement here would share a GPU with a live
        rank, when the job's ranks run on GPUs; ``{}`` on CPU, where sharing a slot costs only speed."""
        if membership.job_device(self.store, self.restarts) == "cpu":
            return {}
        return {rank: rank % self.args.nproc_per_node for rank, slot in self.device_slots(lost).items() if slot is None}

    def replace(self, lost: list[int]) -> int | None:
        """Hands the ``lost`` ranks (this machine's dead workers' or a lost machine's) to this machine's spares
        (the oldest first; a new process where none is left), publishes the recovery plan for the survivors and
        refills the pool of hot spares; returns its generation (``None``: they were started again, see below)."""
        dead = [w for w in self.workers if w.rank in lost and w.process.poll() is not None]
        if len(dead) == len(lost) and not any(process_group.started(self.store, self.restarts, r) for r in lost) \
                and all(w.spare is None for w in dead):  # (a rank a spare took joined a later generation)
            return self.start_again(lost)
        slots = {rank: slot for rank, slot in self.device_slots(lost).items() if slot is not None}
        self.workers = [w for w in self.workers if w.rank not in lost]
        idle = [w for w in self.workers if w.rank is None and w.process.poll() is None]
        if len(idle) < len(lost) and not self.args.cold_start and self.args.nnodes == 1 and not self.joined:
            return shrink_in_process(self, lost)
        replacements: dict[int, int] = {}
        cold: list[int] = []
        readiness: dict[str, str] = {}  # how far each replacement had got: waiting | forked | importing
        for rank in sorted(lost):
            if idle:
                spare = idle.pop(0)
                if self._priority_refused is None:  # it may still be starting: at its idle priority, maybe for minutes
                    priority.restore(spare.process.pid)
            else:  # no hot spare left: a new process takes the rank (forked warm, or importing everything first)
                cold.append(rank)
                spare = self.spawn(None, 0)
            waiting = spare.spare is not None and membership.is_waiting(self.store, self.restarts, spare.spare)
            readiness[str(rank)] = "waiting" if waiting else "forked" if spare.forked else "importing"
            spare.rank = rank
            replacements[rank] = spare.spare
            membership.publish_worker(self.store, self.restarts, rank, socket.gethostname(), spare.process.pid)
        plan = membership.publish_plan(self.store, self.restarts, sorted(replacements), self.live_world, replacements,
                                       slots)
        self.publish_ranks()
        # the pool of hot spares is refilled after the recovered job's first committed step (start_spares)
        self._owed, self._gate = self._owed + len(replacements) - len(cold), plan.generation
        emit("replacement_planned", generation=plan.generation, lost_ranks=plan.lost,
             replacements={str(k): v for k, v in plan.replacements.items()}, cold=cold, readiness=readiness,
             message=f"generation {plan.generation}: ranks {plan.lost} replaced by spares {plan.replacements}"
             + (f" (started cold for ranks {cold})" if cold else ""))
        return plan.generation

    def start_again(self, lost: list[int]) -> None:
        """Starts this machine's ``lost`` ranks again as themselves: they were lost before their process group, where
        the others wait for them (a replacement would join a generation those ranks never connect)."""
        self.workers = [w for w in self.workers if w.rank not in lost]
        for rank in sorted(lost):
            self.spawn(rank, rank % self.args.nproc_per_node)
        emit("rank_started_again", ranks=sorted(lost), message=f"ranks {sorted(lost)} were lost before their process "
             "group started: starting them again (the other ranks wait for them there)")

    def watch_machines(self, adopt: bool = True) -> list[int]:
        """Beats this machine's counter; on machine 0, returns the ranks of machines whose launcher went silent
        for ``--node-timeout`` seconds (each declared lost once, with a ``node_lost`` event)."""
        now = time.monotonic()
        node = self.args.node_rank
        if now - self._last_beat < self.args.node_timeout / 5 or self._store_lost:
            return []
        self._last_beat = now
        try:
            membership.heartbeat(self.store, self.restarts, node)
        except RuntimeError as err:  # machine 0 ended (or died) before this one: nobody listens any more
            self._store_lost = True
            log.warning(f"lightning-dlrover launch: the store on machine 0 is gone ({err}); not beating")
        if node != 0:
            return []
        lost: list[int] = []
        for other in sorted(set(join.machines(self)[1:]) - self.lost_nodes):
            count = membership.beats(self.store, self.restarts, other)
            if count == 0 or membership.is_done(self.store, self.restarts, other):
                continue  # not started yet, or its ranks finished
            seen = self._seen.get(other)
            if seen is None or seen[0] != count:
                self._seen[other] = (count, now)
            elif now - seen[1] > self.args.node_timeout:
                self.lost_nodes.add(other)
                ranks = membership.node_ranks(self.store, self.restarts, other) if adopt else []
                emit("node_lost", node=other, ranks=ranks, silent_s=round(now - seen[1], 2),
                     message=f"machine {other}'s launcher is silent for {now - seen[1]:.1f} s: its ranks {ranks} are lost")
                lost += ranks
        return lost

    def watch_zygote(self) -> None:
        """Notices a zygote that died (said once: later workers start as fresh interpreters) and, about once a second,
        reaps the exited orphans of workers re-parented to this launcher (the zygote's subreaper)."""
        if self._zygote is None:
            return
        if (code := self._zygote.process.poll()) is not None:
            self.lose_zygote(f"it exited with code {code}")
        elif time.monotonic() - self._reaped_at > 1.0:
            self._reaped_at = time.monotonic()
            zygote.reap_orphans({w.process.pid for w in self.workers} | {self._zygote.process.pid})

    def failed_ranks(self) -> list[int]:
        """The ranks of this machine's workers that exited with an error."""
        return [w.rank for w in self.workers if w.rank is not None and w.process.poll() not in (None, 0)]

    def others_finished(self) -> bool:
        """On machine 0: every other machine's ranks finished (or the machine is gone)."""
        return all(membership.is_done(self.store, self.restarts, n) or n in self.lost_nodes
                   or (n >= self.args.nnodes and n not in self.joined) for n in join.machines(self)[1:])

    def run(self) -> int:
        """Watches the workers (and, on machine 0, the other machines) until every rank finished; its exit code."""
        self.start()
        if join.joining_machine(self) and join.offer(self) is not None:
            return 1
        recovering: int | None = None  # generation of the recovery in progress
        while True:
            time.sleep(self.args.monitor_interval)
            if (left := join.taken(self)) is not None:
                return 0 if left == join.JOB_ENDED else 1
            if self.args.node_rank == 0 and (joined := join.admit(self, recovering)) is not None:
                recovering = joined
            for spare in [w for w in self.workers if w.rank is None and w.process.poll() is not None]:
                self.workers.remove(spare)  # a dead spare only shrinks the pool
            self.watch_zygote()
            self.start_spares()
            if recovering is not None and membership.restored_ranks(self.store, self.restarts, recovering) >= self.live_world:
                recovering = None
            if (grown := self.regrow.tick(self, recovering)) is not None:
                recovering = grown
            if (shrunk := retire.answer(self, recovering)) is not None:
                recovering = shrunk
            retire.reap(self)
            failed = self.failed_ranks() + self.watch_machines(adopt=not self._finished)
            if failed:
                recent = recovering is not None
                if not recent:  # ranks that die together (one fault, one machine) are replaced in one plan
                    time.sleep(self.args.settle)
                    failed = sorted({*failed, *self.failed_ranks()})
                # ranks on other machines survive unless their own launcher says otherwise: this one sees only its own
                survivors = self.live_world - len(failed)
                shared: dict[int, int] = {}
                if survivors > 0 and not recent and not self.args.no_in_process:
                    if not (shared := self.shared_devices(failed)):
                        recovering = self.replace(failed)
                        continue
                    emit("in_process_refused", why="device_taken", error=None,
                         message=f"lost ranks {sorted(shared)} would share the GPUs of this machine's ranks on device "
                         f"slots {sorted(set(shared.values()))}: not replacing them in process")
                if self.restarts >= self.args.max_restarts:
                    return 1
                reason = ("no_survivor" if not survivors else "during_recovery" if recent
                          else "device_taken" if shared else "in_process_off")
                emit("restarting_all", restarts=self.restarts + 1, failed_ranks=failed, reason=reason,
                     message=f"ranks {failed} failed "
                     + ("with no survivor" if not survivors else "during in-process recovery" if recent
                        else "and their GPUs are taken here" if shared else "")
                     + ": restarting every worker")
                self.stop(grace=self.args.stop_grace, keep_zygote=True)
                self.restarts += 1
                self.start()
                recovering = None
                continue
            ranks = [w for w in self.workers if w.rank is not None]
            if ranks and (all(w.process.poll() == 0 for w in ranks) or self.regrow.finished_without(ranks)):
                if not self._finished and not self._store_lost:
                    membership.mark_done(self.store, self.restarts, self.args.node_rank)
                self._finished = True
                if self.args.node_rank != 0 or self.others_finished():  # machine 0 keeps the store up till the end
                    return 0

