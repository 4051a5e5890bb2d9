"""``PipelineTuner``: tunes the TSV pipeline's workers per stage and prefetch depth online, while training.

Each rank's pipeline gets its share of the node's cores (the cores left after the training ranks, divided by
the ranks on the node) and a hard memory budget. At 2+ ranks one decision holds for all ranks: the windows
close at the same step on every rank and rank 0's tuner decides from the ranks' combined observations, its
decision broadcast on the control plane (:mod:`~lightning_dlrover.pipeline_tuner.joint`), so every rank runs
the same configuration from the same step. Decisions apply between two steps (the pipeline is rebuilt at the
current sample position). Every decision is a ``pipeline_decision`` event; at the end of fit a
``pipeline_tuned`` event, a table (rank 0) and ``<default_root_dir>/pipeline/tuner_rank<r>.png`` and
``trace_rank<r>.json``.

A failure inside the tuner (a hook, a decision, a pipeline rebuild it asked for, its report) never ends the fit
(:mod:`~lightning_dlrover.monitor.guard`): it is reported once (an ``addon_failed`` event and a warning), the
pipeline goes back to the last configuration the tuner completed a step with, and the tuner stops tuning. At
2+ ranks every rank steps back at the next meeting (to the configuration of the last meeting all ranks joined
healthy), and no rank waits for another.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_dlrover.data.staged import PipelineConfig, PipelinedLoader
from lightning_dlrover.log import get_logger, rank_zero_report
from lightning_dlrover.monitor import emit
from lightning_dlrover.monitor.guard import failure, guarded, report_failure
from lightning_dlrover.pipeline_tuner import joint
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
            end to end; ``hill_climb`` climbs from it.
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
        self._joint = self._joint_off = False  # 2+ ranks deciding together; stopped on every rank
        self._batches = 0

    def _make_tuner(self, budget: Budget, configured: PipelineConfig) -> Any:
        """The tuner from ``configured`` (the start: ``rl`` keeps it unless a change beats it, ``hill_climb`` climbs
        from it); at 2+ ranks, on a rank other than 0, a :class:`~joint.Follower` of rank 0's."""
        if self.tuner_name == "rl":
            tuner = RLTuner(budget, start=configured, seed=self.seed)
        elif self.tuner_name == "hill_climb":
            tuner = HillClimbTuner(budget, start=configured)
        else:
            tuner = FixedTuner(configured, "fixed")
        if self._joint and self._trainer.global_rank != 0:
            return joint.Follower(tuner.name, tuner.first(), tuner.done)
        return tuner

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Sets up the tuner; at 2+ ranks the ranks agree on rank 0's budget (a collective every rank joins)."""
        self._trainer, self._batches, self._joint_off = trainer, 0, False
        self._joint = trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
        self._start(trainer)
        if not self._joint:
            return
        every = joint.gather(self.budget if failure(self) is None else None)
        if self._peers_failed(every, trainer):
            return
        self.budget = every[0]
        self._drive(trainer)

    @guarded("on_train_start")
    def _start(self, trainer: Trainer) -> None:
        self._loader = loader = find_pipelined_loader(trainer)
        self._good = loader.config
        memory = self.memory_mb << 20 if self.memory_mb else None
        self.budget = Budget.for_node(max(trainer.num_devices, 1), self.cpus, memory, self.max_prefetch)
        if not self._joint:
            self._drive(trainer)

    @guarded("on_train_start")
    def _drive(self, trainer: Trainer) -> None:
        loader = self._loader
        self.tuner = self._make_tuner(self.budget, self.start or loader.config)
        self.driver = TunerDriver(loader, self.tuner, self.window_s, self.min_batches, on_decision=self._emit,
                                  joint=self._joint)
        rank_zero_info(f"PipelineTuner ({self.tuner_name}): budget {self.budget.cpus} workers and "
                       f"{self.budget.memory_bytes / 2**20:.0f} MiB per rank; starting at {self.tuner.first().short()}"
                       + (f", one decision for all {trainer.world_size} ranks (rank 0's)" if self._joint else ""))

    def _peers_failed(self, every: list[Any], trainer: Trainer) -> bool:
        """After a meeting: whether a rank joined it as failed; then the tuner steps back on every rank."""
        bad = joint.failed_ranks(every)
        if not bad:
            return False
        self._joint_off = True
        if failure(self) is None:
            report_failure(self, "on_train_batch_end", joint.PeerFailed(
                f"the pipeline tuner failed on rank(s) {bad}; it steps back on every rank to keep them in step"),
                trainer.global_step)
        return True

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
        self.tuner = self._make_tuner(self.budget, within)
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
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Measures; at 2+ ranks, every ``min_batches`` batches, the ranks meet (a failed rank too, as failed)."""
        self._batch_end()
        if self._joint and not self._joint_off:
            self._batches += 1
            if self._batches % self.min_batches == 0:
                self._meet(trainer)

    @guarded("on_train_batch_end")
    def _batch_end(self) -> None:
        if self.driver is not None:
            self.driver.after_batch()
            if not self._joint:
                self._good = self.driver.loader.config

    def _meet(self, trainer: Trainer) -> None:
        """One meeting of the ranks (:mod:`~lightning_dlrover.pipeline_tuner.joint`): every rank's window; if it is
        complete everywhere, rank 0's decision, applied on every rank."""
        every = joint.gather(self._window() if failure(self) is None else None)
        if self._peers_failed(every, trainer):
            return
        self._good = self.driver.loader.config  # every rank healthy, on the same configuration
        windows = [w for _, w in every]
        if any(w is None for w in windows) or not joint.closes(self.driver, windows):
            return
        decided = self._decide(windows) if trainer.global_rank == 0 and failure(self) is None else None
        decided = joint.broadcast(decided)
        if self._peers_failed([decided], trainer):
            return
        self._follow(windows[trainer.global_rank][0], *decided)

    @guarded("on_train_batch_end")
    def _window(self) -> tuple:
        return ("window", self.driver.window())

    @guarded("on_train_batch_end")
    def _decide(self, windows: list[joint.Window]) -> tuple:
        combined, worker_bytes = joint.combine(windows)
        d = self.tuner.step(combined, worker_bytes)
        return d.config, d.reason, d.predicted_memory, self.tuner.done, getattr(self.tuner, "kept_start", None)

    @guarded("on_train_batch_end")
    def _follow(self, own: Any, config: PipelineConfig | None, reason: str, predicted: int, done: bool,
                kept_start: bool | None) -> None:
        if isinstance(self.tuner, joint.Follower):
            self.tuner.follow(config, done, kept_start)
        self.driver.apply(own, Decision(own, config, reason, predicted))

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
