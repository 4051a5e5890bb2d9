"""Stage 3: what goes wrong while a job runs. Stragglers (with the cause), out-of-memory forecasts, hot ranks.

Every detector works on per-rank windows of measured steps (:class:`RankWindow`) that the advisor gathers from
all ranks every few steps, and keeps its own state across windows.

A rank's step time in synchronous training is the same on every rank (collectives wait for the slowest), so
stragglers are told apart by what each rank did with the step: its **own** time is the data wait plus the time
its main thread was running or runnable (``busy``); the rest of the step it was **blocked** (in collectives,
waiting for peers or the network). The straggler is the rank whose own time is far above the others'; its cause
is the larger excess (data wait or compute). A rank's blocked time is no evidence against it (every rank but the
slowest waits for the slowest), but the slowest rank's blocked time is the collectives' own duration: when even
the least-blocked rank spends ``comm_share`` of the step blocked, the cause is **communication** (a slow link
slows every rank of a collective alike, so it is reported for the job, not for one rank). A rank that sleeps
inside a step (not between steps) is indistinguishable from one waiting for a peer without tracing collectives,
and is not named.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

STRAGGLER_CAUSES = ("data wait", "compute")


@dataclass(frozen=True)
class RankWindow:
    """One rank's means per step over a window of steps.

    Attributes:
        rank: global rank.
        node: node index (``rank // ranks_per_node``).
        first_step, last_step: global steps the window covers.
        step_s: wall seconds per step.
        data_s: data wait per step (wall).
        busy_s: main-thread running/runnable seconds per step outside the data wait (its own compute).
        data_busy_s: main-thread running/runnable seconds per step inside the data wait (making batches, callbacks).
        rss: ``(global step, bytes)`` resident memory of the rank (plus its data workers) at each step.
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

    @property
    def own_s(self) -> float:
        """Seconds per step this rank's main thread worked (in the data wait and in the step)."""
        return self.data_busy_s + self.busy_s

    @property
    def blocked_s(self) -> float:
        """Seconds per step blocked inside the step (collectives: waiting for peers or transfers)."""
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
    """Names a rank whose own time per step is at least ``threshold`` x the median rank's (and at least
    ``min_excess_s`` more) in ``patience`` consecutive windows, so within ``patience`` windows of it turning slow.

    Raises:
        ValueError: ``threshold <= 1``, ``patience < 1`` or ``min_excess_s < 0``.
    """

    def __init__(self, threshold: float = 1.5, patience: int = 2, min_excess_s: float = 0.002,
                 comm_share: float = 0.5) -> None:
        if threshold <= 1:
            raise ValueError(f"straggler threshold={threshold} must be above 1 (a ratio to the median rank).")
        if patience < 1:
            raise ValueError(f"straggler patience={patience} must be at least 1 window.")
        if min_excess_s < 0:
            raise ValueError(f"straggler min_excess_s={min_excess_s} must be >= 0.")
        self.threshold, self.patience, self.min_excess_s, self.comm_share = threshold, patience, min_excess_s, comm_share
        self._comm_streak = 0
        #: Blocked seconds per step of the least-blocked rank when the job was found communication-bound.
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
        verdicts = {w.rank: self._judge_own(w, ref[w.rank]) for w in windows}
        for w in windows:
            verdict = verdicts[w.rank]
            if verdict is None:
                self._streak.pop(w.rank, None)
                self.named.pop(w.rank, None)
                continue
            cause, ratio, excess = verdict
            count, since, _ = self._streak.get(w.rank, (0, w.first_step, cause))
            self._streak[w.rank] = (count + 1, since, cause)
            if count + 1 >= self.patience and w.rank not in self.named:
                s = Straggler(w.rank, cause, ratio, 1000 * excess, since, w.last_step)
                self.named[w.rank] = s
                found.append(s)
        return found

    def _judge_own(self, w: RankWindow, others: list[RankWindow]) -> tuple[str, float, float] | None:
        own = statistics.median(o.own_s for o in others)
        if w.own_s >= self.threshold * own and w.own_s - own >= self.min_excess_s:
            data = w.data_busy_s - statistics.median(o.data_busy_s for o in others)
            busy = w.busy_s - statistics.median(o.busy_s for o in others)
            return ("data wait" if data >= busy else "compute"), w.own_s / max(own, 1e-9), w.own_s - own
        data = statistics.median(o.data_s for o in others)  # waiting for storage or data workers: not busy
        if w.data_s >= self.threshold * data and w.data_s - data >= self.min_excess_s:
            return "data wait", w.data_s / max(data, 1e-9), w.data_s - data
        return None

    def communication_bound(self, windows: Sequence[RankWindow]) -> float | None:
        """Blocked seconds per step of the least-blocked rank once it exceeded ``comm_share`` of the step in
        ``patience`` consecutive windows (reported once), else ``None``."""
        if len(windows) < 2:
            return None
        least = min(windows, key=lambda w: w.blocked_s)
        if least.blocked_s < self.comm_share * least.step_s or least.blocked_s < self.min_excess_s:
            self._comm_streak = 0
            return None
        self._comm_streak += 1
        if self._comm_streak == self.patience:
            self.communication_s = least.blocked_s
            return least.blocked_s
        return None


@dataclass(frozen=True)
class OOMForecast:
    """Memory of one node growing towards its limit.

    Attributes:
        node: node index.
        step: global step of the forecast.
        rss_bytes: the node's training memory now (its ranks and their data workers).
        limit_bytes: the limit (cgroup limit or physical memory).
        growth_bytes_per_step: fitted growth.
        steps_to_oom: steps until the limit at that growth.
        seconds_to_oom: the same in seconds at the current step time.
    """

    node: int
    step: int
    rss_bytes: float
    limit_bytes: float
    growth_bytes_per_step: float
    steps_to_oom: float
    seconds_to_oom: float

    def message(self) -> str:
        return (f"node {self.node}: memory grows {self.growth_bytes_per_step / 2**20:.1f} MiB/step "
                f"({self.rss_bytes / 2**30:.2f} of {self.limit_bytes / 2**30:.2f} GiB); out of memory in ~"
                f"{self.steps_to_oom:.0f} steps (~{self.seconds_to_oom:.0f} s) at step {self.step + self.steps_to_oom:.0f}."
                " Find what keeps growing (cached batches, tensors kept for logging), or lower data workers/batch.")


class OOMForecaster:
    """Fits memory growth per step of each node over the last ``window`` steps (least squares) and warns when the
    limit is less than ``horizon_steps`` away; warns again when the forecast halves.

    Raises:
        ValueError: a non-positive limit, horizon or window.
    """

    def __init__(self, limit_bytes: float, horizon_steps: int = 10_000, window: int = 50,
                 min_growth_bytes_per_step: float = 256 * 1024, min_r2: float = 0.8) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"memory limit {limit_bytes} bytes must be positive.")
        if horizon_steps < 1 or window < 3:
            raise ValueError(f"OOM horizon_steps={horizon_steps} must be >= 1 and window={window} >= 3.")
        self.limit, self.horizon, self.window = float(limit_bytes), horizon_steps, window
        self.min_growth, self.min_r2 = min_growth_bytes_per_step, min_r2
        self._series: dict[int, dict[int, float]] = {}
        self._warned: dict[int, float] = {}
        self.forecasts: list[OOMForecast] = []

    def update(self, windows: Sequence[RankWindow], step_s: float) -> list[OOMForecast]:
        """Adds every rank's memory samples (summed per node and step); returns new warnings."""
        for w in windows:
            series = self._series.setdefault(w.node, {})
            for step, value in w.rss:
                series[step] = series.get(step, 0.0) + value
        found = []
        for node, series in self._series.items():
            steps = sorted(series)[-self.window:]
            for old in sorted(series)[: -self.window]:
                del series[old]
            if len(steps) < 3:
                continue
            fit = _steepest_fit(np.array(steps, dtype=float), np.array([series[s] for s in steps]), self.min_r2)
            if fit is None or fit[0] < self.min_growth:
                continue
            slope, fitted = fit
            y = np.array([series[s] for s in steps])
            now = max(fitted, float(y[-1]))
            steps_left = max(0.0, (self.limit - now) / slope)
            previous = self._warned.get(node)
            if steps_left <= self.horizon and (previous is None or steps_left <= previous / 2):
                forecast = OOMForecast(node, steps[-1], now, self.limit, float(slope), steps_left, steps_left * step_s)
                self._warned[node] = steps_left
                self.forecasts.append(forecast)
                found.append(forecast)
        return found


def _steepest_fit(x: np.ndarray, y: np.ndarray, min_r2: float) -> tuple[float, float] | None:
    """``(slope, fitted value at the last x)`` of the steepest straight-line fit with ``R^2 >= min_r2`` over the
    last n, n/2, n/4 points (at least 4): growth that began inside the window is not averaged with the flat part
    before it, so the forecast errs early rather than late."""
    best = None
    n = len(x)
    while n >= 4 or (best is None and n == len(x) and n >= 3):
        xs, ys = x[-n:], y[-n:]
        slope, intercept = np.polyfit(xs, ys, 1)
        total = float(np.sum((ys - ys.mean()) ** 2))
        r2 = 1.0 - float(np.sum((ys - (slope * xs + intercept)) ** 2)) / total if total > 0 else 0.0
        if r2 >= min_r2 and (best is None or slope > best[0]):
            best = (float(slope), float(slope * xs[-1] + intercept))
        n //= 2
    return best


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
