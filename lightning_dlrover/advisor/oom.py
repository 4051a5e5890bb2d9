"""Out-of-memory forecasts (stage 3 of the advisor, beside :mod:`~lightning_dlrover.advisor.detectors`): memory of
each node fitted per step, and the memory its ranks will allocate at their next checkpoint save counted as used."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lightning_dlrover.advisor.detectors import RankWindow


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
        staging_bytes: memory its ranks will allocate at their next checkpoint save (counted against the limit).
    """

    node: int
    step: int
    rss_bytes: float
    limit_bytes: float
    growth_bytes_per_step: float
    steps_to_oom: float
    seconds_to_oom: float
    staging_bytes: float = 0.0

    def message(self) -> str:
        staging = (f" with the {self.staging_bytes / 2**30:.2f} GiB staging copy of the first asynchronous checkpoint "
                   "counted" if self.staging_bytes else "")
        if self.growth_bytes_per_step <= 0:
            return (f"node {self.node}: {self.rss_bytes / 2**30:.2f} GiB in use{staging} reaches its limit of "
                    f"{self.limit_bytes / 2**30:.2f} GiB: the first checkpoint save will run out of memory. Use "
                    "blocking saves (async_checkpoint=False), fewer ranks per node, or more memory.")
        return (f"node {self.node}{staging}: memory grows {self.growth_bytes_per_step / 2**20:.1f} MiB/step "
                f"({self.rss_bytes / 2**30:.2f} of {self.limit_bytes / 2**30:.2f} GiB); out of memory in ~"
                f"{self.steps_to_oom:.0f} steps (~{self.seconds_to_oom:.0f} s) at step {self.step + self.steps_to_oom:.0f}."
                " Find what keeps growing (cached batches, tensors kept for logging), or lower data workers/batch.")


class OOMForecaster:
    """Fits memory growth per step of each node over the last ``window`` steps (least squares) and warns when the
    limit is less than ``horizon_steps`` away; warns again when the forecast halves. The memory the ranks will allocate
    at their next checkpoint save (:attr:`RankWindow.staging_bytes`) counts as already used, and warns even without
    growth when it does not fit.

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
        """Adds every node's memory at each step (its ranks' processes, plus every other process descending from
        one of them, each counted once); returns new warnings."""
        for node in sorted({w.node for w in windows}):
            here = [w for w in windows if w.node == node]
            series = self._series.setdefault(node, {})
            extra = node_children_bytes(here)
            for step in {s for w in here for s, _ in w.rss}:
                series[step] = series.get(step, 0.0) + extra
            for w in here:
                for step, value in w.rss:
                    series[step] = series.get(step, 0.0) + value
        found = []
        staging = {node: sum(w.staging_bytes for w in windows if w.node == node) for node in {w.node for w in windows}}
        for node, series in self._series.items():
            reserve = staging.get(node, 0.0)
            if reserve and series and node not in self._warned and series[max(series)] + reserve >= self.limit:
                forecast = OOMForecast(node, max(series), series[max(series)], self.limit, 0.0, 0.0, 0.0, reserve)
                self._warned[node] = 0.0
                self.forecasts.append(forecast)
                found.append(forecast)
                continue
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
            steps_left = max(0.0, (self.limit - now - reserve) / slope)
            previous = self._warned.get(node)
            if steps_left <= self.horizon and (previous is None or 0 < previous and steps_left <= previous / 2):
                forecast = OOMForecast(node, steps[-1], now, self.limit, float(slope), steps_left, steps_left * step_s,
                                       reserve)
                self._warned[node] = steps_left
                self.forecasts.append(forecast)
                found.append(forecast)
        return found

    def node_bytes(self, node: int) -> float:
        """The node's memory at the latest step seen (0 before any)."""
        series = self._series.get(node, {})
        return series[max(series)] if series else 0.0


def node_children_bytes(windows: Iterable[RankWindow]) -> float:
    """Resident bytes of the processes descending from the ranks of ``windows`` (one node) that are not ranks
    themselves, each counted once: under a launcher that starts ranks as children of rank 0 (Lightning's), rank 0's
    descendants include the other ranks and their data workers."""
    windows = list(windows)
    ranks = {w.pid for w in windows if w.pid}
    unique = {pid: value for w in windows for pid, value in w.children if pid not in ranks}
    return float(sum(unique.values()))


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
