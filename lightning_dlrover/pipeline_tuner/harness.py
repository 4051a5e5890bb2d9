"""One harness for every tuner: windows of measurement, decisions applied at safe points, a trace.

:class:`TunerDriver` is called after every batch the consumer took (by the :class:`PipelineTuner` callback
during training, or by :func:`run_ingestion` for ingestion-only runs). It closes a window once it lasted
``window_s`` seconds and ``min_batches`` batches, asks the tuner for a decision, and applies it through
:meth:`PipelinedLoader.reconfigure` (the pipeline is rebuilt at the current sample position before the next
batch, so nothing is lost or repeated). The first ``settle_batches`` batches after a change are left out of
the next window (they carry the rebuild).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_dlrover.data.staged import PipelineConfig, PipelinedLoader
from lightning_dlrover.pipeline_tuner.agent import Decision
from lightning_dlrover.pipeline_tuner.observe import Observation, Sampler


@dataclass(frozen=True)
class TracePoint:
    """A closed window: when it ended (seconds since the start), what ran, what it delivered, what came next."""

    t: float
    config: PipelineConfig
    samples_per_s: float
    memory_bytes: int
    wait_fraction: float
    utilisation: dict[str, float]
    next_config: PipelineConfig | None
    reason: str
    predicted_memory: int


@dataclass
class Trace:
    """Everything a tuner did in one run."""

    tuner: str
    points: list[TracePoint] = field(default_factory=list)
    samples: int = 0
    seconds: float = 0.0
    peak_memory: int = 0
    resets: int = 0
    reset_s: float = 0.0
    final: PipelineConfig | None = None

    @property
    def overall_samples_per_s(self) -> float:
        """Samples delivered over the whole run, tuning and resets included."""
        return self.samples / self.seconds if self.seconds else 0.0

    def final_samples_per_s(self, windows: int = 3) -> float:
        """Mean of the last ``windows`` windows that ran the final configuration (steady state); if it never ran a
        whole window, of the last ``windows`` windows."""
        last = [p.samples_per_s for p in self.points if p.config == self.final][-windows:]
        last = last or [p.samples_per_s for p in self.points][-windows:]
        return sum(last) / len(last) if last else 0.0

    def time_to(self, samples_per_s: float) -> float | None:
        """End of the first window that delivered at least ``samples_per_s``, or ``None``."""
        return next((p.t for p in self.points if p.samples_per_s >= samples_per_s), None)

    def start_samples_per_s(self) -> float:
        return self.points[0].samples_per_s if self.points else 0.0


class TunerDriver:
    """Runs a tuner's windows and decisions from a consumer loop (see the module docstring).

    Args:
        loader: the pipelined loader the consumer iterates.
        tuner: an :class:`~lightning_dlrover.pipeline_tuner.agent.RLTuner` or a baseline.
        window_s, min_batches: a window closes after both.
        settle_batches: batches after a change left out of the next window.
        on_decision: called with every :class:`Decision` (for events and logs).
        joint: one of several ranks deciding together: :meth:`after_batch` only measures; the windows close at the
            ranks' meetings (:meth:`window`, :meth:`closes`, :meth:`apply`).
    """

    def __init__(self, loader: PipelinedLoader, tuner: Any, window_s: float = 2.0, min_batches: int = 3,
                 settle_batches: int = 1, on_decision: Callable[[Decision], None] | None = None,
                 joint: bool = False) -> None:
        self.loader, self.tuner, self.joint = loader, tuner, joint
        self.window_s, self.min_batches, self.settle_batches = window_s, min_batches, settle_batches
        self.on_decision = on_decision
        self.sampler = Sampler(loader)
        self.trace = Trace(tuner.name)
        self._t0 = time.perf_counter()
        self._settle = settle_batches
        self._batches0 = loader.stats.batches
        self._samples0 = loader.stats.samples
        loader.reconfigure(tuner.first())

    def use_tuner(self, tuner: Any) -> None:
        """Continues with ``tuner`` (e.g. one given a new budget): its first configuration applies from the next
        batches; the trace goes on."""
        self.tuner = tuner
        self.loader.reconfigure(tuner.first())
        self._settle = self.settle_batches

    def after_batch(self) -> Decision | None:
        """Call after each batch the consumer took; returns the decision if a window closed. A ``joint`` driver
        only measures here: the ranks close windows together (:mod:`~lightning_dlrover.pipeline_tuner.joint`)."""
        if self._settle > 0:
            self._settle -= 1
            if self._settle == 0:
                self.sampler.restart()
            return None
        self.sampler.poll()
        if self.joint:
            return None
        if not self.closes(self.sampler.elapsed(), self.loader.stats.batches - self.sampler._stats0.batches):
            return None
        obs = self.sampler.observe()
        decision = self.tuner.step(obs, self.sampler.worker_bytes)
        self.apply(obs, decision)
        return decision

    def closes(self, seconds: float, batches: int) -> bool:
        """Whether a window of ``seconds`` and ``batches`` is complete (3x longer once the tuner is done)."""
        return seconds >= self.window_s * (3 if self.tuner.done else 1) and batches >= self.min_batches

    def window(self) -> tuple[Observation, list[int], int] | None:
        """This rank's window so far (observation, worker processes' bytes, batches), ``None`` while the batches
        after a change settle."""
        if self._settle > 0:
            return None
        batches = self.loader.stats.batches - self.sampler._stats0.batches
        return self.sampler.observe(), list(self.sampler.worker_bytes), batches

    def apply(self, obs: Observation, decision: Decision) -> None:
        """Records the closed window ``obs`` and applies ``decision`` (a new window starts)."""
        self.trace.points.append(TracePoint(time.perf_counter() - self._t0, obs.config, obs.samples_per_s,
                                            obs.memory_bytes, obs.wait_fraction, obs.utilisation, decision.config,
                                            decision.reason, decision.predicted_memory))
        if self.on_decision is not None:
            self.on_decision(decision)
        if decision.config is not None and decision.config != self.loader.config:
            self.loader.reconfigure(decision.config)
            self._settle = self.settle_batches
        else:
            self.sampler.restart()

    def finish(self) -> Trace:
        """The trace so far, with totals."""
        trace, stats = self.trace, self.loader.stats
        trace.samples = stats.samples - self._samples0
        trace.seconds = time.perf_counter() - self._t0
        trace.peak_memory = self.sampler.peak_memory
        trace.resets, trace.reset_s = stats.resets, stats.reset_s
        trace.final = self.loader.config
        return trace


def run_ingestion(loader: PipelinedLoader, tuner: Any, duration_s: float, window_s: float = 2.0,
                  consume: Callable[[Any], None] | None = None, stop_when_done: bool = False,
                  min_batches: int = 3) -> Trace:
    """Iterates ``loader`` (epoch after epoch) for ``duration_s`` seconds under ``tuner``; ``consume`` is called
    on every batch (e.g. a training step; default: nothing, ingestion only)."""
    driver = TunerDriver(loader, tuner, window_s=window_s, min_batches=min_batches)
    start = time.perf_counter()
    try:
        while time.perf_counter() - start < duration_s:
            for batch in loader:
                if consume is not None:
                    consume(batch)
                driver.after_batch()
                if time.perf_counter() - start >= duration_s or (stop_when_done and tuner.done):
                    break
            else:
                loader.load_state_dict({"next_sample": 0})
                continue
            break
    finally:
        loader.close()
    return driver.finish()
