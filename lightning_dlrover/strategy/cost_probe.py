"""``parity: auto`` measures the job itself: :class:`CostProbe`, on rank 0, times a few of the run's first steps (wall
and whole-process CPU, from one step's end to the next: the forward, backward, optimizer, parity's undo log and
commit, the data loading) and records them in the job history (``$LIGHTNING_DLROVER_HISTORY``) under the job's key
and the parity it ran with (:func:`lightning_dlrover.planner.records.step_name`). The next run of the job plans with
them (:func:`lightning_dlrover.planner.records.costs_from_records`): its own step time, and parity's per-step share
once runs with and without parity (or at two commit intervals) were recorded. This run keeps the parity it started
with: its spills and parity are written with it.

An add-on: it reports once and steps back, and never ends a run (a history it cannot write is a warning).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning.pytorch as pl

from lightning_dlrover.log import get_logger
from lightning_dlrover.monitor import emit
from lightning_dlrover.planner.records import record_costs, step_name

log = get_logger(__name__)


class CostProbe(pl.Callback):
    """Times steps ``skip + 1 .. skip + steps`` of the run (medians: a checkpoint save among them does not count)
    and records them in ``history`` for ``job_key`` (``parity``: the ``(k, r, N)`` the run trains with, or ``None``)."""

    def __init__(self, history: str, job_key: str, parity: tuple[int, int, int] | None, skip: int = 2,
                 steps: int = 5) -> None:
        self.history, self.job_key, self.parity = history, job_key, parity
        self.skip, self.steps = skip, steps
        self._ends: list[tuple[float, float]] = []
        self.done = False

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if self.done:
            return
        self._ends.append((time.perf_counter(), time.process_time()))
        if len(self._ends) < self.skip + self.steps + 1:
            return
        self.done = True
        ends = self._ends[self.skip:]
        wall = statistics.median(b[0] - a[0] for a, b in zip(ends, ends[1:]))
        cpu = statistics.median(b[1] - a[1] for a, b in zip(ends, ends[1:]))
        name = step_name(self.parity)
        values = {name: wall, name.replace("step_s", "cpu_s", 1): cpu}
        try:
            record_costs(self.history, self.job_key, values)
        except Exception as err:  # noqa: BLE001 - an add-on never ends a run
            log.warning(f"parity: auto could not record the job's measured step in {self.history}: {err}")
            return
        emit("costs_measured", job_key=self.job_key, costs={k: round(v, 6) for k, v in values.items()},
             message=f"parity: auto measured the job's step: {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU of "
             f"rank 0's process (median of {self.steps} steps"
             + (", parity k={} r={} N={})".format(*self.parity) if self.parity else ", no parity)")
             + "; recorded for the next run's plan")
