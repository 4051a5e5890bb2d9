"""What a pipeline tuner sees and may spend: budgets, observations of a window, and the memory guard.

Pipeline memory is the unique memory (USS) of the stage worker processes plus the batches the main process
buffers (the prefetch queue and the batch being assembled), measured from ``/proc`` with psutil. The guard
predicts a configuration's memory from measurements (per worker process, per buffered batch) before it is
applied and refuses any configuration predicted over the budget, so the budget is a hard limit, not a penalty.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import psutil

from lightning_dlrover.data.staged import STAGES, PipelineConfig, PipelinedLoader, PipelineStats
from lightning_dlrover.data.staged.config import stage_methods
from lightning_dlrover.machine import available_cores

#: Memory of one stage worker process assumed before any has been measured.
PRIOR_WORKER_BYTES = 96 << 20


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


class WorkerMemory:
    """The unique memory (USS) of each worker process, at a cost the trainer does not feel.

    Reading a USS walks the process's page tables (``memory_full_info``: ~10 ms of the trainer's own CPU for a worker
    forked from a 500 MB trainer, measured here), which every 0.5 s for four workers took ~8% of a 1-rank demo job's
    steps. So each worker's USS is read in full when it is first seen, then followed by the growth of its resident
    size (``memory_info``, ~0.02 ms: pages a worker newly touches are its own), and one worker's full reading is
    refreshed every ``refresh_s`` seconds, so pages shared with the trainer at the fork that a worker writes to
    (copy-on-write: its USS grows, its resident size does not) are counted within ``refresh_s`` x workers."""

    def __init__(self, refresh_s: float = 10.0) -> None:
        self.refresh_s = refresh_s
        self._base: dict[tuple[int, float], tuple[int, int, float]] = {}  # (pid, start) -> (uss, rss, when read)
        self._last_refresh = time.monotonic()  # every worker is read in full when first seen: no refresh due yet

    def sample(self, pids: list[int]) -> list[int]:
        """The USS of each live process in ``pids`` (bytes), in order."""
        now, out, live = time.monotonic(), [], {}
        stale = min(self._base, key=lambda k: self._base[k][2], default=None)
        refresh = stale if now - self._last_refresh >= self.refresh_s else None
        for pid in pids:
            try:
                process = psutil.Process(pid)
                key = (pid, process.create_time())
                if key not in self._base or key == refresh:
                    full = process.memory_full_info()
                    self._base[key] = (full.uss, full.rss, now)
                    self._last_refresh = now if key == refresh else self._last_refresh
                    out.append(full.uss)
                else:
                    uss, rss, _ = self._base[key]
                    out.append(uss + max(0, process.memory_info().rss - rss))
                live[key] = self._base[key]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        self._base = live
        return out


def pipeline_memory(loader: PipelinedLoader, workers: WorkerMemory) -> tuple[int, list[int]]:
    """Pipeline memory now (bytes) and the USS of each worker process, as ``workers`` follows them."""
    uss = workers.sample(loader.worker_pids())
    buffered = (loader.config.prefetch + 2) * loader.stats.batch_bytes * 3
    return sum(uss) + buffered, uss


class Sampler:
    """Turns the loader's counters into :class:`Observation` windows; samples memory every ``memory_every_s``."""

    def __init__(self, loader: PipelinedLoader, memory_every_s: float = 0.5) -> None:
        self.loader, self.memory_every_s = loader, memory_every_s
        self._me = psutil.Process()
        self._workers = WorkerMemory()
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
            memory, uss = pipeline_memory(self.loader, self._workers)
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
