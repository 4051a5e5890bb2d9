"""A pipeline model calibrated on a machine: the rate a configuration delivers to a trainer on ``cores`` cores, and
the observations a tuner would see, so that tuners can be evaluated where this project's 2-core machines cannot
show them (8-64 cores, a trainer consuming at GPU-like rates).

Calibration (:class:`Calibration`, measured by ``bench/bench_pipeline_scale.py --calibrate``): per batch, each
stage's core-seconds when it runs inline (``service_s``: the pipeline's own busy counters), the extra main-process
CPU per batch of a stage run in worker processes (``ipc_s``: moving its batches between processes), the trainer's
step (wall seconds ``step_s``, of which it keeps ``step_cores`` cores busy on average), the memory of a worker
process and of a batch, and the window-to-window noise of the measured rate.

The model, per batch (``X`` batches per second):

- **The consumer's chain is serial**: the training step, the inline stages when nothing is prefetched (with a
  prefetch they run in the prefetch thread), receiving from process stages (``ipc_s``), and the share
  ``gil`` of the thread stages' work (a thread holds the trainer's interpreter lock part of the time):
  ``X <= speed / serial``.
- **Each staffed stage** delivers at most ``workers / (service + ipc)`` batches per second, at ``speed``.
- **Assemble in worker processes** (the product's chain, :func:`~lightning_dlrover.data.staged.config.chained`):
  every staffed stage runs in processes together with the unstaffed stages before it and hands its batch to the
  next process (``ipc_s["hop"]``, default twice the receive); the consumer's chain is the step and the receive of
  assembled batches (``ipc_s["assemble"]``: the training process's measured CPU per batch), the receive moving
  to the prefetch thread (``gil`` of it serial) when there is a prefetch.
- **CPU contention**: the threads and processes share ``cores`` (processor sharing). The demand is
  ``X x (step_s x step_cores + all stage work + ipc)`` cores and cannot exceed the cores; the serial chain and
  the stages run at ``speed = cores / demand`` of their own pace when the demand would exceed them; each
  runnable process beyond the cores costs ``switch`` of the CPU (cache and scheduler losses).
- **A trainer whose step keeps its cores busy** (``barrier``): the step's intra-op threads meet at the end of each
  parallel region, so a core taken from one of them stalls the others too. The pipeline's work beyond the cores
  the step leaves free (``stolen = X x other work - (cores - step_cores)`` cores) lengthens the steps by ``barrier``
  seconds per CPU-second: ``X x step_s + barrier x stolen <= 1``. Measured on a 2-core machine
  (``bench/bench_pipeline_scale.py --calibrate``: the step's wall beside a process burning a known CPU) it is ~1:
  there, every millisecond of pipeline work costs the trainer a millisecond, wherever it runs. ``0`` leaves only
  processor sharing (a trainer that does not fill its cores, e.g. a GPU's one feeding thread on many cores).
- The rate is the largest ``X`` meeting every bound (a fixed point, found by bisection).

What it leaves out, so that its numbers are a model's: memory bandwidth and NUMA, the variance of stage times (a
prefetch of 0 is taken as lossless when stages are parallel), the trainer's intra-op threads competing for
cores beyond ``step_cores``. Observations (:meth:`PipelineModel.observe`) add the measured window noise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from lightning_dlrover.data.staged import DEFAULT_METHODS, STAGES, PipelineConfig
from lightning_dlrover.data.staged.config import chained, stage_methods
from lightning_dlrover.pipeline_tuner.observe import Observation


@dataclass(frozen=True)
class Calibration:
    """What the model is built from (see the module docstring); times are seconds per batch."""

    service_s: dict[str, float]
    ipc_s: dict[str, float]
    step_s: float
    step_cores: float
    worker_bytes: int
    batch_bytes: int
    batch_size: int
    noise: float = 0.03
    gil: float = 0.5
    switch: float = 0.05
    barrier: float = 0.0
    reset_s: float = 0.3
    reset_per_worker_s: float = 0.05
    methods: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_METHODS))

    def with_trainer(self, step_s: float, step_cores: float) -> Calibration:
        """The same pipeline feeding another trainer (e.g. a GPU's: a short step that keeps one core busy)."""
        return Calibration(**{**self.__dict__, "step_s": step_s, "step_cores": step_cores})


class PipelineModel:
    """The rate of a configuration on ``cores`` cores (see the module docstring) and noisy windows of it."""

    def __init__(self, calibration: Calibration, cores: int, seed: int = 0) -> None:
        self.cal, self.cores = calibration, cores
        self.rng = random.Random(seed)
        self._cache: dict[PipelineConfig, dict] = {}

    def _process(self, stage: str, config: PipelineConfig) -> bool:
        return config.workers[stage] > 0 and stage_methods(config, self.cal.methods)[stage] == "process"

    def _chain_parts(self, c: PipelineConfig) -> dict:
        """Assemble in processes (the product's chain): each stage with workers runs its own and the stages before
        it that have none, and sends its batch on (``ipc_s["hop"]``); the trainer plans and receives
        (``ipc_s["assemble"]``)."""
        cal, received = self.cal, self.cal.ipc_s.get("assemble", 0.0)
        hop = cal.ipc_s.get("hop", 2 * received)
        segment, pending = {}, 0.0
        for s in STAGES:
            pending += cal.service_s[s]
            if c.workers[s] > 0:
                segment[s], pending = pending + hop, 0.0
        threads = received if c.prefetch > 0 else 0.0  # the prefetch thread receives
        serial = cal.step_s + (received if c.prefetch == 0 else 0.0) + cal.gil * threads
        work = cal.step_s * cal.step_cores + sum(cal.service_s.values()) + received + hop * len(segment)
        stage_bound = min(c.workers[s] / cost for s, cost in segment.items())
        return {"serial": serial, "work": work, "stage_bound": stage_bound, "inline": 0.0, "threads": threads,
                "segment": segment}

    def _parts(self, c: PipelineConfig) -> dict:
        cal = self.cal
        runnable = 1 + sum(w for s, w in c.workers.items() if self._process(s, c))
        efficiency = 1.0 / (1.0 + cal.switch * max(0, runnable - self.cores))
        if chained(c, cal.methods):
            return {**self._chain_parts(c), "efficiency": efficiency}
        ipc = {s: cal.ipc_s.get(s, 0.0) if self._process(s, c) else 0.0 for s in STAGES}
        received = sum(ipc.values())  # it receives what every process stage sends (measured: its extra CPU)
        inline = sum(cal.service_s[s] for s in STAGES if c.workers[s] == 0)
        threads = sum(cal.service_s[s] for s in STAGES if c.workers[s] > 0 and not self._process(s, c))
        if c.prefetch > 0:  # the inline stages run in the prefetch thread
            threads, inline = threads + inline, 0.0
        serial = cal.step_s + inline + received + cal.gil * threads
        work = cal.step_s * cal.step_cores + sum(cal.service_s.values()) + 2 * sum(ipc.values())
        stage_bound = min((c.workers[s] / (cal.service_s[s] + ipc[s]) for s in STAGES if c.workers[s] > 0),
                          default=float("inf"))
        return {"serial": serial, "work": work, "stage_bound": stage_bound, "efficiency": efficiency,
                "inline": inline, "threads": threads, "segment": {}}

    def rate(self, c: PipelineConfig) -> float:
        """Batches per second delivered to (and trained by) the trainer."""
        if c not in self._cache:
            p = self._parts(c)

            cal = self.cal
            other = p["work"] - cal.step_s * cal.step_cores  # the pipeline's CPU-seconds per batch
            spare_cores = max(0.0, self.cores - cal.step_cores)

            def feasible(x: float) -> bool:
                demand = x * p["work"]
                speed = min(1.0, self.cores * p["efficiency"] / demand) if demand > 0 else 1.0
                # each second, the pipeline's work beyond the cores the step leaves free is taken from the step's
                stolen = max(0.0, x * other - spare_cores)
                return (x * p["serial"] <= speed and x <= p["stage_bound"] * speed
                        and demand <= self.cores * p["efficiency"] and x * cal.step_s + cal.barrier * stolen <= 1.0)

            lo, hi = 0.0, 1.0 / p["serial"]
            for _ in range(60):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if feasible(mid) else (lo, mid)
            self._cache[c] = {**p, "rate": lo}
        return self._cache[c]["rate"]

    def samples_per_s(self, c: PipelineConfig) -> float:
        return self.rate(c) * self.cal.batch_size

    def memory(self, c: PipelineConfig) -> int:
        workers = sum(w for s, w in c.workers.items() if self._process(s, c))
        return workers * self.cal.worker_bytes + (c.prefetch + 2) * self.cal.batch_bytes * 3

    def reset_s(self, c: PipelineConfig) -> float:
        """Seconds of a rebuild into ``c`` (nothing delivered meanwhile)."""
        return self.cal.reset_s + self.cal.reset_per_worker_s * c.total_workers

    def observe(self, c: PipelineConfig, seconds: float) -> Observation:
        """A window of ``seconds`` on ``c`` as the tuner's sampler would report it (the rate with measured noise)."""
        x = self.rate(c)
        p = self._cache[c]
        noisy = x * max(0.1, 1.0 + self.rng.gauss(0.0, self.cal.noise))
        cost = {s: p["segment"].get(s, self.cal.service_s[s] + (self.cal.ipc_s.get(s, 0.0)
                                                                  if self._process(s, c) else 0)) for s in STAGES}
        util = {s: min(1.0, x * cost[s] / max(c.workers[s], 1)) for s in STAGES}
        consumer = self.cal.step_s + (p["inline"] if c.prefetch == 0 else 0.0)
        wait = max(0.0, 1.0 - x * consumer)
        workers = [self.cal.worker_bytes] * sum(w for s, w in c.workers.items() if self._process(s, c))
        self.last_worker_bytes = workers
        return Observation(c, seconds, noisy * self.cal.batch_size, util, wait, min(self.cores, x * p["work"]),
                           self.memory(c), self.cal.batch_bytes, (1.0 - wait) / max(noisy * self.cal.batch_size, 1e-9))
