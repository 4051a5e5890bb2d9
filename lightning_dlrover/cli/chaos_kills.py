"""The kills of a ``lightning-dlrover chaos --kills N`` drill: when each one lands and which process it hits.

Two schedules, both drawn in advance from ``--seed`` so that every mode (``--in-process``, ``torchrun`` with
parity, checkpoint-only) gets the same kill sequence:

- the kill rule (default): each kill a random 0..``--kill-jitter`` s after the job committed a step past the
  previous recovery (the first: after the job's first committed step);
- a Poisson schedule (``--kill-rate R``, kills per minute): exponential inter-arrival times counted from the
  job's first committed step, whatever the job is doing then (a kill may land during a recovery).

Each kill SIGKILLs the process holding a random rank: under ``lightning-dlrover launch`` the one the launcher's
store names, under ``torchrun`` the agent's worker whose ``RANK`` it is. Every kill is a ``fault_injected``
event of this runner: its ``step`` the newest step the job digested before it, its ``committed_step`` None (the
runner cannot see commits; the report takes them from the recovery's events).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from lightning_dlrover.fault.inplace import membership
from lightning_dlrover.fault.inplace.store import has_key
from lightning_dlrover.monitor.events import Event, configure, emit


@dataclass(frozen=True)
class Kill:
    """One planned kill: ``delay`` seconds (after the previous recovery's first commit, or on the Poisson clock
    since the previous kill) and the rank it hits."""

    delay: float
    rank: int


def plan(kills: int, world: int, seed: int, jitter: float, rate: float | None) -> list[Kill]:
    """The drill's kills, drawn from ``seed``: the same for every mode of the same job. ``rate`` (kills per
    minute) draws exponential delays (a Poisson schedule), else each delay is uniform in ``[0, jitter]``."""
    rng = random.Random(seed)
    if rate is not None and rate <= 0:
        raise ValueError(f"a kill rate must be > 0 kills per minute, got {rate}")
    return [Kill(rng.expovariate(rate / 60.0) if rate is not None else rng.uniform(0.0, jitter), rng.randrange(world))
            for _ in range(kills)]


def trained_since(events: list[Event], since: float) -> float | None:
    """When the job first committed a step after time ``since``: ``since`` 0, a per-step digest of a later step than
    the first one it recorded (the state it started at); else (``since`` a kill) the ``resumed`` event of the
    recovery that followed (a digest may still come from a rank finishing its step after the kill)."""
    resumed = [e.time for e in events if e.kind == "resumed" and e.time > since]
    if since > 0:
        return min(resumed, default=None)
    digests = [e for e in events if e.kind == "digest" and not e["final"]]
    moved = [e.time for e in digests if e.step != digests[0].step]
    return min(resumed + moved, default=None)


def newest_digest(events: list[Event], moment: float) -> int | None:
    """The newest step the job digested before ``moment``: a step that ended (its commit may still be in flight)."""
    steps = [e.step for e in events if e.kind == "digest" and not e["final"] and e.time < moment]
    return steps[-1] if steps else None


class Killer:
    """Finds and SIGKILLs the process holding a rank of a running job (``agents``: its launchers or torchrun
    agents; ``store``: the ``lightning-dlrover launch`` store's address, ``None`` under torchrun)."""

    def __init__(self, agents: list[subprocess.Popen], store: str | None) -> None:
        self.agents = agents
        self._store = membership.connect(store) if store is not None else None

    def ended(self) -> bool:
        """Whether a launcher (or agent) exited: the job finished or failed."""
        return any(a.poll() is not None for a in self.agents)

    def pid(self, rank: int, events: list[Event]) -> int | None:
        """The process holding ``rank`` now, ``None`` while there is none (a restart in progress)."""
        if self._store is not None:
            launch = sum(e.kind == "restarting_all" for e in events)
            placed = has_key(self._store, f"{launch}/rank/{rank}")
            return membership.worker(self._store, launch, rank)[1] if placed else None
        for agent in self.agents:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(agent.pid).children():
                    with contextlib.suppress(psutil.Error):
                        if child.status() != psutil.STATUS_ZOMBIE and child.environ().get("RANK") == str(rank):
                            return child.pid
        return None


def _wait(condition: Callable[[], object], killer: Killer, deadline: float) -> object:
    """Polls ``condition`` until it is truthy (returns it), the job ends or ``deadline`` passes (``None``)."""
    while time.time() < deadline and not killer.ended():
        found = condition()
        if found:
            return found
        time.sleep(0.05)
    return None


def run_kills(kills: list[Kill], killer: Killer, events: Callable[[], list[Event]], events_file: str,
              deadline: float, poisson: bool) -> tuple[int, str]:
    """Delivers ``kills`` to the running job; returns how many landed and, when fewer than planned, why."""
    configure(events_file)
    since, clock = 0.0, None
    for landed, kill in enumerate(kills):
        if poisson:
            if clock is None:  # the Poisson clock starts at the job's first committed step
                clock = _wait(lambda: trained_since(events(), 0.0), killer, deadline)
                if clock is None:
                    return landed, _why(killer, "before the job committed its first step")
            clock += kill.delay
            at = clock
        else:
            trained = _wait(lambda: trained_since(events(), since), killer, deadline)
            if trained is None:
                return landed, _why(killer, "before the job committed a step" + (" after the previous recovery"
                                                                                   if landed else ""))
            at = time.time() + kill.delay
        if _wait(lambda: time.time() >= at, killer, deadline) is None:
            return landed, _why(killer, f"before the kill's moment ({kill.delay:.1f} s on)")
        pid = _wait(lambda: killer.pid(kill.rank, events()), killer, deadline)
        if pid is None:
            return landed, _why(killer, f"while no process held rank {kill.rank}")
        now, seen = time.time(), events()
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
        since = now
        emit("fault_injected", step=newest_digest(seen, now), phase="random", target="rank", signal="SIGKILL",
             committed_step=None, message=f"chaos: SIGKILLed rank {kill.rank} (pid {pid})")
    return len(kills), ""


def _why(killer: Killer, when: str) -> str:
    ended = "the job ended" if killer.ended() else "the drill's --timeout passed"
    return f"{ended} {when}"
