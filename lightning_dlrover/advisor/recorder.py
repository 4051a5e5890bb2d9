"""One running job's part in the job history: its signature, its record (opened at the first batch on rank 0,
finished at the end of the fit or on an exception), and stage 1, the warm start from similar past jobs."""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning_dlrover import worker_env
from lightning_dlrover.advisor.model import JobShape, Observation, PerformanceModel
from lightning_dlrover.advisor.recommend import Recommendation
from lightning_dlrover.advisor.replan import rank_loads
from lightning_dlrover.advisor.resources import Machine, ResourceConfig, SearchSpace
from lightning_dlrover.advisor.signature import JobSignature, signature_of
from lightning_dlrover.advisor.warmstart import warm_start
from lightning_dlrover.log import get_logger, rank_zero_report
from lightning_dlrover.monitor.events import Event, events_path, read_events

if TYPE_CHECKING:  # SQLAlchemy is imported where a history is opened
    from torch import nn

    from lightning_dlrover.advisor.config import AdvisorConfig
    from lightning_dlrover.advisor.history import JobHistory

log = get_logger(__name__)

#: Fault events that mean a failure was observed (rank 0 writes one per recovery).
FAILURE_EVENTS = ("restored", "recovered_in_process", "fallback")


def observed_failures(events: list[Event], since: float, world_size: int) -> list[dict[str, Any]]:
    """History rows (:meth:`JobHistory.add_failures`) of the failures among ``events`` at or after ``since``: one per
    recovery, as rank 0 recorded it, with the ranks lost and the recovery's seconds."""
    rows = []
    for event in events:
        if event.kind not in FAILURE_EVENTS or event.rank not in (0, -1) or event.time < since:
            continue
        f = event.fields
        recovery = {"recovered_in_process": (f.get("restored_at") or 0.0) - (f.get("lost_at") or 0.0),
                    "restored": (f.get("decode_s") or 0.0) + (f.get("reshard_s") or 0.0),
                    "fallback": f.get("load_s")}[event.kind]
        lost = f.get("lost_ranks")
        rows.append({"time": event.time, "kind": event.kind, "world_size": world_size,
                     "lost_ranks": len(lost) if isinstance(lost, list) else 1, "recovery_s": recovery})
    return rows


class JobRecorder:
    """The job's signature and shape, its record in the history and what the warm start took from the history."""

    def __init__(self, config: AdvisorConfig) -> None:
        self.config = config
        #: The open history (rank 0, once the first batch opened it), ``None`` without one.
        self.history: JobHistory | None = None
        self.job_id: int | None = None
        #: The warm start's model and the past jobs' observations it was fitted on (rank 0).
        self.prior: PerformanceModel | None = None
        self.past_observations: list[Observation] = []
        #: When this process's job began (a restarted job's restore happens in its set-up, before the first batch).
        self.started_at = time.time()

    def reset(self) -> None:
        """Forgets the last fit's record and warm start (the history stays open)."""
        self.job_id = None
        self.prior = None
        self.past_observations = []

    def forget(self) -> None:
        """Lets go of the history after it failed: the job goes on in memory, with no record and no warm start."""
        history, self.history, self.job_id = self.history, None, None
        self.prior, self.past_observations = None, []
        if history is not None:
            try:
                history.close()
            except Exception:  # noqa: BLE001 - already failing; nothing more to keep
                pass

    def read_tables(self, module: nn.Module, machine: Machine) -> None:
        """Reads the model's tables before the strategy's set-up replaces them with sharded modules."""
        self.unsharded = signature_of(module, 1, (), machine)

    def sign(self, current: ResourceConfig, placement: Mapping[str, list], world_size: int) -> None:
        """The job's :class:`JobSignature` (with its global batch and sharding types) and :class:`JobShape`."""
        types = tuple(sorted({shards[0][3] for shards in placement.values() if shards}))
        self.signature: JobSignature = dataclasses.replace(self.unsharded, global_batch=current.global_batch,
                                                           sharding_types=types)
        shares = ()
        if placement:
            loads = rank_loads(placement, self.signature.tables, world_size)
            total = sum(loads.values()) or 1.0
            shares = ((world_size, max(loads.values()) / total),)
        self.shape: JobShape = self.signature.shape(shares)

    def warm_start(self, default_root_dir: str, current: ResourceConfig, space: SearchSpace,
                   machine: Machine) -> ResourceConfig | None:
        """Rank 0: opens the history and the job's record, and returns the configuration similar past jobs
        suggest (``None``: no history, no warm start, or nothing similar)."""
        c = self.config
        if c.history is None:
            return None
        from lightning_dlrover.advisor.history import JobHistory, resolve_url

        self.history = JobHistory(resolve_url(c.history, default_root_dir))
        run_id = worker_env.run_id() or uuid.uuid4().hex[:12]
        self.job_id = self.history.start_job(run_id, self.signature.to_dict(), self.signature.key(), current.to_dict(),
                                             note=" ".join(sys.argv)[:500])
        if not c.warm_start:
            return None
        found = warm_start(self.history, self.signature, current, space, machine, c.min_similarity,
                           objective=c.objective, target_samples_per_sec=c.target_samples_per_sec,
                           cost_per_node_hour=c.cost_per_node_hour, cost_per_core_hour=c.cost_per_core_hour,
                           extrapolate=c.extrapolate)
        rank_zero_report(log, f"ResourceAdvisor (warm start): {found.message}")
        if found.model is not None:
            self.prior = found.model
        self.past_observations = list(found.observations)
        return found.config

    @property
    def recording(self) -> bool:
        """Whether this rank holds an open record of the job."""
        return self.history is not None and self.job_id is not None

    def finish(self, outcome: str, summary: Any, observations: list[Observation], model: PerformanceModel | None,
               recommendation: Recommendation | None, current: ResourceConfig) -> None:
        """Records the window's measurements and the job's ``outcome`` (with the monitor's ``summary`` where
        there is one), if a record is open."""
        if not self.recording:
            return
        rows = [{**o.config.to_dict(), "steps": self.config.probe_steps - self.config.settle_steps, "step_s": o.step_s,
                 "cores_available": o.cores,
                 "data_wait_s": o.data_wait_s, "rss_bytes": int(o.rss_bytes) if o.rss_bytes else None}
                for o in observations]
        self.history.add_measurements(self.job_id, rows)
        mean_step = sum(r.step_ms_mean for r in summary.ranks) / len(summary.ranks) / 1000 if summary else None
        self.history.finish_job(
            self.job_id, outcome, summary.samples_per_sec if summary else None, mean_step,
            max(r.peak_rss_bytes for r in summary.ranks) if summary else None,
            recommendation.best.config.to_dict() if recommendation else None,
            model.to_dict() if model else None, current.to_dict())
        path = events_path()  # the failures this job observed (recoveries since it started), for the planner
        if path is not None:
            try:
                found = read_events([path])
            except (OSError, ValueError) as err:  # an unreadable events file loses the failures, not the record
                log.warning(f"ResourceAdvisor: the job's failures are not recorded: {path}: {err}")
                return
            world = current.nodes * current.ranks_per_node
            self.history.add_failures(self.job_id, observed_failures(found, self.started_at, world))
