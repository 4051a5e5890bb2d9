"""What a pipeline tuner sees and may spend: budgets, observations of a window, and the memory guard.

Pipeline memory is the unique memory (USS) of the stage worker processes plus the batches the main process
buffers (the prefetch queue and the batch being assembled), measured from ``/proc`` with psutil. The guard
predicts a configuration's memory from measurements (per worker process, per buffered batch) before it is
applied and refuses any configuration predicted over the budget, so the budget is a hard limit, not a penalty.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import psutil

from lightning_dlrover.data.staged import STAGES, PipelineConfig, PipelinedLoader, PipelineStats
from lightning_dlrover.data.staged.config import stage_methods

#: Memory of one stage worker process assumed before any has been measured.
PRIOR_WORKER_BYTES = 96 << 20


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Budget:
    """What the pipeline of one rank may use: ``cpus`` workers in all stages together, ``memory_bytes`` of
    pipeline memory (hard), at most ``max_prefetch`` prefetched batches."""

    cpus: int
    memory_bytes: int
    max_prefetch: int = 8

    def __post_init__(self) -> None:
        if self.cpus < 1 or self.memory_bytes < 1 or self.max_prefetch < 0:
            raise ValueError(f"Budget(cpus={self.cpus}, memory_bytes={self.memory_bytes}, max_prefetch="
                             f"{self.max_prefetch}): cpus and memory_bytes must be positive.")

    @classmethod
    def for_node(cls, ranks_per_node: int = 1, cpus: int | None = None, memory_bytes: int | None = None,
                 max_prefetch: int = 8) -> Budget:
        """The cores left after the training ranks, shared equally by the ranks' pipelines (at least 1 each);
        memory default: a quarter of the available RAM, shared equally."""
        if cpus is None:
            cpus = max(1, (available_cores() - ranks_per_node) // max(ranks_per_node, 1))
        if memory_bytes is None:
            memory_bytes = psutil.virtual_memory().available // 4 // max(ranks_per_node, 1)
        return cls(int(cpus), int(memory_bytes), max_prefetch)


@dataclass(frozen=True)
class Observation:
    """One measurement window of a configuration.

    ``utilisation``: busy seconds of each stage per worker-second (1.0 = its workers never idle; an inline
    stage counts as one worker); ``wait_fraction``: share of the window the consumer waited for batches;
    ``cpu_cores``: cores used by this process and the workers; ``memory_bytes``: peak pipeline memory seen.
    ``samples_per_s`` is the end-to-end rate: samples over the wall time of whole consumer steps (a training
    step's own time included, not only its wait for data); ``consumer_s_per_sample``: the consumer's own
    seconds per sample (the window less its waits), which rises when the pipeline takes the trainer's cores.
    """

    config: PipelineConfig
    seconds: float
    samples_per_s: float
    utilisation: dict[str, float]
    wait_fraction: float
    cpu_cores: float
    memory_bytes: int
    batch_bytes: int
    consumer_s_per_sample: float = 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["config"] = self.config.short()
        return d


def process_workers(config: PipelineConfig, methods: dict[str, str] | None = None) -> int:
    """Worker processes of ``config`` (stages run as processes with at least one worker; with assemble in
    processes, every stage with workers)."""
    methods = stage_methods(config, methods)  # type: ignore[arg-type]
    return sum(w for s, w in config.workers.items() if methods[s] == "process")


class MemoryGuard:
    """Predicts pipeline memory of a configuration from what was measured, and refuses those over budget.

    ``predict(c) = process_workers(c) * per_worker + (c.prefetch + 2) * batch_bytes * 3`` (a batch exists
    as bytes, parsed arrays and tensors while it moves); ``per_worker`` is the largest USS per worker process
    measured so far (times ``margin``), or :data:`PRIOR_WORKER_BYTES` before any.
    """

    def __init__(self, budget: Budget, methods: dict[str, str] | None = None, margin: float = 1.15) -> None:
        self.budget, self.methods, self.margin = budget, methods, margin
        self.per_worker = float(PRIOR_WORKER_BYTES)
        self.batch_bytes = 0
        self._measured = False

    def update(self, config: PipelineConfig, worker_bytes: list[int], batch_bytes: int) -> None:
        """Learns from a measurement of ``config``: the USS of each worker process and the bytes of a batch."""
        if worker_bytes:
            biggest = max(worker_bytes) * self.margin
            self.per_worker = biggest if not self._measured else max(self.per_worker, biggest)
            self._measured = True
        if batch_bytes:
            self.batch_bytes = max(self.batch_bytes, batch_bytes)

    def predict(self, config: PipelineConfig) -> int:
        buffered = (config.prefetch + 2) * self.batch_bytes * 3
        return int(process_workers(config, self.methods) * self.per_worker + buffered)

    def allows(self, config: PipelineConfig) -> bool:
        """Within the CPU budget, the prefetch limit and (predicted) the memory budget."""
        return (config.total_workers <= self.budget.cpus and config.prefetch <= self.budget.max_prefetch
                and self.predict(config) <= self.budget.memory_bytes)


def pipeline_memory(loader: PipelinedLoader) -> tuple[int, list[int]]:
    """Pipeline memory now (bytes) and the USS of each worker process."""
    uss = []
    for pid in loader.worker_pids():
        try:
            uss.append(psutil.Process(pid).memory_full_info().uss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    buffered = (loader.config.prefetch + 2) * loader.stats.batch_bytes * 3
    return sum(uss) + buffered, uss


class Sampler:
    """Turns the loader's counters into :class:`Observation` windows; samples memory every ``memory_every_s``."""

    def __init__(self, loader: PipelinedLoader, memory_every_s: float = 0.5) -> None:
        self.loader, self.memory_every_s = loader, memory_every_s
        self._me = psutil.Process()
        self.restart()
        self.peak_memory = 0
        self.worker_bytes: list[int] = []

    def _cpu(self) -> float:
        total = sum(self._me.cpu_times()[:2])
        for pid in self.loader.worker_pids():
            try:
                total += sum(psutil.Process(pid).cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass
        return total

    def restart(self) -> None:
        """Starts a new window now (call after a configuration change has taken effect)."""
        self._t0 = time.perf_counter()
        self._stats0: PipelineStats = self.loader.stats.copy()
        self._cpu0 = self._cpu()
        self._window_peak = 0
        self._last_memory = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def poll(self) -> None:
        """Samples pipeline memory if ``memory_every_s`` has passed since the last sample."""
        now = time.perf_counter()
        if now - self._last_memory >= self.memory_every_s:
            self._last_memory = now
            memory, uss = pipeline_memory(self.loader)
            self._window_peak = max(self._window_peak, memory)
            self.peak_memory = max(self.peak_memory, memory)
            if uss:
                self.worker_bytes = uss

    def observe(self) -> Observation:
        """The window since :meth:`restart` (memory is sampled once more at its end)."""
        self._last_memory = 0.0
        self.poll()
        seconds = max(self.elapsed(), 1e-9)
        now, before = self.loader.stats, self._stats0
        config = self.loader.config
        util = {s: (now.busy[s] - before.busy[s]) / (max(config.workers[s], 1) * seconds) for s in STAGES}
        cpu = (self._cpu() - self._cpu0) / seconds
        samples, wait = now.samples - before.samples, min(now.wait_s - before.wait_s, seconds)
        return Observation(config, seconds, samples / seconds, util, wait / seconds, cpu, self._window_peak,
                           now.batch_bytes, (seconds - wait) / max(samples, 1))
