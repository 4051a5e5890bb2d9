"""Stage 1: before its first step, a job gets a configuration from the measurements of similar past jobs."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_dlrover.advisor.model import Observation, PerformanceModel
from lightning_dlrover.advisor.recommend import Recommendation, recommend
from lightning_dlrover.advisor.resources import Machine, ResourceConfig, SearchSpace
from lightning_dlrover.advisor.signature import JobSignature

if TYPE_CHECKING:  # SQLAlchemy is imported where a history is opened
    from lightning_dlrover.advisor.history import JobHistory, JobRecord


@dataclass(frozen=True)
class PastJob:
    """A job of the history and how similar its signature is to the new job's (1 = same)."""

    record: JobRecord
    signature: JobSignature
    similarity: float


@dataclass(frozen=True)
class WarmStart:
    """What the history offers a new job.

    Attributes:
        jobs: similar past jobs, most similar first.
        observations: their measured configurations, weighted by similarity.
        model: the performance model fitted on them (``None`` with fewer than ``min_configs`` configurations).
        recommendation: the model's recommendation (``None`` without a model).
        config: the configuration to start with: the recommendation's, else the fastest measured configuration of
            the most similar job, else ``None``.
        message: one line for people.
    """

    jobs: tuple[PastJob, ...] = ()
    observations: tuple[Observation, ...] = ()
    model: PerformanceModel | None = None
    recommendation: Recommendation | None = None
    config: ResourceConfig | None = None
    message: str = "no similar past job in the history"
    failed: tuple[PastJob, ...] = field(default=())


def similar_jobs(history: JobHistory, signature: JobSignature, min_similarity: float = 0.3,
                 limit: int = 20) -> list[PastJob]:
    """Past jobs (any outcome but ``running``) whose similarity to ``signature`` is at least ``min_similarity``,
    most similar first (newest first among equals)."""
    found = []
    for record in history.jobs():
        if record.outcome == "running" or not record.signature:
            continue
        try:
            past = JobSignature.from_dict(record.signature)
        except (KeyError, TypeError):
            continue  # written by another tool
        score = signature.similarity(past)
        if score >= min_similarity:
            found.append(PastJob(record, past, score))
    found.sort(key=lambda p: (-p.similarity, -p.record.id))
    return found[:limit]


def observations_of(history: JobHistory, jobs: list[PastJob]) -> list[Observation]:
    """Measured configurations of ``jobs`` (their profiled points, else their end-of-run throughput)."""
    by_id = {p.record.id: p for p in jobs}
    rows = history.measurements(by_id)
    out = []
    measured = set()
    for row in rows:
        past = by_id[row["job_id"]]
        config = ResourceConfig(row["nodes"], row["ranks_per_node"], row["threads_per_rank"], row["data_workers"],
                                row["batch_per_rank"])
        measured.add(past.record.id)
        cores = row.get("cores_available") or past.signature.machine.cores
        out.append(Observation(config, past.signature.shape(), cores, row["step_s"],
                               row["data_wait_s"], row["rss_bytes"], weight=past.similarity))
    for past in jobs:
        r = past.record
        if r.id not in measured and r.step_s and r.resources and r.outcome != "oom":
            out.append(Observation(ResourceConfig(**r.resources), past.signature.shape(), past.signature.machine.cores,
                                   r.step_s, 0.0, r.peak_rss_bytes, weight=past.similarity))
    return out


def warm_start(history: JobHistory, signature: JobSignature, current: ResourceConfig, space: SearchSpace,
               machine: Machine, min_similarity: float = 0.3, min_configs: int = 3, **options) -> WarmStart:
    """Finds similar past jobs, fits the model on their measurements and recommends a configuration for a job
    with ``signature`` (``options`` go to :func:`~lightning_dlrover.advisor.recommend.recommend`; without
    ``available_cores``, predictions use the median of the cores those jobs had while measured: on a shared
    machine, what other programs recently left, not the machine's cores)."""
    jobs = similar_jobs(history, signature, min_similarity)
    if not jobs:
        return WarmStart()
    failed = tuple(p for p in jobs if p.record.outcome == "oom")
    observations = observations_of(history, jobs)
    closest = jobs[0]
    lead = (f"{len(jobs)} similar past job(s); closest: #{closest.record.id} {closest.record.run_id} "
            f"(similarity {closest.similarity:.2f}, {closest.record.outcome})")
    configs = {o.config for o in observations}
    if len(configs) >= min_configs:
        model = PerformanceModel().fit(observations)
        if options.get("available_cores") is None:  # before its first step a job knows only what similar jobs had
            options["available_cores"] = statistics.median(o.cores for o in observations)
        rec = recommend(model, signature.shape(), machine, current, space, **options)
        return WarmStart(tuple(jobs), tuple(observations), model, rec, rec.best.config,
                         f"{lead}; model fitted on {len(configs)} configurations recommends {rec.best.config.short()} "
                         f"({rec.best.samples_per_sec:.0f} samples/s predicted)", failed)
    own = [o for o in observations if o.weight == closest.similarity]
    if own:
        best = max(own, key=lambda o: o.samples_per_sec)
        config = best.config.with_(batch_per_rank=current.batch_per_rank) if space.batch_per_rank is None else best.config
        start = "" if config == best.config else f"; starting from {config.short()} (the job's own batch)"
        return WarmStart(tuple(jobs), tuple(observations), None, None, config,
                         f"{lead}; too few configurations to fit ({len(configs)}); its fastest measured: "
                         f"{best.config.short()} ({best.samples_per_sec:.0f} samples/s){start}", failed)
    return WarmStart(tuple(jobs), tuple(observations), None, None, None, f"{lead}; it has no measurements", failed)
