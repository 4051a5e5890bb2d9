"""``FaultInjector``: kills one rank of a ``DLRoverStrategy`` job at a chosen training step and phase.

For tests, demos and failure drills. Install it as a callback (Python, or YAML/CLI)::

    trainer:
      callbacks:
        - class_path: lightning_dlrover.fault.FaultInjector
          init_args: {rank: 1, step: 5, phase: after_optimizer}

or through the environment, which reaches every rank a launcher starts::

    LIGHTNING_DLROVER_FAULT=rank=1,step=5,phase=after_optimizer[,signal=SIGTERM]
    LIGHTNING_DLROVER_FAULT=rank=1+2,step=5,phase=before_forward   # two ranks die at the same point
    LIGHTNING_DLROVER_FAULT="rank=1,step=5,phase=before_forward;rank=0,step=5,phase=during_recovery"  # two faults
    LIGHTNING_DLROVER_FAULT=step=5,phase=after_optimizer,target=node   # set on one torchrun agent only
    LIGHTNING_DLROVER_FAULT=step=5,phase=after_optimizer,target=all    # every rank dies at once

``target=node`` takes down the whole node as a lost machine would: the first worker that reaches the point
SIGKILLs its ``torchrun`` agent (its parent process), the agent's other workers, then itself. A job that
resumed from a failure (``DLRoverStrategy.recovered``) never fires again, so the restarted workers, which
inherit the same environment, replay the step instead of dying again; nor does a worker its launcher restarted
(``TORCHELASTIC_RESTART_COUNT > 0``), which may have had nothing to resume from. ``target=all`` kills every rank that
reaches the point (the whole job at once, as a power cut would): nobody is left to spill.

Where one fault kills several ranks (``rank=1+2``, ``target=all``, or ``target=node`` on a node with several
workers), each of them dies at the named step and phase, none earlier, none later: every such rank, on reaching
the point, marks its arrival in the job's store (the launcher's, ``MASTER_ADDR:MASTER_PORT``) and waits for the
others' marks before it dies (at most :data:`TOGETHER_TIMEOUT_S` seconds, then it dies anyway and says whom it
did not see). Without that wait, the first rank to die could break a collective a slower peer was still
finishing before the point (a checkpoint's last barrier), and that peer would fail, or recover, instead of dying
at the point: on a loaded machine the drill then killed a different step than the one named.

``step=S`` is the 0-based index of a training step: the step that runs while ``trainer.global_step == S``,
whose optimizer update is the ``S + 1``-th and leaves ``trainer.global_step == S + 1``. ``step=0`` is the
first step of a fresh run; after resuming from a checkpoint at global step ``G``, the next step is ``G``.
The phases of a step, in order:

- ``before_forward``: before the LightningModule's ``training_step`` (nothing of step ``S`` has run).
- ``after_optimizer``: after the dense optimizer step (the step's embedding and dense updates are applied;
  with parity, nothing of the step is committed yet).
- ``during_parity_commit``: inside the parity commit, after this rank sent its row deltas and folded in the
  ones it received, before the vote that commits the step (needs ``DLRoverStrategy(parity=...)``).
- ``during_vote``: after this rank's all-gather of the vote returned, before it records the commit (needs
  parity). With ``signal=error`` the rank raises ``RuntimeError`` there instead of dying, as a rank does whose
  all-gather broke under it (a peer lost mid-vote) while the other ranks' completed.

and one outside the step: ``during_recovery``, on a rank that survived a loss, inside an in-process recovery
(``lightning-dlrover launch``) once the communicator was rebuilt and before the committed state is restored;
``step`` is the step training resumes at. A loss there must fall back to restarting every worker.
"""

from __future__ import annotations

import contextlib
import os
import signal as signals
import sys
import time
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import psutil
import torch.distributed as dist

from lightning_dlrover.fault.points import (
    ENV_FORMAT,
    FAULT_ENV,
    PHASES,
    RECOVERY_PHASES,
    SIGNALS,
    SPARES_TIMEOUT_S,
    TARGETS,
    WAIT_FOR_SPARES_ENV,
)
from lightning_dlrover.log import get_logger
from lightning_dlrover.monitor.events import emit
from lightning_dlrover.worker_env import local_world_size, restart_count

log = get_logger(__name__)

#: Seconds the ranks one fault kills together wait at its point for each other's arrival before dying anyway.
TOGETHER_TIMEOUT_S = 60.0


class FaultInjector(pl.Callback):
    """Sends ``signal`` to its own process on global rank ``rank`` at phase ``phase`` of training step ``step``.

    Args:
        rank: global rank to kill, or a list of ranks that die at the same point (ignored with ``target="node"``).
        step: 0-based index of the training step: the one that runs while ``trainer.global_step == step``.
        phase: ``"before_forward"``, ``"after_optimizer"``, ``"during_parity_commit"`` or ``"during_vote"`` (see
            the module docs).
        signal: ``"SIGKILL"`` (the process dies at once, as on a lost machine), ``"SIGTERM"`` (the process's
            handlers run first: Lightning's stops the trainer on that rank) or ``"error"`` (raises ``RuntimeError``
            as a broken collective does; the process lives on).
        target: ``"rank"``; ``"node"``: SIGKILL this worker's ``torchrun`` agent and all its workers; ``"all"``:
            every rank kills itself (see the module docs).

    As a callback, :meth:`setup` registers it in ``DLRoverStrategy.fault_points`` (without the callback:
    :meth:`attach`); the strategy calls it as ``injector(phase, step)`` with ``step = trainer.global_step``.
    Before the signal it prints ``FaultInjector: killing rank R (pid P) at step S, phase P with SIGNAL`` (or
    ``FaultInjector: killing node at <unix time> ...``) to stderr.
    """

    def __init__(
        self, rank: int | list[int], step: int, phase: str = "after_optimizer", signal: str = "SIGKILL",
        target: str = "rank",
    ) -> None:
        if target not in TARGETS:
            raise ValueError(f"FaultInjector target={target!r} is not one of {list(TARGETS)}.")
        if phase not in PHASES + RECOVERY_PHASES:
            raise ValueError(f"FaultInjector phase={phase!r} is not one of {list(PHASES + RECOVERY_PHASES)}.")
        if signal not in SIGNALS:
            raise ValueError(f"FaultInjector signal={signal!r} is not one of {list(SIGNALS)}.")
        if signal == "error" and target != "rank":
            raise ValueError(f"FaultInjector signal='error' raises in one rank; target={target!r} needs a real signal.")
        ranks = list(rank) if isinstance(rank, (list, tuple)) else [rank]
        for name, value in [*(("rank", r) for r in ranks), ("step", step)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"FaultInjector {name}={value!r} must be an integer >= 0.")
        if not ranks:
            raise ValueError("FaultInjector rank=[] names no rank; give one rank or a list of them.")
        self.rank = rank if isinstance(rank, int) else sorted(set(ranks))
        self.step, self.phase, self.signal, self.target = step, phase, signal, target
        self._strategy: Any = None
        self._agent_pid: int | None = None

    @property
    def ranks(self) -> list[int]:
        """The ranks this injector kills (``rank`` as a list)."""
        return [self.rank] if isinstance(self.rank, int) else self.rank

    def __repr__(self) -> str:
        return (
            f"FaultInjector(rank={self.rank}, step={self.step}, phase={self.phase!r}, signal={self.signal!r}, "
            f"target={self.target!r})"
        )

    @classmethod
    def from_env(cls, value: str | None = None) -> FaultInjector | None:
        """The injector described by ``value`` (default: ``os.environ[FAULT_ENV]``); ``None`` if that is unset or blank.

        The format is ``rank=R,step=S,phase=P`` with an optional ``,signal=SIGKILL|SIGTERM``, in any order;
        ``rank=1+2`` kills ranks 1 and 2 at the same point.
        """
        if value is None:
            value = os.environ.get(FAULT_ENV)
        if value is None or not value.strip():
            return None
        source = f"{FAULT_ENV}={value!r}"
        fields: dict[str, str] = {}
        for item in value.split(","):
            key, sep, field = (part.strip() for part in item.partition("="))
            if not sep or not key or not field or "=" in field:
                raise ValueError(f"{source}: {item.strip()!r} is not key=value; the format is {ENV_FORMAT}.")
            if key not in ("rank", "step", "phase", "signal", "target"):
                raise ValueError(f"{source}: unknown key {key!r}; the format is {ENV_FORMAT}.")
            if key in fields:
                raise ValueError(f"{source}: {key!r} is given twice; the format is {ENV_FORMAT}.")
            fields[key] = field
        target = fields.get("target", "rank")
        fields.setdefault("rank", "0" if target in ("node", "all") else "")
        missing = [key for key in ("rank", "step", "phase") if not fields.get(key)]
        if missing:
            raise ValueError(f"{source}: missing {', '.join(missing)}; the format is {ENV_FORMAT}.")
        numbers: dict[str, list[int]] = {}
        for key in ("rank", "step"):
            try:
                numbers[key] = [int(part) for part in (fields[key].split("+") if key == "rank" else [fields[key]])]
            except ValueError:
                message = f"{source}: {key}={fields[key]!r} is not an integer; the format is {ENV_FORMAT}."
                raise ValueError(message) from None
        ranks, [step] = numbers["rank"], numbers["step"]
        try:
            return cls(ranks[0] if len(ranks) == 1 else ranks, step, fields["phase"], fields.get("signal", "SIGKILL"),
                       target)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None

    @classmethod
    def all_from_env(cls, value: str | None = None) -> list[FaultInjector]:
        """Every injector in ``value`` (default: ``os.environ[FAULT_ENV]``): :meth:`from_env` specs joined by ``;``."""
        if value is None:
            value = os.environ.get(FAULT_ENV, "")
        return [injector for part in value.split(";") if (injector := cls.from_env(part)) is not None]

    def attach(self, strategy: Any) -> None:
        """Adds this injector to ``strategy.fault_points`` (once), checking that the strategy reaches its phase."""
        points = getattr(strategy, "fault_points", None)
        if not isinstance(points, list):
            raise TypeError(
                f"{self!r} needs DLRoverStrategy, which calls its fault points during training; the trainer's "
                f"strategy is {type(strategy).__name__}. Use Trainer(strategy=DLRoverStrategy(...))."
            )
        if self.phase in ("during_parity_commit", "during_vote") and getattr(strategy, "parity", None) is None:
            raise ValueError(
                f"{self!r}: phase {self.phase!r} is only reached with parity on. Pass "
                f"DLRoverStrategy(parity=ParityConfig(k, r)) or choose one of {[p for p in PHASES if p != self.phase]}."
            )
        if self.target == "rank" and max(self.ranks) >= strategy.world_size:
            raise ValueError(f"{self!r}: there is no rank {max(self.ranks)} at world size {strategy.world_size}.")
        if self not in points:
            points.append(self)
        self._strategy = strategy
        self._agent_pid = os.getppid()  # while this worker's agent surely lives: the node kill's target

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Registers this injector with the trainer's ``DLRoverStrategy`` (see :meth:`attach`)."""
        if 0 <= trainer.max_steps <= self.step:
            raise ValueError(
                f"{self!r} would never fire: training stops at Trainer(max_steps={trainer.max_steps}), after the "
                f"step with global_step {trainer.max_steps - 1}."
            )
        self.attach(trainer.strategy)

    def __call__(self, phase: str, step: int) -> None:
        """The fault point: kills this process if it is global rank ``rank`` at ``phase`` of training step ``step``."""
        if phase != self.phase or step != self.step or getattr(self._strategy, "recovered", False) or restart_count():
            return  # a restarted worker (same environment) replays the step instead of dying again
        if os.environ.get(WAIT_FOR_SPARES_ENV) == "1":  # every rank, so that none waits in a collective meanwhile
            self._wait_for_a_hot_spare()
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if self.target == "rank" and rank not in self.ranks:
            return
        pid = os.getpid()
        self._meet_the_others(rank)
        sys.stdout.flush()
        sys.stderr.flush()
        emit("fault_injected", step=step, phase=phase, target=self.target, signal=self.signal,
             committed_step=getattr(self._strategy, "committed_step", None))
        if self.signal == "error":
            log.warning(f"FaultInjector: raising RuntimeError on rank {rank} (pid {pid}) at step {step}, phase {phase}")
            raise RuntimeError(f"FaultInjector: injected error on rank {rank} at step {step}, phase {phase}")
        if self.target == "node":
            log.warning(f"FaultInjector: killing node at {time.time():.3f} (agent pid {self._agent_pid}) from rank "
                        f"{rank} at step {step}, phase {phase}")
            kill_node(self._agent_pid)
        log.warning(f"FaultInjector: killing rank {rank} (pid {pid}) at step {step}, phase {phase} with {self.signal}")
        os.kill(pid, getattr(signals, self.signal))

    def _together(self, rank: int) -> tuple[str, list[str]]:
        """This rank's name and the names of every rank this fault kills at the same point (itself included)."""
        if self.target == "node":
            node = os.environ.get("GROUP_RANK", "0")
            names = [f"node{node}/{i}" for i in range(local_world_size())]
            return f"node{node}/{os.environ.get('LOCAL_RANK', '0')}", names
        ranks = range(dist.get_world_size() if dist.is_initialized() else 1) if self.target == "all" else self.ranks
        return f"rank{rank}", [f"rank{r}" for r in ranks]

    def _meet_the_others(self, rank: int) -> list[str] | None:
        """Where this fault kills several ranks: marks this rank's arrival at the point in the job's store and waits
        for every other one's (see the module docs). Returns the ranks not seen (``[]``: all met; ``None``: a single
        rank dies, nothing to wait for)."""
        me, names = self._together(rank)
        if len(names) < 2:
            return None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            log.warning(f"{self!r}: no MASTER_ADDR/MASTER_PORT, so no store to meet the other ranks in: dying alone")
            return [name for name in names if name != me]
        prefix = f"lightning_dlrover/fault/{restart_count()}/{self.step}/{self.phase}/"
        store = None
        try:
            store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=TOGETHER_TIMEOUT_S))
            store.set(prefix + me, str(os.getpid()))
            store.wait([prefix + name for name in names], timedelta(seconds=TOGETHER_TIMEOUT_S))
        except Exception as err:  # noqa: BLE001 - a store gone (its host died first) or a peer that never came
            missing = [name for name in names if name != me]
            with contextlib.suppress(Exception):  # the store itself may be gone
                missing = [name for name in missing if store is None or not store.check([prefix + name])]
            if missing:
                log.warning(f"FaultInjector: {me} did not meet {missing} at step {self.step}, phase {self.phase} "
                            f"within {TOGETHER_TIMEOUT_S:.0f} s ({type(err).__name__}: {err}): dying without them")
            return missing
        return []

    def _wait_for_a_hot_spare(self) -> None:
        """Under ``lightning-dlrover launch``: waits until one of the launcher's spares waits for a rank (see
        :data:`~lightning_dlrover.fault.points.WAIT_FOR_SPARES_ENV`)."""
        from lightning_dlrover.fault.inplace import membership

        if not membership.enabled():
            return
        store, deadline = membership.connect(), time.monotonic() + SPARES_TIMEOUT_S
        while membership.spares_waiting(store, restart_count()) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)


def kill_node(agent_pid: int | None) -> None:
    """SIGKILLs this worker's agent ``agent_pid`` (its parent when the fault was attached), the agent's other workers,
    then this process.

    Only while the agent is still this process's parent: the workers of one node all fire at the same point, and
    once one of them has killed the agent the others are re-parented to the nearest reaper (init, or the process
    that runs the whole machine's jobs), which must never be taken for the agent. The first worker to act kills
    every sibling it saw, so the others only need to die themselves.
    """
    me = os.getpid()
    victims: list[psutil.Process] = []
    if agent_pid is not None and agent_pid > 1 and os.getppid() == agent_pid:
        with contextlib.suppress(psutil.Error):
            agent = psutil.Process(agent_pid)
            victims = [agent, *(p for p in agent.children() if p.pid != me)]
    for process in victims:
        with contextlib.suppress(psutil.Error):
            process.kill()
    os.kill(me, signals.SIGKILL)
