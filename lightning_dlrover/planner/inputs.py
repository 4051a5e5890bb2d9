"""A job's plan from what is known before any rank starts: its tables, world size and save mode, the job history's
measured costs and observed failures, the MTBF it was given. ``lightning-dlrover plan``, ``launch --spares auto`` and
``parity: auto`` (at set-up) all plan through :func:`plan_inputs`, so they pick the same setting for the same job.

The pick (:class:`Pick`) is the parity ``(k, r, N)`` (``None``: checkpoints only), the checkpoint interval (Young/Daly
at the save mode's blocked time per save; ``None``: parity covers every failure, no periodic checkpoint needed) and
the hot spares (``0`` unless the pick recovers in process).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from lightning_dlrover.planner.costs import SAVE_MODES, JobCosts
from lightning_dlrover.planner.failures import FailureModel
from lightning_dlrover.planner.goodput import Estimate
from lightning_dlrover.planner.job import PlannedJob
from lightning_dlrover.planner.plan import Plan, make_plan

#: Environment variables ``parity: auto`` and ``launch --spares auto`` read: the job history, the job's MTBF in hours.
HISTORY_ENV = "LIGHTNING_DLROVER_HISTORY"
MTBF_ENV = "LIGHTNING_DLROVER_MTBF_HOURS"


def mtbf_from_env() -> float | None:
    """``$LIGHTNING_DLROVER_MTBF_HOURS`` as hours (``None``: unset); ``ValueError`` when it is not a positive number."""
    text = os.environ.get(MTBF_ENV)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"${MTBF_ENV}={text!r} is not a number of hours (the job's mean time between failures).")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"${MTBF_ENV}={value}: the job's mean time between failures must be > 0 hours.")
    return value


@dataclass(frozen=True)
class Pick:
    """What a plan's best candidate sets: parity fields (``None``: no parity), checkpoint interval in steps
    (``None``: none needed) and seconds, hot spares, and the estimate it came from."""

    parity: dict[str, int] | None
    checkpoint_every_steps: int | None
    checkpoint_every_s: float
    spares: int
    estimate: Estimate

    @classmethod
    def of(cls, best: Estimate) -> Pick:
        c = best.candidate
        parity = None if c.strategy == "checkpoint" else {"k": c.k, "r": c.r, "commit_every_n_steps": c.commit_every}
        return cls(parity, best.checkpoint_every_steps, best.checkpoint_every_s, c.spares, best)


@dataclass
class PlanInputs:
    """Everything a plan of ``job`` at ``world`` ranks needs (see :func:`plan_inputs`)."""

    job: PlannedJob
    world: int
    per_machine: int
    failures: FailureModel
    save_mode: str
    incremental_every: int | None
    step_s: float | None = None
    recorded: dict[str, dict[str, float]] = field(default_factory=dict)  # the history's costs, per save mode

    def costs_at(self, ranks: int, save_mode: str | None = None) -> JobCosts:
        """The job's costs at ``ranks`` (weak scaling: each rank keeps the share of the state and the step time it has
        at the config's world size),
        saving with ``save_mode`` (default: the job's): the history's measured costs over the defaults."""
        mode = save_mode or self.save_mode
        recorded = dict(self.recorded.get(mode, {}))
        step = self.step_s or recorded.pop("step_s", None) or self.job.default_step_s()
        recorded.pop("step_s", None)
        state = self.job.state_bytes * ranks / self.job.world_size  # the config's tables over its own ranks
        return JobCosts.estimate(step, state, ranks, self.per_machine, save_mode=mode,
                                 incremental_every=self.incremental_every, **recorded)

    def measured(self, save_mode: str | None = None) -> dict[str, float]:
        """The history's costs used for ``save_mode`` (default: the job's)."""
        return dict(self.recorded.get(save_mode or self.save_mode, {}))

    def plan(self, ranks: int | None = None, save_mode: str | None = None) -> Plan:
        ranks = ranks or self.world
        return make_plan(self.costs_at(ranks, save_mode), self.failures, ranks)


def plan_inputs(job: PlannedJob, ranks: int | None = None, ranks_per_machine: int | None = None,
                history: str | None = None, mtbf_hours: float | None = None, machine_share: float | None = None,
                step_s: float | None = None, save_mode: str | None = None) -> PlanInputs:
    """The plan's inputs for ``job``: at ``ranks`` (default: the job's world size), failures from ``mtbf_hours``,
    else the history's observed failures, else the published rates; costs from the history's records of this job
    (:mod:`.records`; saves measured with the job's save mode), else the defaults measured here."""
    per_machine = ranks_per_machine or job.ranks_per_machine
    world = ranks or job.world_size
    mode = save_mode or job.save_mode
    if mode not in SAVE_MODES:
        raise ValueError(f"save mode {mode!r} is not one of {', '.join(SAVE_MODES)}.")
    recorded: dict[str, dict[str, float]] = {}
    observed = None
    if history is not None:
        from lightning_dlrover.planner.records import read_costs_by_mode, read_failures

        recorded = read_costs_by_mode(history, job.key())
        observed = read_failures(history)
    if mtbf_hours is not None:
        failures = FailureModel.from_job_mtbf(mtbf_hours, world, per_machine, machine_share)
    elif observed is not None and observed[0] > 0:
        failures = FailureModel.from_observed(*observed, ranks_per_machine=per_machine)
    else:
        failures = FailureModel.published(per_machine)
    return PlanInputs(job, world, per_machine, failures, mode, job.incremental_every, step_s, recorded)
