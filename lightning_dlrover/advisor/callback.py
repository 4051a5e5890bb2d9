"""``ResourceAdvisor``: the DLRover-RM three-stage resource advisor as a Lightning callback.

1. Warm start (first batch, before its forward): similar past jobs of the job history give a configuration.
2. Profiling window: the job tries a few configurations live (threads; data workers and batch where something
   owns them, :mod:`~lightning_dlrover.advisor.live`), the model is fitted on those and the history's measurements, and the best configuration
   is recommended, applied live where allowed, and the rest printed as a restart command.
3. Every ``check_every_n_steps``: stragglers, out-of-memory forecasts, hot ranks.
At the end of fit: a table and a PNG under ``<default_root_dir>/advisor/``, and the job's record in the history.

The hooks call into one module per job: :mod:`~lightning_dlrover.advisor.config` (the options),
:mod:`~lightning_dlrover.advisor.recorder` (signature, history record, warm start),
:mod:`~lightning_dlrover.advisor.window` (probes, fit, recommendation), :mod:`~lightning_dlrover.advisor.act`
(live changes, restarts) and :mod:`~lightning_dlrover.advisor.runtime` (stage 3's checks).

The advisor never ends the fit (:mod:`~lightning_dlrover.monitor.guard`): a failing job history, report, re-plan or
recommendation is reported once (an ``addon_failed`` event and a warning) and the advisor goes on without it (in
memory, no report, the configuration kept); a failure anywhere else in its hooks turns it off for the fit. A
failure on some ranks only keeps the ranks in step: the failed rank joins the others' next advisor collective as
failed (:func:`~lightning_dlrover.advisor.runtime.meet`) and every rank turns the advisor off there together.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_dlrover.advisor.act import Actor
from lightning_dlrover.advisor.config import AdvisorConfig
from lightning_dlrover.advisor.detectors import OOMForecaster, StepSample, StragglerDetector
from lightning_dlrover.advisor.model import Observation, PerformanceModel
from lightning_dlrover.advisor.recommend import Recommendation
from lightning_dlrover.advisor.recorder import JobRecorder
from lightning_dlrover.advisor.replan import ReplanAdvice, strategy_placement, table_features
from lightning_dlrover.advisor.report import write_reports
from lightning_dlrover.advisor.resources import Machine, ResourceConfig, SearchSpace
from lightning_dlrover.advisor.restart import RestartDecision, RestartMode
from lightning_dlrover.advisor.runtime import PeerFailed, RuntimeWatch, broadcast, checkpoint_staging_bytes, held, meet
from lightning_dlrover.advisor.window import ProfilingWindow, RecommendedAt
from lightning_dlrover.log import get_logger, rank_zero_report
from lightning_dlrover.monitor import ThroughputMonitor, collectives, emit
from lightning_dlrover.monitor.guard import failure, guarded, is_addon_error, report_degraded

if TYPE_CHECKING:  # SQLAlchemy is imported where a history is opened
    from lightning_dlrover.advisor.history import JobHistory

log = get_logger(__name__)
T = TypeVar("T")


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
        self.config = AdvisorConfig(
            profile_steps=profile_steps, probe_steps=probe_steps, settle_steps=settle_steps, apply=apply,
            objective=objective, target_samples_per_sec=target_samples_per_sec, search=search, history=history,
            warm_start=warm_start, min_similarity=min_similarity, check_every_n_steps=check_every_n_steps,
            straggler_threshold=straggler_threshold, straggler_patience=straggler_patience,
            memory_limit_bytes=memory_limit_bytes, oom_horizon_steps=oom_horizon_steps, hot_rank_factor=hot_rank_factor,
            cost_per_node_hour=cost_per_node_hour, cost_per_core_hour=cost_per_core_hour, extrapolate=extrapolate,
            report_dir=report_dir, restart=restart)
        self.stragglers = StragglerDetector(straggler_threshold, straggler_patience)
        self.window = ProfilingWindow(self.config)
        self.recorder = JobRecorder(self.config)
        self.actor = Actor(self.config)
        #: Findings and the re-plan advice of the last fit (rank 0), for programs and tests.
        self.findings: list[str] = []
        self.replan_advice: ReplanAdvice | None = None
        self._started = False
        self._owes, self._owed_once = False, None  # see _keep_in_step
        self._replan_decided: int | None = None  # the check at which rank 0 decided whether to apply its re-plan

    def validate(self, world_size: int) -> None:
        """Raises a ``ValueError`` if the job history cannot be opened (e.g. its server is unreachable), in the
        launching process before ranks start (``lightning-dlrover fit`` calls it); the options themselves were
        checked at construction."""
        history = self.config.history
        if history is None or history == "run":
            return
        from lightning_dlrover.advisor.history import JobHistory, resolve_url

        try:
            JobHistory(resolve_url(history)).close()
        except ValueError as err:
            raise ValueError(f"ResourceAdvisor(history={history!r}): {err}") from None

    # ------------------------------------------------------------------------------------------------ results
    @property
    def search(self) -> SearchSpace | None:
        """The configurations allowed, as given (``None``: the default of the first batch)."""
        return self.config.search

    @property
    def history_setting(self) -> str | None:
        """The ``history`` argument."""
        return self.config.history

    @property
    def history(self) -> JobHistory | None:
        """The job history, once opened (rank 0)."""
        return self.recorder.history

    @property
    def model(self) -> PerformanceModel | None:
        """The model fitted at the end of the profiling window (rank 0)."""
        return self.window.model

    @property
    def recommendation(self) -> Recommendation | None:
        """The profiling window's recommendation (rank 0)."""
        return self.window.recommendation

    @property
    def recommended_at(self) -> RecommendedAt | None:
        """When the profiling window's recommendation was made."""
        return self.window.recommended_at

    @property
    def observations(self) -> list[Observation]:
        """The profiling window's measured configurations."""
        return self.window.observations

    @property
    def restart(self) -> RestartDecision | None:
        """The last restart decision (every rank), ``None`` when no change needed a restart."""
        return self.actor.restart

    # ------------------------------------------------------------------------------------------------ setup
    @override
    @guarded
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
        self.recorder.read_tables(pl_module, self.machine)
        self._features = table_features(pl_module)
        self.oom = OOMForecaster(self.config.memory_limit_bytes or self.machine.memory_bytes, horizon_steps=10**9)
        self._started = False
        self._owes, self._owed_once = False, None
        collectives.install()  # every rank's time waiting in collectives, for the straggler detector

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            collectives.uninstall()

    @override
    @guarded
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._seen, self._start_time = 0, time.time()
        self.window.reset()
        self.recorder.reset()
        self.actor.reset()
        self.findings = []

    def _start(self, trainer: Trainer, batch: Any) -> None:
        """First batch: the current configuration, signature, history record and warm start, probe schedule."""
        self._started = True
        self.actor.start(trainer, batch)
        placement = strategy_placement(trainer.strategy)
        self.recorder.sign(self.actor.current, placement, trainer.world_size)
        self.watch = RuntimeWatch(self.stragglers, self.oom, self.config.hot_rank_factor,
                                  self.recorder.signature.tables, self._features, placement, self._finding)
        left = trainer.max_steps - trainer.global_step if trainer.max_steps > 0 else 10_000
        self.oom.horizon = self.config.oom_horizon_steps or max(left, 1)
        stage1 = None
        if trainer.is_global_zero:
            stage1 = self._part("history", "in memory: no job history and no warm start for this fit", trainer,
                                lambda: self.recorder.warm_start(trainer.default_root_dir, self.actor.current,
                                                                 self.actor.space, self.machine),
                                self.recorder.forget)
        stage1 = broadcast(trainer.world_size, stage1)
        if stage1 is not None:
            self._act(trainer, stage1, "warm_start")
        self.window.plan(self.actor.current, self.machine, self.actor.space, self.recorder.shape, self.actor.controls,
                         self.actor.can_set_workers, self.actor.can_set_batch)

    # ------------------------------------------------------------------------------------------------ steps
    @override
    @collectives.add_on_hook  # the advisor's own work is left out of the steps it measures
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        first, before = not self._started, held()
        self._batch_start(trainer, batch)
        self._keep_in_step(trainer, lambda: 1 if first else 0, before)

    @guarded("on_train_batch_start")
    def _batch_start(self, trainer: Trainer, batch: Any) -> None:
        if not self._started:
            self._start(trainer, batch)
        if self.watch.lookups is not None:
            self.watch.lookups.observe(batch, hot_rows=trainer.global_step % 10 == 0)

    @override
    @collectives.add_on_hook
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        before = held()
        self._batch_end(trainer)
        self._keep_in_step(trainer, lambda: self._collectives_at(trainer.global_step), before)

    @guarded("on_train_batch_end")
    def _batch_end(self, trainer: Trainer) -> None:
        record = self.monitor.last_step
        if record is None or record.index <= self._seen or not self._started:
            return
        self._seen = record.index
        step = trainer.global_step
        data = record.sections.get("data_wait", 0.0)
        timed = collectives.installed()
        self.watch.add_step(StepSample(step, record.seconds, data, record.busy_seconds, float(record.rss_bytes),
                                       record.data_busy_seconds, record.collective_seconds if timed else None))
        self.actor.applier.check(step, record.samples)
        if self.window.measure(trainer, step, record.seconds, data, float(record.rss_bytes), self.actor.current):
            self._recommend(trainer, step)
        if self.window.schedule or (self.recommended_at is not None and self.recommended_at.step == step):
            self.watch.quiet_until = step + self.config.settle_steps  # probing or just changed: no straggler verdict
        if step % self.config.check_every_n_steps == 0:
            self.watch.check(trainer.global_rank, trainer.num_devices, trainer.world_size, step,
                             checkpoint_staging_bytes(trainer))
            if self._replans_at(step):
                self._replan_live(trainer, step)

    def _collectives_at(self, step: int) -> int:
        """The advisor's collectives in ``on_train_batch_end`` at ``step`` (probe ends, recommendation, check)."""
        if not self._started:
            return 0
        check = step % self.config.check_every_n_steps == 0
        return self.window.collectives_at(step) + check + (check and self._replans_at(step))

    def _replans_at(self, step: int) -> bool:
        """Whether the check at ``step`` decides on applying a re-plan (``apply``: once, at the first check that
        measured the tables, and the same on every rank)."""
        return self.config.apply and (self._replan_decided is None or self._replan_decided == step)

    def _replan_live(self, trainer: Trainer, step: int) -> None:
        """Rank 0 re-plans with the pooling factors measured so far; a worthwhile re-plan is applied on every rank."""
        decided, replan = False, None
        if trainer.is_global_zero:
            self._part("replan", "no re-plan advice", trainer, lambda: self._replan(trainer))
            advice = self.replan_advice
            decided = advice is not None
            replan = advice.pooling_factors if decided and advice.worthwhile else None
        decided, replan = broadcast(trainer.world_size, (decided, replan))
        if decided:
            self._replan_decided = step
        if replan is not None:
            self._part("replan", "the re-plan stays advice", trainer, lambda: self._apply_replan(trainer, replan, step))

    def _keep_in_step(self, trainer: Trainer, due: Callable[[], int], before: int) -> None:
        """A hook ran ``held() - before`` of the ``due()`` collectives the other ranks hold in it. Failed on this rank
        alone (not with the others: :class:`PeerFailed`), the advisor joins their next one as failed, so that every
        rank steps back there together instead of waiting for this one until the process-group timeout."""
        record = failure(self)
        if record is None:
            return
        if record.error_type == PeerFailed.__name__:
            self._owes = False
        elif self._owed_once is not record:
            self._owes, self._owed_once = True, record
        if self._owes and held() - before < due():
            self._owes = False
            try:
                meet(trainer.world_size, None, failed=True)
            except PeerFailed:
                pass

    def _recommend(self, trainer: Trainer, step: int) -> None:
        """End of the profiling window: rank 0 fits and recommends (and re-plans), every rank acts on it."""
        target = None
        if trainer.is_global_zero:
            target = self._part("recommend", "no recommendation: the configuration is kept", trainer,
                                lambda: self.window.fit_and_recommend(self.actor.current, self.recorder.prior,
                                                                      self.recorder.past_observations))
            self._part("replan", "no re-plan advice", trainer, lambda: self._replan(trainer))
        target = broadcast(trainer.world_size, target)  # rank 0's part failed: None on every rank, nothing to act on
        if target is None:
            return
        self.window.recommended_at = RecommendedAt(step, time.time() - self._start_time)
        self._act(trainer, target, "profile")

    def _act(self, trainer: Trainer, target: ResourceConfig, stage: str) -> None:
        self.actor.act(trainer, target, stage, self.window.recommendation, self._start_time)

    # ------------------------------------------------------------------------------------------------ checks
    def _replan(self, trainer: Trainer) -> None:
        advice = self.watch.replan(trainer.world_size, trainer.num_devices, self.actor.current.batch_per_rank,
                                   self.recorder.signature.sharding_types, self.machine.device)
        if advice is not None:
            self.replan_advice = advice
            self._finding(advice.message(self.config.apply), None, trainer.global_step, {})

    def _apply_replan(self, trainer: Trainer, pooling_factors: dict[str, float], step: int) -> None:
        """Every rank: hands a worthwhile re-plan to the strategy, which re-shards in process at its next commit where it
        can (``lightning-dlrover launch``); a plan that reorders the pooled embeddings only for a model that reads them by
        key (``pooled_embeddings_by_key = True``: one reading ``KeyedTensor.values()`` would see permuted features)."""
        apply = getattr(trainer.strategy, "replan_in_process", None)
        keep = not getattr(trainer.lightning_module, "pooled_embeddings_by_key", False)
        if apply is not None and apply(pooling_factors, keep_feature_order=keep):
            emit("advice_applied", step=step, stage="profile", knob="sharding_plan", old=None, new=pooling_factors,
                 via=f"{type(trainer.strategy).__name__}.replan_in_process")

    def _finding(self, message: str, kind: str | None, step: int, fields: dict[str, Any]) -> None:
        self.findings.append(message)
        rank_zero_report(log, f"ResourceAdvisor: {message}")
        if kind is not None:
            emit(kind, step=step, **fields)

    # ------------------------------------------------------------------------------------------------ end
    @override
    @guarded
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or not self._started:
            return
        summary = self.monitor.summary_stats
        outcome = "recovered" if getattr(trainer.strategy, "recovered", False) else "finished"
        self._record(outcome, summary, trainer)
        if self.model is not None and self.recommendation is not None:
            if self.replan_advice is None:
                self._part("replan", "no re-plan advice", trainer, lambda: self._replan(trainer))
            sig = self.recorder.signature
            title = f"ResourceAdvisor: {sig.model}, {len(sig.tables)} tables, {self.machine.cores} cores"
            self._part("report", "no report files (the findings were printed)", trainer, lambda: write_reports(
                self.config.report_path(trainer.default_root_dir), self.model, self.recorder.shape, self.machine.cores,
                self.observations, self.recommendation, self.findings, self.actor.restart_text, self.replan_advice,
                self.recommended_at, title))

    @override
    @guarded
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if trainer.is_global_zero and self.recorder.recording:
            oom = isinstance(exception, MemoryError) or "out of memory" in str(exception).lower()
            self._record("oom" if oom else "failed", None, trainer)

    def _record(self, outcome: str, summary: Any, trainer: Trainer) -> None:
        self._part("history", "in memory: the job's record is not kept", trainer,
                   lambda: self.recorder.finish(outcome, summary, self.observations, self.model, self.recommendation,
                                                self.actor.current), self.recorder.forget)

    def _part(self, part: str, without: str, trainer: Trainer, run: Callable[[], T],
              step_back: Callable[[], None] | None = None) -> T | None:
        """``run()``; if it fails (an error of the advisor's, :func:`~lightning_dlrover.monitor.guard.is_addon_error`),
        ``step_back()``, a report that the advisor goes on ``without`` it, and ``None``."""
        try:
            return run()
        except Exception as error:
            if not is_addon_error(error):
                raise
            if step_back is not None:
                step_back()
            report_degraded(self, part, error, without, trainer.global_step)
            return None
