"""Training throughput and step-time breakdown per rank, for people and for the resource advisor.

:class:`ThroughputMonitor` is a Lightning callback that times every training step from Lightning's
own hooks and splits it into sections:

- ``data_wait``: previous ``on_train_batch_end`` to ``on_train_batch_start``: fetching the batch from
  the loader and moving it to the device (plus anything else that runs between steps, such as
  checkpoint saving; validation runs are excluded). An add-on's own work marked with
  :func:`~lightning_dlrover.monitor.collectives.add_on_work` (the resource advisor's) is left out of the step
  it runs in (:attr:`StepRecord.add_on_seconds <lightning_dlrover.monitor.steps.StepRecord>`).
- ``forward``: ``on_train_batch_start`` to ``on_before_backward``.
- ``backward``: ``on_before_backward`` to ``on_after_backward``. With TorchRec's fused in-backward
  optimizers this includes the embedding update and its all-to-all.
- ``optimizer``: ``on_after_backward`` to ``on_train_batch_end``: the dense optimizer step and the
  communication left after backward.

A strategy adds its own sections (e.g. ``parity``) by exposing a :class:`StepTimer` as
``strategy.step_timer``. Strategy sections timed inside a step overlap the built-in ones and are reported
alongside; those timed between steps (``DLRoverStrategy`` commits a step once it is over: ``parity``) are
taken out of the next step's ``data_wait`` and reported with that step.

A failure inside the monitor never ends the fit (:mod:`~lightning_dlrover.monitor.guard`): it is reported once (an
``addon_failed`` event and a warning) and the rank stops measuring; it still joins the monitor's collectives (the
periodic all-reduce, the gather at the end), with nothing measured, so the other ranks go on.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_dlrover.log import get_logger, rank_zero_report
from lightning_dlrover.monitor.collectives import collective_seconds, installed, pop_add_on_work
from lightning_dlrover.monitor.guard import failure, guarded
from lightning_dlrover.monitor.steps import StepRecord, rss_bytes, thread_busy_seconds
from lightning_dlrover.monitor.summary import _MB, RankThroughput, ThroughputSummary, _memory_bytes, _Totals
from lightning_dlrover.monitor.timing import BUILTIN_SECTIONS, StepTimer, _infer_batch_size

log = get_logger(__name__)

__all__ = ["BUILTIN_SECTIONS", "RankThroughput", "StepTimer", "ThroughputMonitor", "ThroughputSummary"]


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
        self._ticks = 0  # training steps of this fit, counted even after a failure (the all-reduce's schedule)

    @property
    def summary_stats(self) -> ThroughputSummary | None:
        """Statistics of the last fit on all ranks, or ``None`` before training ended or if it ran no
        more than ``warmup_steps`` steps."""
        return self._summary_stats

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Reset all measurements."""
        self._ticks = 0
        self._start(trainer, pl_module)

    @guarded("on_train_start")
    def _start(self, trainer: Trainer, pl_module: LightningModule) -> None:
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

    @guarded
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Start the first step's data wait here, not at the end of the previous epoch."""
        self._mark = self._now()
        self._busy_mark = thread_busy_seconds()

    @guarded
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Keep validation inside the training loop out of the next step's data wait."""
        self._mark = self._now()

    @guarded
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Close the data wait and open the forward section."""
        now = self._now()
        self._step_start = self._mark
        timer = self._step_timer(trainer)
        self._between = timer.pop_step() if timer is not None else {}  # e.g. the commit of the previous step
        add_on = pop_add_on_work()  # an add-on's work since the last step ended (e.g. the advisor's fit)
        self._add_on = add_on
        self._sections = {"data_wait": max(0.0, now - self._mark - sum(self._between.values()) - add_on.wall)}
        self._after_backward = False
        self._mark = now
        self._start_time, self._busy_start = time.time(), thread_busy_seconds()
        self._data_busy = max(0.0, self._busy_start - self._busy_mark - add_on.busy)

    @guarded
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        """Close a forward section."""
        self._close("forward")

    @guarded
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Close a backward section."""
        self._close("backward")
        self._after_backward = True

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Close the optimizer section (if a backward was seen), record the step and log if due."""
        self._ticks += 1
        self._record(trainer, batch)
        if self._ticks % self.log_every_n_steps == 0:
            self._log(trainer)

    @guarded("on_train_batch_end")
    def _record(self, trainer: Trainer, batch: Any) -> None:
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
        start, inside = self._add_on, pop_add_on_work()  # add-on work before and inside the step
        waited = collective_seconds(self._step_start, now) if installed() else 0.0
        self.last_step = StepRecord(
            self._steps, self._start_time, max(0.0, seconds - start.wall - inside.wall), samples, sections,
            max(0.0, self._busy_mark - self._busy_start - inside.busy), rss_bytes(), self._data_busy,
            max(0.0, waited - start.collective - inside.collective), start.wall + inside.wall)
        self._window.add(seconds, sections, samples)
        if self._measured is not None:
            self._measured.add(seconds, sections, samples)
            self._step_seconds.append(seconds)
        elif self._steps == self.warmup_steps:
            self._measured = _Totals(self._process)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Gather the per-rank statistics from all ranks into :attr:`summary_stats`."""
        local = self._rank_summary(trainer.global_rank)
        if trainer.world_size > 1:
            ranks: list[RankThroughput | str | None] = [None] * trainer.world_size
            torch.distributed.all_gather_object(ranks, local if failure(self) is None else "failed")
        else:
            ranks = [local if failure(self) is None else "failed"]
        if "failed" in ranks:
            rank_zero_warn(f"ThroughputMonitor: failed on rank(s) {[i for i, r in enumerate(ranks) if r == 'failed']}; "
                           "no summary.")
            return
        if any(r is None for r in ranks):
            rank_zero_warn(
                f"ThroughputMonitor: training ran no more than warmup_steps={self.warmup_steps} steps;"
                " no summary."
            )
            return
        self._summary_stats = ThroughputSummary(ranks=tuple(ranks), warmup_steps=self.warmup_steps)

    @guarded
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Print the summary table on rank 0, once the progress bars are closed."""
        if self.summary and self._summary_stats is not None and trainer.is_global_zero:
            rank_zero_report(log, self._summary_stats.format_table())

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
        """Reduce the window's throughput over ranks (every rank joins, a failed one with nothing measured) and send
        rank 0's window metrics to the loggers."""
        local = self._window_rate(trainer)
        total = local or 0.0
        if trainer.world_size > 1:
            value = torch.tensor(total, dtype=torch.float64, device=trainer.strategy.root_device)
            total = trainer.strategy.reduce(value, reduce_op="sum").item()
        if local is not None:
            self._send(trainer, local, total)

    @guarded("on_train_batch_end")
    def _window_rate(self, trainer: Trainer) -> float:
        return self._window.samples_per_sec()

    @guarded("on_train_batch_end")
    def _send(self, trainer: Trainer, local: float, total: float) -> None:
        window, self._window = self._window, _Totals(self._process)
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

    @guarded("on_train_end")
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
