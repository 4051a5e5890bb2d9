"""``PipelineTuner``: tunes the TSV pipeline's workers per stage and prefetch depth online, while training.

Each rank tunes its own pipeline within its share of the node's cores (the cores left after the training
ranks, divided by the ranks on the node) and a hard memory budget; no collective is needed because the
batches do not depend on the parallelism. Decisions apply between two steps (the pipeline is rebuilt at the
current sample position). Every decision is a ``pipeline_decision`` event; at the end of fit a
``pipeline_tuned`` event, a table (rank 0) and ``<default_root_dir>/pipeline/tuner_rank<r>.png`` and
``trace_rank<r>.json``.

A failure inside the tuner (a hook, a decision, a pipeline rebuild it asked for, its report) never ends the fit
(:mod:`~lightning_dlrover.monitor.guard`): it is reported once (an ``addon_failed`` event and a warning), the
pipeline goes back to the last configuration the tuner completed a step with, and the tuner stops tuning.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_dlrover.data.staged import PipelineConfig, PipelinedLoader
from lightning_dlrover.log import get_logger, rank_zero_report
from lightning_dlrover.monitor import emit
from lightning_dlrover.monitor.guard import guarded
from lightning_dlrover.pipeline_tuner.agent import Decision, RLTuner, shrink
from lightning_dlrover.pipeline_tuner.baselines import FixedTuner, HillClimbTuner
from lightning_dlrover.pipeline_tuner.harness import Trace, TunerDriver
from lightning_dlrover.pipeline_tuner.observe import Budget, MemoryGuard
from lightning_dlrover.pipeline_tuner.report import plot, summary

log = get_logger(__name__)


def find_pipelined_loader(trainer: Trainer) -> PipelinedLoader:
    """The training loader if it is a :class:`PipelinedLoader`; raises with how to get one otherwise."""
    candidates = [getattr(trainer, "train_dataloader", None)]
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and getattr(datamodule, "_train_loader", None) is not None:
        candidates.append(datamodule._train_loader)
    for loader in candidates:
        for inner in (loader, getattr(loader, "iterables", None)):
            if isinstance(inner, PipelinedLoader):
                return inner
    raise ValueError("PipelineTuner needs the training data to come from the TSV pipeline: set data.criteo_paths "
                     "and data.pipeline (e.g. `pipeline: {parse: 1}`) in the DLRMDataModule, or pass a "
                     "lightning_dlrover.data.staged.PipelinedLoader as the train dataloader.")


class PipelineTuner(Callback):
    """Online tuning of the data pipeline (see the module docstring and ``lightning_dlrover.pipeline_tuner.agent``).

    Args:
        tuner: ``rl`` (the Q-learning agent), ``hill_climb`` (tf.data-AUTOTUNE-like) or ``fixed`` (keep ``start``).
        cpus: workers per rank's pipeline (default: cores left after the training ranks, split across them).
        memory_mb: hard pipeline memory budget per rank in MiB (default: a quarter of the available RAM, split).
        max_prefetch: deepest prefetch allowed (batches).
        window_s: seconds per measurement window (at least ``min_batches`` batches).
        min_batches: batches per measurement window, at least.
        start: the first configuration, e.g. ``{read: 1, parse: 1, transform: 1, assemble: 1, prefetch: 2}``
            (default: the pipeline's configuration, ``data.pipeline``). ``rl`` keeps it unless a change beats it
            end to end; ``hill_climb`` always starts from one worker per stage.
        seed: seed of the agent's exploration.
        report_dir: where the PNG and trace go (default ``<default_root_dir>/pipeline``).
    """

    def __init__(self, tuner: Literal["rl", "hill_climb", "fixed"] = "rl", cpus: int | None = None,
                 memory_mb: int | None = None, max_prefetch: int = 8, window_s: float = 2.0, min_batches: int = 3,
                 start: dict[str, int] | None = None, seed: int = 0, report_dir: str | None = None) -> None:
        if tuner not in ("rl", "hill_climb", "fixed"):
            raise ValueError(f"PipelineTuner(tuner={tuner!r}): use 'rl', 'hill_climb' or 'fixed'.")
        if window_s <= 0 or min_batches < 1:
            raise ValueError(f"PipelineTuner: window_s={window_s} must be > 0 and min_batches={min_batches} >= 1.")
        self.tuner_name, self.cpus, self.memory_mb, self.max_prefetch = tuner, cpus, memory_mb, max_prefetch
        self.window_s, self.min_batches, self.seed = window_s, min_batches, seed
        self.start = PipelineConfig(**start) if start else None
        self.report_dir = report_dir
        self.driver: TunerDriver | None = None
        self.trace: Trace | None = None
        self._good: PipelineConfig | None = None  # the pipeline's configuration when the tuner last completed a step

    def _make_tuner(self, budget: Budget, configured: PipelineConfig) -> Any:
        if self.tuner_name == "rl":  # starts from (and keeps, unless a change beats it) the configured pipeline
            return RLTuner(budget, start=self.start or configured, seed=self.seed)
        if self.tuner_name == "hill_climb":
            return HillClimbTuner(budget)
        return FixedTuner(self.start or configured, "fixed")

    @override
    @guarded
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loader = find_pipelined_loader(trainer)
        self._good = loader.config
        memory = self.memory_mb << 20 if self.memory_mb else None
        self.budget = Budget.for_node(max(trainer.num_devices, 1), self.cpus, memory, self.max_prefetch)
        self.tuner = self._make_tuner(self.budget, loader.config)
        self._trainer = trainer
        self.driver = TunerDriver(loader, self.tuner, self.window_s, self.min_batches, on_decision=self._emit)
        rank_zero_info(f"PipelineTuner ({self.tuner_name}): budget {self.budget.cpus} workers and "
                       f"{self.budget.memory_bytes / 2**20:.0f} MiB per rank; starting at {loader.config.short()}")

    def step_back(self) -> str:
        """After a failure: the pipeline goes back to the configuration in use when the tuner last completed a step
        (a change it was making is dropped) and is no longer tuned. Returns that configuration, for the report."""
        driver, self.driver = self.driver, None
        if driver is None or self._good is None:
            return "pipeline unchanged"
        driver.loader.reconfigure(self._good)
        return f"pipeline config {self._good.short()} (the last one completed)"

    def set_budget(self, cpus: int) -> None:
        """Gives each rank's pipeline ``cpus`` workers in all (e.g. from the resource advisor): the tuner starts
        again from the configuration in use, shrunk to the new budget if needed, and tunes within it."""
        if int(cpus) < 1:
            raise ValueError(f"PipelineTuner.set_budget(cpus={cpus}): give at least 1 worker (the pipeline's budget).")
        self.cpus = int(cpus)
        if self.driver is None:  # not training yet (on_train_start uses self.cpus), or stepped back after a failure
            return
        self._set_budget(int(cpus))

    @guarded("set_budget")  # the tuner's own failure: reported and stepped back, never the caller's to handle
    def _set_budget(self, cpus: int) -> None:
        self.budget = dataclasses.replace(self.budget, cpus=int(cpus))
        current = self.driver.loader.config
        guard = MemoryGuard(self.budget)
        within = current if guard.allows(current) else shrink(current, guard)  # the new budget is a hard limit
        if self.tuner_name == "fixed":
            self.tuner = FixedTuner(within)
        elif self.tuner_name == "rl":
            self.tuner = RLTuner(self.budget, start=within, seed=self.seed)
        else:
            self.tuner = HillClimbTuner(self.budget)
        self.driver.use_tuner(self.tuner)
        rank_zero_info(f"PipelineTuner ({self.tuner_name}): budget now {self.budget.cpus} workers per rank; "
                       f"from {current.short()} to {self.tuner.first().short()}")
        self._good = self.tuner.first()

    def _emit(self, decision: Decision) -> None:
        obs = decision.observed
        emit("pipeline_decision", step=self._trainer.global_step, tuner=self.tuner_name, config=obs.config.short(),
             samples_per_s=round(obs.samples_per_s, 1), wait_fraction=round(obs.wait_fraction, 3),
             memory_bytes=obs.memory_bytes, budget_memory_bytes=self.budget.memory_bytes,
             next_config=decision.config.short() if decision.config else None, reason=decision.reason,
             predicted_memory_bytes=decision.predicted_memory)

    @override
    @guarded
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.driver is not None:
            self.driver.after_batch()
            self._good = self.driver.loader.config

    @override
    @guarded
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.driver is None:
            return
        self.trace = trace = self.driver.finish()
        self.driver = None
        first, final = trace.start_samples_per_s(), trace.final_samples_per_s()
        emit("pipeline_tuned", step=trainer.global_step, tuner=self.tuner_name,
             start_config=trace.points[0].config.short() if trace.points else None,
             config=trace.final.short() if trace.final else None, start_samples_per_s=round(first, 1),
             samples_per_s=round(final, 1), gain=round(final / first, 3) if first else None,
             kept_start=getattr(self.tuner, "kept_start", None), windows=len(trace.points), resets=trace.resets,
             peak_memory_bytes=trace.peak_memory, budget_memory_bytes=self.budget.memory_bytes,
             budget_cpus=self.budget.cpus)
        out = Path(self.report_dir or Path(trainer.default_root_dir) / "pipeline")
        rank = trainer.global_rank
        out.mkdir(parents=True, exist_ok=True)
        plot(out / f"tuner_rank{rank}.png", [trace], self.budget.memory_bytes,
             f"PipelineTuner ({self.tuner_name}), rank {rank}")
        (out / f"trace_rank{rank}.json").write_text(json.dumps(
            {"tuner": trace.tuner, "samples": trace.samples, "seconds": trace.seconds, "peak_memory": trace.peak_memory,
             "resets": trace.resets, "final": dataclasses.asdict(trace.final) if trace.final else None,
             "points": [{**dataclasses.asdict(p), "config": p.config.short(),
                         "next_config": p.next_config.short() if p.next_config else None} for p in trace.points]},
            indent=1))
        if trainer.is_global_zero:
            rank_zero_report(log, summary(trace, self.budget.cpus, self.budget.memory_bytes))
