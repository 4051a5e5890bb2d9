"""Applying the advisor's live knobs through the components that own them, and seeing them take effect.

Who changes what (:func:`live_controls` finds them among the trainer's callbacks and loader):

- threads per rank: ``torch.set_num_threads`` (nothing else owns them);
- data workers per rank: a callback implementing :class:`~lightning_dlrover.advisor.control.DataWorkersControl`;
  else the :class:`~lightning_dlrover.pipeline_tuner.PipelineTuner`, handed a CPU budget of that many workers per rank
  (it goes on tuning the stages within it, so the two do not fight); else a
  :class:`~lightning_dlrover.data.staged.PipelinedLoader`, reconfigured to that many workers in all;
- per-rank batch: a callback implementing :class:`~lightning_dlrover.advisor.control.BatchSizeControl`, such as the
  :class:`~lightning_dlrover.ElasticBatchScaler` (its nearest global batch in range; learning rates follow its rule).

:class:`LiveApplier` applies a change on every rank, records it as an ``advice_applied`` event, and once the
job's steps show it (threads in use, samples per step, pipeline workers running) an ``advice_in_effect`` event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_dlrover.advisor import control
from lightning_dlrover.monitor import emit

#: Stages that lose workers first when a pipeline gets fewer (they run in the training process), and gain last.
_SHRINK_ORDER = ("read", "assemble", "transform", "parse")
_GROW_ORDER = ("parse", "transform", "read", "assemble")


def with_workers(config: Any, workers: int) -> Any:
    """``config`` (a :class:`~lightning_dlrover.data.staged.PipelineConfig`) with ``workers`` workers in all
    stages together: removed from the in-process stages first, added to parse and transform first."""
    if workers < 0:
        raise ValueError(f"with_workers(workers={workers}): give 0 or more workers.")
    counts = dict(config.workers)
    while sum(counts.values()) > workers:
        stage = next(s for s in _SHRINK_ORDER if counts[s] > 0)
        counts[stage] -= 1
    while sum(counts.values()) < workers:
        stage = min(_GROW_ORDER, key=lambda s: (counts[s], _GROW_ORDER.index(s)))
        counts[stage] += 1
    return config.replace(**counts, prefetch=max(config.prefetch, 1) if workers else config.prefetch)


def _running_within(loader: Any, workers: int) -> bool:
    """Whether ``loader``'s pipeline runs (not merely plans) at most ``workers`` workers."""
    return loader.config.total_workers <= workers and len(loader.worker_pids()) <= workers


class TunerWorkers:
    """``DataWorkersControl`` over a ``PipelineTuner``: a rank's data workers are its pipeline's CPU budget."""

    via = "PipelineTuner.set_budget"
    min_workers = 1  # a pipeline budget has at least one worker

    def __init__(self, tuner: Any, loader: Any) -> None:
        self.tuner, self.loader = tuner, loader

    def get_data_workers(self) -> int:
        return int(self.tuner.budget.cpus)

    def set_data_workers(self, workers: int) -> None:
        self.tuner.set_budget(max(self.min_workers, workers))

    def in_effect(self, workers: int) -> bool:
        return _running_within(self.loader, workers)


class LoaderWorkers:
    """``DataWorkersControl`` over a ``PipelinedLoader`` that no tuner owns: its stages get the workers in all."""

    via = "PipelinedLoader.reconfigure"
    min_workers = 0

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def get_data_workers(self) -> int:
        return int(self.loader.config.total_workers)

    def set_data_workers(self, workers: int) -> None:
        self.loader.reconfigure(with_workers(self.loader.config, workers))

    def in_effect(self, workers: int) -> bool:
        return _running_within(self.loader, workers)


def live_controls(trainer: Any) -> list[Any]:
    """Whatever can change data workers and the per-rank batch in this job: callbacks implementing the control
    protocols first (they win; the ``ElasticBatchScaler`` is one), then adapters over the ``PipelineTuner`` or a
    ``PipelinedLoader``."""
    callbacks = list(trainer.callbacks)
    out = [c for c in callbacks if isinstance(c, (control.DataWorkersControl, control.BatchSizeControl))]
    from lightning_dlrover.pipeline_tuner.callback import PipelineTuner, find_pipelined_loader

    try:
        loader = find_pipelined_loader(trainer)
    except ValueError:  # not the TSV pipeline
        loader = None
    tuner = next((c for c in callbacks if isinstance(c, PipelineTuner)), None)
    if tuner is not None and loader is not None and getattr(tuner, "driver", None) is not None:
        out.append(TunerWorkers(tuner, loader))
    elif loader is not None:
        out.append(LoaderWorkers(loader))
    return out


@dataclass
class _Pending:
    stage: str
    knob: str
    value: int
    applied_step: int


class LiveApplier:
    """Applies live knobs through ``controls`` (:func:`live_controls`) with events (see the module docstring)."""

    def __init__(self, controls: list[Any]) -> None:
        self.controls = controls
        self.pending: list[_Pending] = []

    def _control(self, knob: str) -> Any:
        protocol = control.DataWorkersControl if knob == "data_workers" else control.BatchSizeControl
        return control.find_control(self.controls, protocol)

    def read(self, knob: str) -> int:
        """The knob's value now."""
        if knob == "threads_per_rank":
            return torch.get_num_threads()
        ctl = self._control(knob)
        return ctl.get_data_workers() if knob == "data_workers" else ctl.get_batch_per_rank()

    def apply(self, changes: dict[str, int], step: int, stage: str) -> dict[str, int]:
        """Applies ``changes`` on this rank (every rank at the same step); returns the values in force after it
        (an owner may round, e.g. the batch to its range)."""
        out = {}
        for knob, new in changes.items():
            old = self.read(knob)
            control.apply_live({knob: new}, self.controls)
            out[knob] = now = self.read(knob)
            ctl = None if knob == "threads_per_rank" else self._control(knob)
            via = "torch.set_num_threads" if ctl is None else getattr(ctl, "via", type(ctl).__name__)
            emit("advice_applied", step=step, stage=stage, knob=knob, old=old, new=now, via=via)
            self.pending.append(_Pending(stage, knob, now, step))
        return out

    def check(self, step: int, samples: int | None) -> None:
        """After a step: records ``advice_in_effect`` for each applied change the job now shows (threads in use,
        ``samples`` per rank in this step, data workers running)."""
        for p in list(self.pending):
            if p.knob == "threads_per_rank":
                seen = torch.get_num_threads() == p.value
            elif p.knob == "batch_per_rank":
                seen = samples == p.value
            else:
                ctl = self._control(p.knob)
                seen = ctl.in_effect(p.value) if hasattr(ctl, "in_effect") else ctl.get_data_workers() == p.value
            if seen:
                self.pending.remove(p)
                emit("advice_in_effect", step=step, stage=p.stage, knob=p.knob, value=p.value,
                     applied_step=p.applied_step, steps=step - p.applied_step)
