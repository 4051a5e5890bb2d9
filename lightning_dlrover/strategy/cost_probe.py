"""``parity: auto`` measures the job itself: :class:`CostProbe`, on rank 0, times a few of the run's first steps (wall
and whole-process CPU, from one step's end to the next: the forward, backward, optimizer, parity's undo log and
commit, the data loading) and records them in the job history (``$LIGHTNING_DLROVER_HISTORY``) under the job's key
and the parity it ran with (:func:`lightning_dlrover.planner.records.step_name`). The next run of the job plans with
them (:func:`lightning_dlrover.planner.records.costs_from_records`): its own step time, and parity's per-step share
once runs with and without parity (or at two commit intervals) were recorded. This run keeps the parity it started
with: its spills and parity are written with it.

It also measures the job's saves: the time each of the first :data:`SAVES` saves blocked training (the strategy's
``Checkpointing.last_blocked_s``, which its ``checkpoint_saved`` event reports) and, from those events (rank 0's,
this process's), the time until the save was committed; their means over the saves seen so far are recorded under
the job's save mode (:func:`lightning_dlrover.planner.records.save_names`), and the next run's plan takes its
checkpoint interval from them. This run keeps the interval it planned (every rank must save at the same steps).

An add-on: it reports once and steps back, and never ends a run (a history it cannot write is a warning).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import lightning.pytorch as pl

from lightning_dlrover.log import get_logger
from lightning_dlrover.monitor import emit
from lightning_dlrover.monitor.events import events_path
from lightning_dlrover.planner.records import record_costs, save_names, step_name

log = get_logger(__name__)


#: Saves whose costs are measured and recorded (an incremental chain's full link and deltas; an asynchronous
#: job's first save also allocates its staging memory, which later ones reuse).
SAVES = 8


class CostProbe(pl.Callback):
    """Times steps ``skip + 1 .. skip + steps`` of the run (medians: a checkpoint save among them does not count)
    and records them in ``history`` for ``job_key`` (``parity``: the ``(k, r, N)`` the run trains with, or ``None``);
    and the first :data:`SAVES` saves' blocked and commit times under ``save_mode``."""

    def __init__(self, history: str, job_key: str, parity: tuple[int, int, int] | None, skip: int = 2,
                 steps: int = 5, save_mode: str = "blocking") -> None:
        self.history, self.job_key, self.parity = history, job_key, parity
        self.skip, self.steps, self.save_mode = skip, steps, save_mode
        self._ends: list[tuple[float, float]] = []
        self.done = False
        self._saving = False  # a save began since the last batch end
        self._blocked: list[float] = []
        self._lags: dict[str, float] = {}  # path -> write_s - blocked_s of this process's checkpoint_saved events
        self._offset = 0  # of the events file, read so far

    def on_save_checkpoint(self, *_: Any) -> None:
        self._saving = True

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        self._saves(trainer)
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

    def _saves(self, trainer: pl.Trainer) -> None:
        """Records the blocked and commit times of the saves made since the last batch end (the first ``SAVES``)."""
        if len(self._blocked) >= SAVES and len(self._lags) >= min(SAVES, len(self._blocked)):
            return
        new = False
        if self._saving and len(self._blocked) < SAVES:
            self._saving, new = False, True
            self._blocked.append(trainer.strategy.checkpointing.last_blocked_s)
        new |= self._read_events()
        if not new or not self._blocked:
            return
        blocked_name, lag_name = save_names(self.save_mode)
        values = {blocked_name: statistics.mean(self._blocked)}
        if self._lags:
            values[lag_name] = statistics.mean(list(self._lags.values())[:SAVES])
        elif self.save_mode in ("blocking", "incremental"):
            values[lag_name] = 0.0  # committed when the save returns
        try:
            record_costs(self.history, self.job_key, values)
        except Exception as err:  # noqa: BLE001 - an add-on never ends a run
            log.warning(f"parity: auto could not record the job's measured saves in {self.history}: {err}")
            return
        first = len(self._blocked) == 1 and len(self._lags) <= 1
        emit("costs_measured", job_key=self.job_key, costs={k: round(v, 6) for k, v in values.items()},
             message=(f"parity: auto measured the job's first {self.save_mode} save: training blocked "
                      f"{values[blocked_name]:.3f} s; recorded for the next run's checkpoint interval")
             if first else None)

    def _read_events(self) -> bool:
        """Reads this process's new ``checkpoint_saved`` events; whether there were any."""
        path = events_path()
        if path is None or not path.is_file():
            return False
        with path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        found = False
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("kind") == "checkpoint_saved" and record.get("pid") == os.getpid() and \
                    record.get("write_s") is not None:
                self._lags[record.get("path")] = max(record["write_s"] - (record.get("blocked_s") or 0.0), 0.0)
                found = True
        return found
