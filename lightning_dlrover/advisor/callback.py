"""``ResourceAdvisor``: the DLRover-RM three-stage resource advisor as a Lightning callback.

1. Warm start (first batch, before its forward): similar past jobs of the job history give a configuration.
2. Profiling window: the job tries a few configurations live (threads; data workers and batch where something
   owns them, :mod:`~lightning_dlrover.advisor.live`), the model is fitted on those and the history's measurements, and the best configuration
   is recommended, applied live where allowed, and the rest printed as a restart command.
3. Every ``check_every_n_steps``: stragglers, out-of-memory forecasts, hot ranks.
At the end of fit: a table and a PNG under ``<default_root_dir>/advisor/``, and the job's record in the history.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_dlrover.advisor import control
from lightning_dlrover.advisor.config import AdvisorConfig
from lightning_dlrover.advisor.detectors import OOMForecaster, StragglerDetector
from lightning_dlrover.advisor.live import LiveApplier, live_controls
from lightning_dlrover.advisor.model import Observation, PerformanceModel
from lightning_dlrover.advisor.probe import Segment, probe_schedule
from lightning_dlrover.advisor.recommend import Recommendation, recommend
from lightning_dlrover.advisor.replan import ReplanAdvice, rank_loads, strategy_placement, table_features
from lightning_dlrover.advisor.report import write_reports
from lightning_dlrover.advisor.resources import Machine, ResourceConfig, SearchSpace
from lightning_dlrover.advisor.restart import RestartDecision, RestartMode, decide_restart, program_argv
from lightning_dlrover.advisor.runtime import RuntimeWatch, background_cores, broadcast, cpu_snapshot, gather
from lightning_dlrover.advisor.signature import signature_of
from lightning_dlrover.advisor.warmstart import warm_start
from lightning_dlrover.monitor import ThroughputMonitor, emit
from lightning_dlrover.monitor.timing import _infer_batch_size

if TYPE_CHECKING:  # SQLAlchemy is imported where a history is opened
    from lightning_dlrover.advisor.history import JobHistory


class ResourceAdvisor(Callback):
    """Fits a resource-performance model of the job, recommends (and applies) resources, watches for stragglers,
    memory growth and hot ranks, and keeps a job history (see the module docstring and the README).

    Args:
        profile_steps: length of the profiling window in steps (0: no probing; warm start and detectors only).
        probe_steps: steps per configuration tried in the window; the first ``settle_steps`` are not measured.
        settle_steps: steps left out after each change (loader restart, thread pool resize).
        apply: apply the recommendation's live knobs: threads; data workers and batch through their owners
            (``PipelineTuner``, ``ElasticBatchScaler`` or control callbacks; see :mod:`~lightning_dlrover.advisor.live`).
        objective: ``throughput`` (most samples/s) or ``cost`` (cheapest reaching ``target_samples_per_sec``).
        target_samples_per_sec: throughput target of the ``cost`` objective.
        search: the configurations allowed (a :class:`SearchSpace` or its fields as a dict); default: this node's
            ranks and threads, data workers 0-2 (1-2 with a ``PipelineTuner``) when something owns them, the current
            batch and, with an ``ElasticBatchScaler``, half and twice it within the scaler's range.
        history: job history: ``"user"`` (user-wide SQLite), ``"run"`` (under ``default_root_dir``), a file path
            or an SQLAlchemy URL; ``None``: none.
        warm_start: start from the configuration similar past jobs suggest.
        min_similarity: past jobs less similar than this are ignored.
        check_every_n_steps: steps between two runtime checks (one gather of per-rank measurements).
        straggler_threshold: a rank is slow at this ratio of its own time to the other ranks' median.
        straggler_patience: consecutive slow windows before it is named.
        memory_limit_bytes: per-node memory limit of the OOM forecast (default: cgroup limit, else RAM).
        oom_horizon_steps: warn when the forecast OOM is this close (default: the steps left in the fit).
        hot_rank_factor: a rank is hot at this ratio of its embedding load to the mean rank's.
        cost_per_node_hour, cost_per_core_hour: prices for the ``cost`` objective.
        extrapolate: allow recommending world sizes / workers outside the measured ones.
        report_dir: where the table, plot and ``advice.json`` go (default ``<default_root_dir>/advisor``).
        restart: what to do when the recommendation needs a restart (world size, nodes): ``"print"`` the command,
            config and Kubernetes changes and train on; ``"stop"``: also save a checkpoint at that step boundary and
            stop the fit, for a relaunch with the printed command (see :mod:`~lightning_dlrover.advisor.restart`).
    """

    def __init__(self, profile_steps: int = 30, probe_steps: int = 6, settle_steps: int = 2, apply: bool = False,
                 objective: Literal["throughput", "cost"] = "throughput", target_samples_per_sec: float | None = None,
                 search: SearchSpace | dict | None = None, history: str | None = "user", warm_start: bool = True,
                 min_similarity: float = 0.3, check_every_n_steps: int = 10, straggler_threshold: float = 1.5,
                 straggler_patience: int = 2, memory_limit_bytes: int | None = None,
                 oom_horizon_steps: int | None = None, hot_rank_factor: float = 1.5, cost_per_node_hour: float = 1.0,
                 cost_per_core_hour: float = 0.0, extrapolate: bool = False, report_dir: str | None = None,
                 restart: RestartMode = "print") -> None:
        self.config = c = AdvisorConfig(
            profile_steps=profile_steps, probe_steps=probe_steps, settle_steps=settle_steps, apply=apply,
            objective=objective, target_samples_per_sec=target_samples_per_sec, search=search, history=history,
            warm_start=warm_start, min_similarity=min_similarity, check_every_n_steps=check_every_n_steps,
            straggler_threshold=straggler_threshold, straggler_patience=straggler_patience,
            memory_limit_bytes=memory_limit_bytes, oom_horizon_steps=oom_horizon_steps, hot_rank_factor=hot_rank_factor,
            cost_per_node_hour=cost_per_node_hour, cost_per_core_hour=cost_per_core_hour, extrapolate=extrapolate,
            report_dir=report_dir, restart=restart)
        self.restart_mode = c.restart
        #: The last restart decision (every rank), ``None`` when no change needed a restart.
        self.restart: RestartDecision | None = None
        self.profile_steps, self.probe_steps, self.settle_steps = c.profile_steps, c.probe_steps, c.settle_steps
        self.apply, self.objective, self.target = c.apply, c.objective, c.target_samples_per_sec
        self.search = c.search
        self.history_setting, self.use_warm_start, self.min_similarity = c.history, c.warm_start, c.min_similarity
        self.check_every = c.check_every_n_steps
        self.stragglers = StragglerDetector(straggler_threshold, straggler_patience)
        self.memory_limit, self.oom_horizon, self.hot_factor = c.memory_limit_bytes, c.oom_horizon_steps, c.hot_rank_factor
        self.costs = (c.cost_per_node_hour, c.cost_per_core_hour)
        self.extrapolate, self.report_dir = c.extrapolate, c.report_dir
        #: Decisions and findings of the last fit (rank 0), for programs and tests.
        self.recommendation: Recommendation | None = None
        self.model: PerformanceModel | None = None
        self.observations: list[Observation] = []
        self.replan_advice: ReplanAdvice | None = None
        self.findings: list[str] = []
        self.history: JobHistory | None = None
        self.recommended_at: tuple[int, float] | None = None  # (global step, seconds since the first step)

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.monitor = next((c for c in trainer.callbacks if isinstance(c, ThroughputMonitor)), None)
        if self.monitor is None:
            self.monitor = ThroughputMonitor(log_every_n_steps=10**9, summary=False)
            trainer.callbacks.append(self.monitor)  # appended: Lightning is iterating over the list
            rank_zero_info("ResourceAdvisor: added a ThroughputMonitor (its measurements are the advisor's input; list "
                           "one before the advisor in Trainer(callbacks=...) to have each step's the same step).")
        self.machine = Machine.detect()
        # Read the tables now: the strategy's set-up (after this hook) replaces them with sharded modules.
        self._unsharded = signature_of(pl_module, 1, (), self.machine)
        self._features = table_features(pl_module)
        self.oom = OOMForecaster(self.memory_limit or self.machine.memory_bytes, horizon_steps=10**9)
        self._started = False

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._seen, self._start_time = 0, time.time()
        self._segments: list[Segment] = []
        self._schedule: list[ResourceConfig] = []
        self._job_id: int | None = None
        self.findings, self.observations = [], []
        self.prior: PerformanceModel | None = None
        self.background = 0.0  # cores other programs kept busy, last measured
        self._history_observations: list[Observation] = []
        self._restart_text = ""

    def _start(self, trainer: Trainer, batch: Any) -> None:
        """First batch: the current configuration, signature, history record and warm start."""
        self._started = True
        g = trainer.num_devices
        self.controls = live_controls(trainer)
        self.applier = LiveApplier(self.controls)
        batch_ctl = control.find_control(self.controls, control.BatchSizeControl)
        data_ctl = control.find_control(self.controls, control.DataWorkersControl)
        loader = trainer.train_dataloader
        workers = data_ctl.get_data_workers() if data_ctl else int(getattr(loader, "num_workers", 0) or 0)
        batch_size = batch_ctl.get_batch_per_rank() if batch_ctl else (_infer_batch_size(batch) or 1)
        self.current = ResourceConfig(trainer.world_size // g, g, torch.get_num_threads(), workers, batch_size)
        self.space = self.search or SearchSpace(
            nodes=(self.current.nodes, self.current.nodes),
            data_workers=tuple(range(getattr(data_ctl, "min_workers", 0), 3)) if data_ctl else (workers,),
            batch_per_rank=batch_ctl.choices() if hasattr(batch_ctl, "choices") else None,
        )
        strategy = trainer.strategy
        self.placement = strategy_placement(strategy)
        types = tuple(sorted({shards[0][3] for shards in self.placement.values() if shards}))
        self.signature = dataclasses.replace(self._unsharded, global_batch=self.current.global_batch, sharding_types=types)
        self.watch = RuntimeWatch(self.stragglers, self.oom, self.hot_factor, self.signature.tables,
                                  self._features, self.placement, self._finding)
        shares = ()
        if self.placement:
            loads = rank_loads(self.placement, self.signature.tables, trainer.world_size)
            total = sum(loads.values()) or 1.0
            shares = ((trainer.world_size, max(loads.values()) / total),)
        self.shape = self.signature.shape(shares)
        left = trainer.max_steps - trainer.global_step if trainer.max_steps > 0 else 10_000
        self.oom.horizon = self.oom_horizon or max(left, 1)
        stage1 = self._warm_start(trainer) if trainer.is_global_zero else None
        stage1 = broadcast(trainer.world_size, stage1)
        if stage1 is not None:
            self._act(trainer, stage1, "warm_start")
        if self.profile_steps:
            probes = max(1, self.profile_steps // self.probe_steps)
            self._schedule = probe_schedule(self.current, self.machine, self.space, data_ctl is not None,
                                            batch_ctl is not None, probes)

    def _warm_start(self, trainer: Trainer) -> ResourceConfig | None:
        if self.history_setting is None:
            return None
        from lightning_dlrover.advisor.history import JobHistory, resolve_url

        self.history = JobHistory(resolve_url(self.history_setting, trainer.default_root_dir))
        run_id = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
        self._job_id = self.history.start_job(run_id, self.signature.to_dict(), self.signature.key(), self.current.to_dict(),
                                              note=" ".join(sys.argv)[:500])
        if not self.use_warm_start:
            return None
        found = warm_start(self.history, self.signature, self.current, self.space, self.machine, self.min_similarity,
                           objective=self.objective, target_samples_per_sec=self.target,
                           cost_per_node_hour=self.costs[0], cost_per_core_hour=self.costs[1], extrapolate=self.extrapolate)
        print(f"ResourceAdvisor (warm start): {found.message}", flush=True)
        if found.model is not None:
            self.prior = found.model
        self._history_observations = list(found.observations)
        return found.config

    # ------------------------------------------------------------------------------------------------ steps
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._started:
            self._start(trainer, batch)
        if self.watch.lookups is not None:
            self.watch.lookups.observe(batch, hot_rows=trainer.global_step % 10 == 0)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        record = self.monitor.last_step
        if record is None or record.index <= self._seen or not self._started:
            return
        self._seen = record.index
        step = trainer.global_step
        data = record.sections.get("data_wait", 0.0)
        self.watch.add_step(step, record.seconds, data, record.busy_seconds, float(record.rss_bytes),
                            record.data_busy_seconds)
        self.applier.check(step, record.samples)
        self._profile_step(trainer, record.seconds, data, float(record.rss_bytes), step)
        if step % self.check_every == 0:
            self.watch.check(trainer.global_rank, trainer.num_devices, trainer.world_size, step)

    def _profile_step(self, trainer: Trainer, seconds: float, data: float, rss: float, step: int) -> None:
        if not self._schedule:
            return
        if not self._segments:
            self._segments.append(Segment(self._schedule[0], step))
        segment = self._segments[-1]
        machine_wide = trainer.local_rank == 0
        if step - segment.first_step + 1 == self.settle_steps or (self.settle_steps == 0 and segment.cpu_start is None):
            segment.cpu_start = cpu_snapshot(machine_wide)
        if step - segment.first_step >= self.settle_steps:
            segment.seconds.append(seconds)
            segment.data_wait.append(data)
            segment.rss.append(rss)
        if step - segment.first_step + 1 < self.probe_steps:
            return
        if segment.cpu_start is not None:
            end = cpu_snapshot(machine_wide)
            segment.cpu = tuple(b - a for a, b in zip(segment.cpu_start, end))
        stats = gather(trainer.world_size, segment.local_stats())
        step_s = max(s.step_s for s in stats)
        self.background = background_cores([s.cpu for s in stats], trainer.num_devices, self.machine.cores)
        self.observations.append(Observation(segment.config, self.shape, self.machine.cores - self.background, step_s,
                                             sum(s.data_wait_s for s in stats) / len(stats),
                                             max(s.rss_bytes for s in stats)))
        done = len(self._segments)
        if done < len(self._schedule):
            nxt = self._schedule[done]
            control.apply_live(control.live_changes(segment.config, nxt, self.controls), self.controls)
            self._segments.append(Segment(nxt, step + 1))
        else:
            self._schedule = []
            control.apply_live(control.live_changes(segment.config, self.current, self.controls), self.controls)
            self._fit_and_recommend(trainer, step)

    def _fit_and_recommend(self, trainer: Trainer, step: int) -> None:
        target = None
        if trainer.is_global_zero:
            self.model = PerformanceModel(prior=self.prior).fit(self.observations + self._history_observations)
            self.recommendation = recommend(
                self.model, self.shape, self.machine, self.current, self.space, self.objective, self.target,
                *self.costs, extrapolate=self.extrapolate, available_cores=self._typical_free_cores())
            target = self.recommendation.best.config
            self._replan(trainer)
        target = broadcast(trainer.world_size, target)
        self.recommended_at = (step, time.time() - self._start_time)
        self._act(trainer, target, "profile")

    def _typical_free_cores(self) -> float:
        """Cores per node the job can expect for the rest of the fit: the median over the window's probes (one
        probe's fraction of a second says little about the next minutes on a shared machine)."""
        own = [o.cores for o in self.observations]
        return statistics.median(own) if own else self.machine.cores - self.background

    def _act(self, trainer: Trainer, target: ResourceConfig, stage: str) -> None:
        """Applies ``target``'s live knobs (if ``apply``), prints what needs a restart, records an event."""
        if target == self.current:
            if trainer.is_global_zero:
                print(f"ResourceAdvisor ({stage}): keep {target.short()}", flush=True)
            return
        live = control.live_changes(self.current, target, self.controls)
        applied = {}
        if self.apply and live:
            applied = self.applier.apply(live, trainer.global_step, stage)
            self.current = self.current.with_(**applied)
        restart = self._restart_decision(trainer, target)
        if trainer.is_global_zero:
            gain = self.recommendation.gain if stage == "profile" and self.recommendation else None
            print(f"ResourceAdvisor ({stage}): recommend {target.short()}"
                  + (f" ({gain:.2f}x predicted)" if gain else "")
                  + (f"; applied live: {applied}" if applied else "; live knobs not applied (apply=False)" if live else ""),
                  flush=True)
            self._restart_text = restart.text() if restart else ""
            if restart:
                print(self._restart_text, flush=True)
            emit("advice", step=trainer.global_step, stage=stage, current=self.current.to_dict(),
                 recommended=target.to_dict(), predicted_gain=gain, applied=applied, restart=self._restart_text,
                 elapsed_s=time.time() - self._start_time)
            if restart:
                emit("restart", step=trainer.global_step, **restart.event_fields())
        if restart and restart.how == "checkpoint":
            trainer.should_stop = True

    def _restart_decision(self, trainer: Trainer, target: ResourceConfig) -> RestartDecision | None:
        """Decides how to reach ``target`` (every rank); with ``restart="stop"`` saves the checkpoint (collective)."""
        from lightning_dlrover.fault.launcher import node_range

        checkpoint = None
        if self.restart_mode == "stop" and control.needs_restart(self.current, target, self.controls):
            out = Path(self.report_dir or Path(trainer.default_root_dir) / "advisor")
            checkpoint = str((out / f"restart-step={trainer.global_step}.ckpt").resolve())
            trainer.save_checkpoint(checkpoint)
        self.restart = decide_restart(self.current, target, self.controls, program_argv(), self.restart_mode,
                                      checkpoint, node_range())
        return self.restart

    # ------------------------------------------------------------------------------------------------ checks
    def _replan(self, trainer: Trainer) -> None:
        advice = self.watch.replan(trainer.world_size, trainer.num_devices, self.current.batch_per_rank,
                                   self.signature.sharding_types, self.machine.device)
        if advice is not None:
            self.replan_advice = advice
            self._finding(advice.message(), None, trainer.global_step, {})

    def _finding(self, message: str, kind: str | None, step: int, fields: dict[str, Any]) -> None:
        self.findings.append(message)
        print(f"ResourceAdvisor: {message}", flush=True)
        if kind is not None:
            emit(kind, step=step, **fields)

    # ------------------------------------------------------------------------------------------------ end
    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or not getattr(self, "_started", False):
            return
        summary = self.monitor.summary_stats
        outcome = "recovered" if getattr(trainer.strategy, "recovered", False) else "finished"
        self._record(outcome, summary)
        if self.model is not None and self.recommendation is not None:
            if self.replan_advice is None:
                self._replan(trainer)
            self._write_reports(trainer)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if trainer.is_global_zero and self.history is not None and getattr(self, "_job_id", None) is not None:
            oom = isinstance(exception, MemoryError) or "out of memory" in str(exception).lower()
            self._record("oom" if oom else "failed", None)

    def _record(self, outcome: str, summary: Any) -> None:
        if self.history is None or self._job_id is None:
            return
        rows = [{**o.config.to_dict(), "steps": self.probe_steps - self.settle_steps, "step_s": o.step_s,
                 "cores_available": o.cores,
                 "data_wait_s": o.data_wait_s, "rss_bytes": int(o.rss_bytes) if o.rss_bytes else None}
                for o in self.observations]
        self.history.add_measurements(self._job_id, rows)
        mean_step = sum(r.step_ms_mean for r in summary.ranks) / len(summary.ranks) / 1000 if summary else None
        self.history.finish_job(
            self._job_id, outcome, summary.samples_per_sec if summary else None, mean_step,
            max(r.peak_rss_bytes for r in summary.ranks) if summary else None,
            self.recommendation.best.config.to_dict() if self.recommendation else None,
            self.model.to_dict() if self.model else None, self.current.to_dict())

    def _write_reports(self, trainer: Trainer) -> None:
        out = Path(self.report_dir or Path(trainer.default_root_dir) / "advisor")
        title = f"ResourceAdvisor: {self.signature.model}, {len(self.signature.tables)} tables, {self.machine.cores} cores"
        write_reports(out, self.model, self.shape, self.machine.cores, self.observations, self.recommendation,
                      self.findings, self._restart_text, self.replan_advice, self.recommended_at, title)
