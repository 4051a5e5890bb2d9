"""Baselines measured in the same harness as the RL agent.

- :class:`FixedTuner`: one configuration, never changed; ``inline()`` is today's in-process loader (every stage
  in the training process, nothing prefetched), ``cores()`` the usual heuristic (each process stage gets as
  many workers as the machine has cores, like ``num_workers = os.cpu_count()``).
- :class:`HillClimbTuner`: in the manner of tf.data AUTOTUNE's hill climbing: from one worker per stage (one
  parse worker and the rest inline if that is over the CPU budget), try
  +1 on each knob, keep the one that helped most, repeat; stop when nothing helps by ``min_gain`` or the CPU
  budget is spent. Its memory limit is AUTOTUNE's default (half the RAM), not the pipeline's memory budget:
  its peak memory is reported, not guarded.
- :class:`GridSearchTuner`: the offline oracle: measures every configuration of a grid and keeps the best.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import psutil

from lightning_dlrover.data.staged import STAGES, PipelineConfig
from lightning_dlrover.pipeline_tuner.agent import Decision
from lightning_dlrover.pipeline_tuner.observe import Budget, MemoryGuard, Observation, available_cores


class FixedTuner:
    """Keeps one configuration."""

    def __init__(self, config: PipelineConfig, name: str = "fixed") -> None:
        self.config, self.name, self.done = config, name, True
        self.guard: MemoryGuard | None = None

    @classmethod
    def inline(cls) -> FixedTuner:
        return cls(PipelineConfig(0, 0, 0, 0, 0), "inline_fast")

    @classmethod
    def cores(cls, cores: int | None = None) -> FixedTuner:
        n = cores or available_cores()
        return cls(PipelineConfig(1, n, n, 1, 2), "workers_eq_cores")

    def first(self) -> PipelineConfig:
        return self.config

    @property
    def best(self) -> PipelineConfig:
        return self.config

    def step(self, obs: Observation, worker_bytes: list[int] | None = None) -> Decision:
        return Decision(obs, None, "fixed", 0)


class _Trials:
    """Shared bookkeeping: mean samples/s per configuration."""

    def __init__(self) -> None:
        self.means: dict[PipelineConfig, float] = {}

    def record(self, obs: Observation) -> None:
        self.means[obs.config] = obs.samples_per_s

    @property
    def best(self) -> PipelineConfig | None:
        return max(self.means, key=self.means.get) if self.means else None


class HillClimbTuner(_Trials):
    """tf.data-AUTOTUNE-like hill climbing (see the module docstring)."""

    name = "hill_climb"

    def __init__(self, budget: Budget, min_gain: float = 0.02, ram_bytes: int | None = None) -> None:
        super().__init__()
        self.budget, self.min_gain, self.done = budget, min_gain, False
        self.ram_bytes = ram_bytes or psutil.virtual_memory().total // 2
        self.guard = MemoryGuard(Budget(budget.cpus, self.ram_bytes, budget.max_prefetch))
        # AUTOTUNE starts every parallel op at 1; where that is over the CPU budget, one parse worker.
        self.current = PipelineConfig(1, 1, 1, 1, 1)
        if not self.guard.allows(self.current):
            self.current = PipelineConfig(0, 1, 0, 0, 1)
        self._candidates: list[PipelineConfig] = []
        self._tried: list[PipelineConfig] = []

    def first(self) -> PipelineConfig:
        return self.current

    def _neighbours(self) -> list[PipelineConfig]:
        knobs = [self.current.replace(**{s: self.current.workers[s] + 1}) for s in STAGES]
        knobs.append(self.current.replace(prefetch=self.current.prefetch + 1))
        return [c for c in knobs if self.guard.allows(c)]

    def step(self, obs: Observation, worker_bytes: list[int] | None = None) -> Decision:
        self.guard.update(obs.config, worker_bytes or [], obs.batch_bytes)
        self.record(obs)
        if self.done:
            return Decision(obs, None, "stopped", 0)
        prefix = ""
        if not self._candidates:
            if self._tried:  # a round is complete: climb to its best neighbour, or stop
                best = max(self._tried, key=lambda c: self.means[c])
                if self.means[best] <= self.means[self.current] * (1 + self.min_gain):
                    return self._stop(obs, f"no neighbour helps by {self.min_gain:.0%}")
                self.current, prefix = best, f"climbed to {best.short()}; "
            self._tried = []
            self._candidates = self._neighbours()
            if not self._candidates:
                return self._stop(obs, "CPU/RAM budget spent")
        candidate = self._candidates.pop(0)
        self._tried.append(candidate)
        return Decision(obs, candidate, f"{prefix}try {candidate.short()}", self.guard.predict(candidate))

    def _stop(self, obs: Observation, why: str) -> Decision:
        self.done = True
        return Decision(obs, self.current if obs.config != self.current else None,
                        f"{why}: stop at {self.current.short()}", self.guard.predict(self.current))


def default_grid(budget: Budget, read: Iterable[int] = (0, 1), parse: Iterable[int] | None = None,
                 transform: Iterable[int] | None = None, assemble: Iterable[int] = (0, 1),
                 prefetch: Iterable[int] = (2, 4)) -> list[PipelineConfig]:
    """Every combination of the given worker counts (default parse 0..cpus, transform 0..cpus/4) and prefetch
    depths whose total workers fit the CPU budget."""
    parse = list(range(0, budget.cpus + 1) if parse is None else parse)
    transform = list(range(0, max(1, budget.cpus // 4) + 1) if transform is None else transform)
    grid = [PipelineConfig(r, p, t, a, q) for r, p, t, a, q in itertools.product(read, parse, transform, assemble, prefetch)]
    return [c for c in grid if c.total_workers <= budget.cpus]


class GridSearchTuner(_Trials):
    """The offline oracle: every configuration of ``grid`` measured once, the best kept."""

    name = "grid_oracle"

    def __init__(self, grid: list[PipelineConfig]) -> None:
        super().__init__()
        if not grid:
            raise ValueError("GridSearchTuner needs at least one configuration.")
        self._queue, self.done = list(grid[1:]), False
        self._first = grid[0]
        self.guard: MemoryGuard | None = None

    def first(self) -> PipelineConfig:
        return self._first

    def step(self, obs: Observation, worker_bytes: list[int] | None = None) -> Decision:
        self.record(obs)
        if self._queue:
            nxt = self._queue.pop(0)
            return Decision(obs, nxt, f"grid: try {nxt.short()}", 0)
        self.done = True
        best = self.best
        return Decision(obs, best if best != obs.config else None, f"grid best {best.short()}", 0)
