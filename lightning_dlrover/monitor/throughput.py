"""Training throughput and step-time breakdown per rank, for people and for the resource advisor.

:class:`ThroughputMonitor` is a Lightning callback that times every training step from Lightning's
own hooks and splits it into sections:

- ``data_wait``: previous ``on_train_batch_end`` to ``on_train_batch_start``: fetching the batch from
  the loader and moving it to the device (plus anything else that runs between steps, such as
  checkpoint saving; validation runs are excluded).
- ``forward``: ``on_train_batch_start`` to ``on_before_backward``.
- ``backward``: ``on_before_backward`` to ``on_after_backward``. With TorchRec's fused in-backward
  optimizers this includes the embedding update and its all-to-all.
- ``optimizer``: ``on_after_backward`` to ``on_train_batch_end``: the dense optimizer step and the
  communication left after backward.

A strategy adds its own sections (e.g. ``parity``) by exposing a :class:`StepTimer` as
``strategy.step_timer``. Strategy sections timed inside a step overlap the built-in ones and are reported
alongside; those timed between steps (``DLRoverStrategy`` commits a step once it is over: ``parity``) are
taken out of the next step's ``data_wait`` and reported with that step.
"""

from __future__ import annotations

import sys
import time
from array import array
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_dlrover.monitor.steps import StepRecord, rss_bytes, thread_busy_seconds

try:
    import resource
except ImportError:  # Windows
    resource = None

BUILTIN_SECTIONS = ("data_wait", "forward", "backward", "optimizer")
_MB = 1024 * 1024


class StepTimer:
    """Accumulates wall-clock seconds per named section within the current training step.

    A strategy owns one as ``self.step_timer`` and wraps its own work::

        with self.step_timer.section("parity"):
            ...

    :class:`ThroughputMonitor` takes the step's sections with :meth:`pop_step` at every training batch
    end. A section entered several times in one step accumulates.

    Args:
        cuda_sync: synchronise the current CUDA device when a section starts and ends, so that the
            section measures the kernels it launched rather than their launch.
    """

    def __init__(self, cuda_sync: bool = False) -> None:
        self.cuda_sync = cuda_sync
        self._seconds: dict[str, float] = {}

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time the enclosed block and add it to section ``name`` of the current step."""
        if name in BUILTIN_SECTIONS:
            raise ValueError(f"Section name {name!r} is reserved for ThroughputMonitor's own sections")
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def pop_step(self) -> dict[str, float]:
        """Return the seconds per section accumulated since the last call, and start afresh."""
        seconds, self._seconds = self._seconds, {}
        return seconds

    def _sync(self) -> None:
        if self.cuda_sync and torch.cuda.is_available():
            torch.cuda.synchronize()


@dataclass(frozen=True)
class RankThroughput:
    """One rank's measurements over the training steps after warm-up.

    Attributes:
        rank: global rank.
        steps: training steps measured.
        samples: samples those steps consumed.
        samples_per_sec: ``samples`` divided by the summed step time.
        step_ms_mean: mean step time (data wait included), milliseconds.
        step_ms_p50: median step time, milliseconds.
        step_ms_p90: 90th percentile step time, milliseconds.
        sections_ms: mean milliseconds per step of each section that was observed, i.e. the section's
            total time divided by ``steps``; sections the monitor could not see are absent.
        cpu_percent: CPU time of the trainer process (not its DataLoader workers) over wall time,
            in percent of one core.
        rss_bytes: resident set size at the end of training.
        peak_rss_bytes: peak resident set size of the process.
        cuda_max_allocated_bytes: ``torch.cuda.max_memory_allocated`` on CUDA, else ``None``.
    """

    rank: int
    steps: int
    samples: int
    samples_per_sec: float
    step_ms_mean: float
    step_ms_p50: float
    step_ms_p90: float
    sections_ms: dict[str, float]
    cpu_percent: float
    rss_bytes: int
    peak_rss_bytes: int
    cuda_max_allocated_bytes: int | None

    def section_share(self, name: str) -> float | None:
        """Fraction of the mean step time spent in section ``name``, or ``None`` if not observed."""
        if name not in self.sections_ms:
            return None
        return self.sections_ms[name] / self.step_ms_mean


@dataclass(frozen=True)
class ThroughputSummary:
    """Measurements of all ranks after a fit, as :attr:`ThroughputMonitor.summary_stats` exposes them.

    Attributes:
        ranks: one entry per rank, ordered by rank.
        warmup_steps: leading steps per rank left out of the statistics.
    """

    ranks: tuple[RankThroughput, ...]
    warmup_steps: int

    @property
    def samples_per_sec(self) -> float:
        """Global throughput: the sum of the ranks' samples per second."""
        return sum(r.samples_per_sec for r in self.ranks)

    @property
    def sections(self) -> list[str]:
        """Names of the sections observed on any rank, built-in sections first."""
        seen = [s for s in BUILTIN_SECTIONS if any(s in r.sections_ms for r in self.ranks)]
        for r in self.ranks:
            seen += [s for s in r.sections_ms if s not in seen]
        return seen

    def format_table(self) -> str:
        """Render one row per rank plus a global row as a fixed-width text table."""
        sections = self.sections
        cuda = any(r.cuda_max_allocated_bytes is not None for r in self.ranks)
        header = ["rank", "samples/s", "step ms", "p50 ms", "p90 ms"]
        header += [f"{s} ms (%)" for s in sections] + ["cpu %", "peak rss MB"]
        header += ["cuda max MB"] if cuda else []
        rows = [header]
        for r in self.ranks:
            row = [str(r.rank), f"{r.samples_per_sec:.1f}", f"{r.step_ms_mean:.2f}"]
            row += [f"{r.step_ms_p50:.2f}", f"{r.step_ms_p90:.2f}"]
            row += [_section_cell(r, s) for s in sections]
            row += [f"{r.cpu_percent:.0f}", f"{r.peak_rss_bytes / _MB:.0f}"]
            if cuda:
                row += ["-" if r.cuda_max_allocated_bytes is None else f"{r.cuda_max_allocated_bytes / _MB:.0f}"]
            rows.append(row)
        total = ["all", f"{self.samples_per_sec:.1f}"] + ["-"] * (3 + len(sections))
        total += [f"{sum(r.cpu_percent for r in self.ranks):.0f}"]
        total += [f"{sum(r.peak_rss_bytes for r in self.ranks) / _MB:.0f}"]
        total += ["-"] if cuda else []
        rows.append(total)
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        title = f"Throughput over {self.ranks[0].steps} steps per rank (after {self.warmup_steps} warm-up steps)"
        return "\n".join([title, *lines])


def _section_cell(stats: RankThroughput, name: str) -> str:
    share = stats.section_share(name)
    return "-" if share is None else f"{stats.sections_ms[name]:.2f} ({100 * share:.0f}%)"


@dataclass
class _Totals:
    """Sums over a run of steps, with the process CPU time and wall clock at its start."""

    process: psutil.Process
    steps: int = 0
    samples: int = 0
    seconds: float = 0.0
    sections: dict[str, float] = field(default_factory=dict)
    cpu_start: float = field(init=False)
    wall_start: float = field(init=False)

    def __post_init__(self) -> None:
        self.cpu_start = _cpu_seconds(self.process)
        self.wall_start = time.perf_counter()

    def add(self, seconds: float, sections: Mapping[str, float], samples: int) -> None:
        """Add one step."""
        self.steps += 1
        self.samples += samples
        self.seconds += seconds
        for name, value in sections.items():
            self.sections[name] = self.sections.get(name, 0.0) + value

    def samples_per_sec(self) -> float:
        """Samples divided by the summed step time."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def cpu_percent(self) -> float:
        """Process CPU time since the start over wall time since the start, in percent of one core."""
        wall = time.perf_counter() - self.wall_start
        return 100.0 * (_cpu_seconds(self.process) - self.cpu_start) / wall if wall > 0 else 0.0


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _memory_bytes(process: psutil.Process) -> tuple[int, int]:
    """Current and peak resident set size of ``process`` (the current process)."""
    info = process.memory_info()
    peak = getattr(info, "peak_wset", info.rss)  # Windows reports its own peak
    if resource is not None:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = max(peak, maxrss if sys.platform == "darwin" else maxrss * 1024)  # Linux: KiB
    return info.rss, peak


def _infer_batch_size(batch: Any) -> int | None:
    """Dim 0 of the batch: of a tensor, of ``batch.labels`` (TorchRec ``Batch``), or of the first tensor
    found depth-first in a mapping or sequence; ``None`` if there is none."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    labels = getattr(batch, "labels", None)
    if isinstance(labels, torch.Tensor):
        return _infer_batch_size(labels)
    if isinstance(batch, Mapping):
        items = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return None
    for item in items:
        size = _infer_batch_size(item)
        if size is not None:
            return size
    return None


class ThroughputMonitor(Callback):
    """Measure samples per second and the step-time breakdown of training, per rank and globally.

    Every ``log_every_n_steps`` training steps, rank 0 sends to ``trainer.loggers``:
    ``throughput/samples_per_sec`` (summed over ranks), ``throughput/rank_samples_per_sec``,
    ``time/step_ms``, ``time/<section>_ms`` for each observed section (see the module docstring),
    ``system/cpu_percent``, ``system/rss_mb``, ``system/peak_rss_mb`` and, on CUDA,
    ``system/cuda_max_allocated_mb``; rank 0's values except for the global throughput, averaged over
    the steps since the previous log. Every rank's latest step is :attr:`last_step` (a
    :class:`~lightning_dlrover.monitor.steps.StepRecord`). At the end of training the per-rank statistics after warm-up are
    gathered into :attr:`summary_stats` on every rank and, if ``summary`` is set, printed on rank 0 as
    a table.

    The only collectives are one all-reduce per logging step and one gather at the end of training,
    issued by all ranks at the same steps; none when the world size is 1.

    Example::

        trainer = Trainer(callbacks=[ThroughputMonitor(log_every_n_steps=50)])

    Args:
        log_every_n_steps: training steps between two logs.
        warmup_steps: leading training steps left out of :attr:`summary_stats` (lazy initialisation,
            loader start-up).
        summary: print the summary table on rank 0 when training ends.
        batch_size_fn: returns the number of samples in a batch; by default dim 0 of the batch's labels
            (TorchRec ``Batch``), of the batch if it is a tensor, or of its first tensor.
        cuda_sync: on CUDA, synchronise the device at section boundaries so that sections measure
            kernel execution rather than launch; costs some throughput.
    """

    def __init__(
        self,
        log_every_n_steps: int = 10,
        warmup_steps: int = 5,
        summary: bool = True,
        batch_size_fn: Callable[[Any], int] | None = None,
        cuda_sync: bool = False,
    ) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be at least 1, got {log_every_n_steps}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be non-negative, got {warmup_steps}")
        self.log_every_n_steps = log_every_n_steps
        self.warmup_steps = warmup_steps
        self.summary = summary
        self.batch_size_fn = batch_size_fn
        self.cuda_sync = cuda_sync
        self._summary_stats: ThroughputSummary | None = None
        self._sync = False
        self._mark = 0.0
        self._sections: dict[str, float] | None = None
        self._between: dict[str, float] = {}  # strategy sections timed since the last step ended
        self.last_step: StepRecord | None = None  # this rank's latest step, for ResourceAdvisor

    @property
    def summary_stats(self) -> ThroughputSummary | None:
        """Statistics of the last fit on all ranks, or ``None`` before training ended or if it ran no
        more than ``warmup_steps`` steps."""
        return self._summary_stats

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Reset all measurements."""
        self._process = psutil.Process()
        self._device = pl_module.device
        self._sync = self.cuda_sync and self._device.type == "cuda"
        self._steps = 0
        self._window = _Totals(self._process)
        self._measured = _Totals(self._process) if self.warmup_steps == 0 else None
        self._step_seconds = array("d")
        self._sections = None
        self._summary_stats = None
        self.last_step = None
        self._mark = self._now()
        self._busy_mark = thread_busy_seconds()
        if (timer := self._step_timer(trainer)) is not None:
            timer.pop_step()  # drop sections timed during set-up

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Start the first step's data wait here, not at the end of the previous epoch."""
        self._mark = self._now()
        self._busy_mark = thread_busy_seconds()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Keep validation inside the training loop out of the next step's data wait."""
        self._mark = self._now()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Close the data wait and open the forward section."""
        now = self._now()
        self._step_start = self._mark
        timer = self._step_timer(trainer)
        self._between = timer.pop_step() if timer is not None else {}  # e.g. the commit of the previous step
        self._sections = {"data_wait": max(0.0, now - self._mark - sum(self._between.values()))}
        self._after_backward = False
        self._mark = now
        self._start_time, self._busy_start = time.time(), thread_busy_seconds()
        self._data_busy = self._busy_start - self._busy_mark

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        """Close a forward section."""
        self._close("forward")

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Close a backward section."""
        self._close("backward")
        self._after_backward = True

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Close the optimizer section (if a backward was seen), record the step and log if due."""
        if self._sections is None:
            return
        now = self._now()
        sections, self._sections = self._sections, None
        if self._after_backward:
            sections["optimizer"] = now - self._mark
        self._mark = now
        if (timer := self._step_timer(trainer)) is not None:
            sections.update(timer.pop_step())
        for name, value in self._between.items():
            sections[name] = sections.get(name, 0.0) + value
        seconds = now - self._step_start
        samples = self._batch_size(batch)
        self._steps += 1
        self._busy_mark = thread_busy_seconds()
        self.last_step = StepRecord(self._steps, self._start_time, seconds, samples, sections,
                                    self._busy_mark - self._busy_start, rss_bytes(), self._data_busy)
        self._window.add(seconds, sections, samples)
        if self._measured is not None:
            self._measured.add(seconds, sections, samples)
            self._step_seconds.append(seconds)
        elif self._steps == self.warmup_steps:
            self._measured = _Totals(self._process)
        if self._steps % self.log_every_n_steps == 0:
            self._log(trainer)
            self._window = _Totals(self._process)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Gather the per-rank statistics from all ranks into :attr:`summary_stats`."""
        local = self._rank_summary(trainer.global_rank)
        if trainer.world_size > 1:
            ranks: list[RankThroughput | None] = [None] * trainer.world_size
            torch.distributed.all_gather_object(ranks, local)
        else:
            ranks = [local]
        if any(r is None for r in ranks):
            rank_zero_warn(
                f"ThroughputMonitor: training ran no more than warmup_steps={self.warmup_steps} steps;"
                " no summary."
            )
            return
        self._summary_stats = ThroughputSummary(ranks=tuple(ranks), warmup_steps=self.warmup_steps)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Print the summary table on rank 0, once the progress bars are closed."""
        if self.summary and self._summary_stats is not None and trainer.is_global_zero:
            print(self._summary_stats.format_table())

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def _close(self, section: str) -> None:
        """Add the time since the last boundary to ``section`` of the current step."""
        if self._sections is None:  # a backward outside a training step
            return
        now = self._now()
        self._sections[section] = self._sections.get(section, 0.0) + now - self._mark
        self._mark = now

    @staticmethod
    def _step_timer(trainer: Trainer) -> StepTimer | None:
        timer = getattr(trainer.strategy, "step_timer", None)
        return timer if isinstance(timer, StepTimer) else None

    def _batch_size(self, batch: Any) -> int:
        size = self.batch_size_fn(batch) if self.batch_size_fn is not None else _infer_batch_size(batch)
        if size is None:
            raise ValueError(
                f"ThroughputMonitor cannot find the batch size of a {type(batch).__name__};"
                " pass batch_size_fn=..."
            )
        return int(size)

    def _log(self, trainer: Trainer) -> None:
        """Reduce the window's throughput over ranks and send rank 0's window metrics to the loggers."""
        window = self._window
        local = window.samples_per_sec()
        total = local
        if trainer.world_size > 1:
            value = torch.tensor(local, dtype=torch.float64, device=trainer.strategy.root_device)
            total = trainer.strategy.reduce(value, reduce_op="sum").item()
        if not trainer.is_global_zero:
            return
        rss, peak = _memory_bytes(self._process)
        metrics = {
            "throughput/samples_per_sec": total,
            "throughput/rank_samples_per_sec": local,
            "time/step_ms": 1000 * window.seconds / window.steps,
            **{f"time/{name}_ms": 1000 * value / window.steps for name, value in window.sections.items()},
            "system/cpu_percent": window.cpu_percent(),
            "system/rss_mb": rss / _MB,
            "system/peak_rss_mb": peak / _MB,
        }
        if self._device.type == "cuda":
            metrics["system/cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(self._device) / _MB
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _rank_summary(self, rank: int) -> RankThroughput | None:
        """This rank's statistics after warm-up, or ``None`` if no step was measured."""
        measured = self._measured
        if measured is None or measured.steps == 0:
            return None
        rss, peak = _memory_bytes(self._process)
        p50, p90 = np.percentile(np.frombuffer(self._step_seconds, dtype=np.float64), [50, 90])
        cuda = torch.cuda.max_memory_allocated(self._device) if self._device.type == "cuda" else None
        return RankThroughput(
            rank=rank,
            steps=measured.steps,
            samples=measured.samples,
            samples_per_sec=measured.samples_per_sec(),
            step_ms_mean=1000 * measured.seconds / measured.steps,
            step_ms_p50=1000 * float(p50),
            step_ms_p90=1000 * float(p90),
            sections_ms={name: 1000 * value / measured.steps for name, value in measured.sections.items()},
            cpu_percent=measured.cpu_percent(),
            rss_bytes=rss,
            peak_rss_bytes=peak,
            cuda_max_allocated_bytes=cuda,
        )
