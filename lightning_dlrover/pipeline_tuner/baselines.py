"""Baselines measured in the same harness as the RL agent.

- :class:`FixedTuner`: one configuration, never changed; ``inline()`` is today's in-process loader (every stage
  in the training process, nothing prefetched), ``cores()`` the usual heuristic (each process stage gets as
  many workers as the machine has cores, like ``num_workers = os.cpu_count()``).
- :class:`HillClimbTuner`: in the manner of tf.data AUTOTUNE's hill climbing: from the configured pipeline
  (``start``; by default one worker per stage, or one parse worker and the rest inline if that is over the CPU
  budget), try +1 on each knob, keep the one that helped most, repeat; stop when nothing helps by ``min_gain`` or the CPU
  budget is spent. Its memory limit is AUTOTUNE's default (half the RAM), not the pipeline's memory budget:
  its peak memory is reported, not guarded.
- :class:`GridSearchTuner`: the offline oracle: measures every configuration of a grid and keeps the best.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import psutil

from lightning_dlrover.data.staged import STAGES, PipelineConfig
from lightning_dlrover.machine import available_cores
from lightning_dlrover.pipeline_tuner.agent import Decision, shrink
from lightning_dlrover.pipeline_tuner.observe import Budget, MemoryGuard, Observation


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

    def __init__(self, budget: Budget, min_gain: float = 0.02, ram_bytes: int | None = None,
                 start: PipelineConfig | None = None) -> None:
        super().__init__()
        self.budget, self.min_gain, self.done = budget, min_gain, False
        self.ram_bytes = ram_bytes or psutil.virtual_memory().total // 2
        # the configured start may be above the CPU budget (the user's own setting): it never adds beyond it
        cpus = max(budget.cpus, start.total_workers if start else 0)
        self.guard = MemoryGuard(Budget(cpus, self.ram_bytes, budget.max_prefetch))
        if start is not None:
            self.current = start if self.guard.allows(start) else shrink(start, self.guard)
        else:  # AUTOTUNE starts every parallel op at 1; where that is over the CPU budget, one parse worker
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


class AutotuneTuner:
    """In the manner of tf.data AUTOTUNE's model-based optimisation: from each window it estimates every stage's
    seconds per sample (its utilisation x its workers / the rate) and gives the whole CPU budget out one worker at a
    time to the stage with the lowest capacity (``workers / seconds per sample``; every stage keeps at least one,
    as AUTOTUNE keeps every parallel op's parallelism >= 1); the prefetch buffer doubles while the consumer waits for
    data more than 10% of a window. It stops when an estimate gives the configuration it runs twice in a row. Like
    AUTOTUNE it spends the budget it is given and knows nothing of the trainer sharing the cores; its memory limit is
    half the RAM, as AUTOTUNE's."""

    name = "autotune"

    def __init__(self, budget: Budget, start: PipelineConfig | None = None, ram_bytes: int | None = None) -> None:
        self.budget, self.done, self._same = budget, False, 0
        self.guard = MemoryGuard(Budget(max(budget.cpus, len(STAGES)), ram_bytes or psutil.virtual_memory().total // 2,
                                        budget.max_prefetch))
        self.current = start or PipelineConfig(1, 1, 1, 1, 1)

    def first(self) -> PipelineConfig:
        return self.current

    @property
    def best(self) -> PipelineConfig:
        return self.current

    def step(self, obs: Observation, worker_bytes: list[int] | None = None) -> Decision:
        self.guard.update(obs.config, worker_bytes or [], obs.batch_bytes)
        if self.done:
            return Decision(obs, None, f"autotune: holding {self.current.short()}", self.guard.predict(self.current))
        cost = {s: obs.utilisation[s] * max(obs.config.workers[s], 1) / max(obs.samples_per_s, 1e-9) for s in STAGES}
        workers = {s: 1 for s in STAGES}
        while sum(workers.values()) < self.budget.cpus:
            slowest = min(STAGES, key=lambda s: workers[s] / max(cost[s], 1e-12))
            workers[slowest] += 1
        prefetch = min(self.budget.max_prefetch, max(1, obs.config.prefetch * 2 if obs.wait_fraction > 0.1
                                                     else obs.config.prefetch))
        new = PipelineConfig(**workers, prefetch=prefetch)
        new = new if self.guard.allows(new) else shrink(new, self.guard)
        self._same = self._same + 1 if new == obs.config else 0
        if self._same >= 2:
            self.done = True
        self.current = new
        return Decision(obs, new if new != obs.config else None, f"autotune: {new.short()} from the stages' costs",
                        self.guard.predict(new))
