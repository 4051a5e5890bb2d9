"""Stage 3: what goes wrong while a job runs. Stragglers (with the cause), out-of-memory forecasts, hot ranks.

Every detector works on per-rank windows of measured steps (:class:`RankWindow`) that the advisor gathers from
all ranks every few steps, and keeps its own state across windows. A window holds each quantity's median over its
steps: a one-off stretched step (another program's burst, a re-plan) does not move it.

A rank's step time in synchronous training is the same on every rank (collectives wait for the slowest), so
stragglers are told apart by what each rank did with the step. Every rank times its collectives (from the call to
the completion, :mod:`~lightning_dlrover.monitor.collectives`): the rest of its step is its **own** time (data
wait, compute, and idling of its own: a sleep, I/O, a lock). The ranks that wait for a slow rank spend its
lateness in collectives; the slow rank does not. The straggler is the rank whose own time is far above the
others' (in its median over the window, and beyond the window's step-to-step noise: its faster steps slower than
their slower ones, see :func:`clear_of_noise`); its cause is the largest excess: **data wait**, **compute** (its
main thread running or runnable) or **idle** (blocked outside collectives). When even the least-waiting rank spends ``comm_share`` of the step in
collectives, the job is **communication**-bound (reported for the job, not for one rank; the advice depends on
whether the ranks share one machine). Without collective timings (``collective_s`` of ``None``) own time is the
main thread's busy time and the data wait: a rank idling inside its step then looks like one waiting for a peer, and
no communication verdict is given. The advisor's own work is left out of the steps it measures.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_dlrover.advisor.oom import OOMForecast, OOMForecaster, node_children_bytes  # noqa: F401 (re-exported)

STRAGGLER_CAUSES = ("data wait", "compute", "idle")


@dataclass(frozen=True)
class StepSample:
    """One measured step of one rank: the fields of its
    :class:`~lightning_dlrover.monitor.steps.StepRecord` (``step_s``: ``seconds``, ``data_s``: its ``data_wait``,
    ``busy_s``, ``data_busy_s``, ``rss``), at global step ``step``;
    ``collective_s`` is ``None`` when collectives are not timed."""

    step: int
    step_s: float
    data_s: float
    busy_s: float
    rss: float = 0.0
    data_busy_s: float = 0.0
    collective_s: float | None = None


@dataclass(frozen=True)
class RankWindow:
    """One rank's medians per step over a window of steps.

    Attributes:
        rank: global rank.
        node: node index (``rank // ranks_per_node``).
        first_step, last_step: global steps the window covers.
        step_s: wall seconds per step.
        data_s: data wait per step (wall).
        busy_s: main-thread running/runnable seconds per step outside the data wait (its own compute).
        rss: ``(global step, bytes)`` resident memory of the rank's process at each step (its data workers and other
            child processes are in ``children``).
        data_busy_s: main-thread running/runnable seconds per step inside the data wait (making batches, callbacks).
        collective_s: seconds per step with a collective in flight (``None``: not timed).
        own_wall_s: seconds per step outside collectives (median over steps of ``step - collective``): its data
            wait, compute (waits for a CPU included: a rank that needs more CPU than others waits longer for it) and
            idling.
        idle_s: seconds per step blocked outside collectives and the data wait (sleep, I/O, locks).
        pid: the rank's process id (0: unknown).
        children: ``(pid, bytes)`` resident memory of each descendant process at the window's end.
        own_steps: seconds outside collectives of each step, in step order (empty: collectives not timed).
        staging_bytes: memory the rank will allocate at its next checkpoint save that it does not hold yet (the
            staging copy of ``DLRoverStrategy(async_checkpoint=True)`` before its first save), for the OOM forecast.
    """

    rank: int
    node: int
    first_step: int
    last_step: int
    step_s: float
    data_s: float
    busy_s: float
    rss: tuple[tuple[int, float], ...] = ()
    data_busy_s: float = 0.0
    collective_s: float | None = None
    own_wall_s: float = 0.0
    idle_s: float = 0.0
    pid: int = 0
    children: tuple[tuple[int, float], ...] = ()
    own_steps: tuple[float, ...] = ()
    staging_bytes: float = 0.0

    @classmethod
    def from_steps(cls, rank: int, node: int, steps: Sequence[StepSample], pid: int = 0,
                   children: Iterable[tuple[int, float]] = ()) -> RankWindow:
        """The window of ``steps`` (at least one): medians per step."""
        if not steps:
            raise ValueError(f"RankWindow.from_steps(rank={rank}): no steps; give at least one measured step.")
        med = statistics.median
        timed = all(s.collective_s is not None for s in steps)
        coll = [s.collective_s or 0.0 for s in steps]
        own = tuple(max(0.0, s.step_s - c) for s, c in zip(steps, coll))
        return cls(rank, node, steps[0].step, steps[-1].step, step_s=med(s.step_s for s in steps),
                   data_s=med(s.data_s for s in steps), busy_s=med(s.busy_s for s in steps),
                   rss=tuple((s.step, s.rss) for s in steps), data_busy_s=med(s.data_busy_s for s in steps),
                   collective_s=med(coll) if timed else None,
                   own_wall_s=med(own),
                   idle_s=med(max(0.0, s.step_s - s.data_s - s.busy_s - c) for s, c in zip(steps, coll)), pid=pid,
                   children=tuple(children), own_steps=own if timed else ())

    @property
    def own_s(self) -> float:
        """Seconds per step this rank spent on its own (not waiting for peers): outside collectives when they are
        timed, else the main thread's work in the data wait and in the step."""
        return self.own_wall_s if self.collective_s is not None else self.data_busy_s + self.busy_s

    @property
    def blocked_s(self) -> float:
        """Seconds per step blocked inside the step (in collectives and idling)."""
        return max(0.0, self.step_s - self.data_s - self.busy_s)


@dataclass(frozen=True)
class Straggler:
    """A rank named as a straggler.

    Attributes:
        rank: the rank.
        cause: one of :data:`STRAGGLER_CAUSES`.
        ratio: its own time per step over the median rank's (the other rank's with two ranks).
        excess_ms: milliseconds per step above that median.
        since_step: first step of the first window in which it was slow.
        named_at_step: the step at which it was named.
    """

    rank: int
    cause: str
    ratio: float
    excess_ms: float
    since_step: int
    named_at_step: int

    def message(self) -> str:
        return (f"rank {self.rank} is a straggler ({self.cause}): {self.ratio:.1f}x the median rank, "
                f"+{self.excess_ms:.1f} ms per step since step {self.since_step}")


class StragglerDetector:
    """Names a rank whose own time per step is at least ``threshold`` x the median rank's, at least
    ``min_excess_s`` and ``min_share`` of the step more, in ``patience`` consecutive windows (so within
    ``patience`` windows of it turning slow, and never on one stretched step: windows hold medians), the last of
    them clear of the noise: its faster steps (the lower quartile of its own time per step) slower than the others'
    slower steps (their upper quartile) in the same window. On a loaded machine a rank's own time jumps by tens of
    percent from step to step (waits for a CPU); a rank whose median is only pushed up by a few such steps is not
    named, one that is slow in every step is.

    Raises:
        ValueError: ``threshold <= 1``, ``patience < 1``, ``min_excess_s < 0`` or ``min_share`` outside [0, 1).
    """

    def __init__(self, threshold: float = 1.5, patience: int = 2, min_excess_s: float = 0.002,
                 comm_share: float = 0.5, min_share: float = 0.3) -> None:
        if threshold <= 1:
            raise ValueError(f"straggler threshold={threshold} must be above 1 (a ratio to the median rank).")
        if patience < 1:
            raise ValueError(f"straggler patience={patience} must be at least 1 window.")
        if min_excess_s < 0:
            raise ValueError(f"straggler min_excess_s={min_excess_s} must be >= 0.")
        if not 0 <= min_share < 1:
            raise ValueError(f"straggler min_share={min_share} must be in [0, 1) (a share of the step).")
        self.threshold, self.patience, self.min_excess_s, self.comm_share = threshold, patience, min_excess_s, comm_share
        self.min_share = min_share
        self._comm_streak = 0
        #: Collective seconds per step of the least-waiting rank when the job was found communication-bound.
        self.communication_s: float | None = None
        self._streak: dict[int, tuple[int, int, str]] = {}  # rank -> (windows, since_step, cause)
        self.named: dict[int, Straggler] = {}

    def update(self, windows: Sequence[RankWindow]) -> list[Straggler]:
        """Takes one window of every rank; returns the ranks named now (each rank once while it stays slow)."""
        if len(windows) < 2:
            return []
        found = []
        # The reference is the median of all ranks (of the other rank with two: the median of two is their mean).
        ref = {w.rank: [o for o in windows if o.rank != w.rank] if len(windows) == 2 else list(windows) for w in windows}
        timed = all(w.collective_s is not None for w in windows)
        verdicts = {w.rank: self._judge(w, ref[w.rank], timed) for w in windows}
        for w in windows:
            verdict = verdicts[w.rank]
            if verdict is None:
                self._streak.pop(w.rank, None)
                self.named.pop(w.rank, None)
                continue
            cause, ratio, excess = verdict
            count, since, _ = self._streak.get(w.rank, (0, w.first_step, cause))
            self._streak[w.rank] = (count + 1, since, cause)
            if count + 1 >= self.patience and w.rank not in self.named and clear_of_noise(w, ref[w.rank]):
                s = Straggler(w.rank, cause, ratio, 1000 * excess, since, w.last_step)
                self.named[w.rank] = s
                found.append(s)
        return found

    def _slow(self, value: float, ref: float, step_s: float) -> bool:
        return value >= self.threshold * ref and value - ref >= max(self.min_excess_s, self.min_share * step_s)

    def _judge(self, w: RankWindow, others: list[RankWindow], timed: bool) -> tuple[str, float, float] | None:
        med = statistics.median
        step_s = med(o.step_s for o in [w, *others])
        if timed:
            own = med(o.own_wall_s for o in others)
            if not self._slow(w.own_wall_s, own, step_s):
                return None
            excess = {"data wait": w.data_s - med(o.data_s for o in others),
                      "compute": w.busy_s - med(o.busy_s for o in others),
                      "idle": w.idle_s - med(o.idle_s for o in others)}
            return max(excess, key=excess.__getitem__), w.own_wall_s / max(own, 1e-9), w.own_wall_s - own
        own = med(o.own_s for o in others)
        if self._slow(w.own_s, own, step_s):
            data = w.data_busy_s - med(o.data_busy_s for o in others)
            busy = w.busy_s - med(o.busy_s for o in others)
            return ("data wait" if data >= busy else "compute"), w.own_s / max(own, 1e-9), w.own_s - own
        data = med(o.data_s for o in others)  # waiting for storage or data workers: not busy
        if self._slow(w.data_s, data, step_s):
            return "data wait", w.data_s / max(data, 1e-9), w.data_s - data
        return None

    def communication_bound(self, windows: Sequence[RankWindow]) -> float | None:
        """Collective seconds per step of the least-waiting rank once it exceeded ``comm_share`` of the step in
        ``patience`` consecutive windows (reported once), else ``None`` (also when collectives are not timed)."""
        if len(windows) < 2 or any(w.collective_s is None for w in windows):
            return None
        least = min(windows, key=lambda w: w.collective_s or 0.0)
        waited = least.collective_s or 0.0
        if waited < self.comm_share * least.step_s or waited < self.min_excess_s:
            self._comm_streak = 0
            return None
        self._comm_streak += 1
        if self._comm_streak == self.patience:
            self.communication_s = waited
            return waited
        return None


def clear_of_noise(window: RankWindow, others: Sequence[RankWindow]) -> bool:
    """Whether ``window``'s rank is slower than ``others`` beyond their step-to-step noise: the lower quartile of its
    own time per step above the upper quartile of theirs (``True`` when per-step own times are not known)."""
    mine, theirs = window.own_steps, [t for o in others for t in o.own_steps]
    if not mine or not theirs or any(not o.own_steps for o in others):
        return True
    return float(np.percentile(mine, 25)) > float(np.percentile(theirs, 75))


def communication_message(waited_s: float, step_s: float, nodes: int) -> str:
    """The finding of a communication-bound job whose least-waiting rank spends ``waited_s`` of each ``step_s``
    in collectives, on ``nodes`` machines (one machine: no network advice)."""
    head = (f"communication-bound: even the least-waiting rank spends {1000 * waited_s:.1f} ms of each "
            f"{1000 * step_s:.1f} ms step in collectives (no single rank is to blame); ")
    if nodes <= 1:
        return head + ("all ranks share one machine, so the network is not the cause: fewer ranks with more threads "
                       "each, or a larger batch per rank (fewer collectives per sample)")
    return head + "fewer ranks or nodes, a larger batch per rank, or a faster interconnect between the machines"


@dataclass(frozen=True)
class HotRank:
    """A rank that serves a far larger share of the embedding lookups than the others."""

    rank: int
    share: float
    ratio: float
    tables: tuple[str, ...] = field(default=())

    def message(self) -> str:
        top = ", ".join(self.tables[:3])
        return (f"rank {self.rank} is hot: {self.share:.0%} of the embedding work ({self.ratio:.1f}x the mean rank)"
                + (f"; heaviest tables: {top}" if top else ""))


def hot_ranks(loads: dict[int, float], tables: dict[int, list[tuple[str, float]]] | None = None,
              factor: float = 1.5) -> list[HotRank]:
    """Ranks whose embedding load is at least ``factor`` x the mean rank's (``loads``: rank -> floats per step)."""
    total = sum(loads.values())
    if total <= 0 or len(loads) < 2:
        return []
    mean = total / len(loads)
    out = []
    for rank, load in sorted(loads.items()):
        if load >= factor * mean:
            heavy = tuple(name for name, _ in sorted((tables or {}).get(rank, []), key=lambda t: -t[1]))
            out.append(HotRank(rank, load / total, load / mean, heavy))
    return out
