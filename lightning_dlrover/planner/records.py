"""The planner's inputs from a job history (:class:`~lightning_dlrover.advisor.history.JobHistory`): the failures
its jobs observed (the advisor records them from the fault events) and the costs measured on earlier runs of a
job. SQLAlchemy is imported only here, when a history is read."""

from __future__ import annotations

from lightning_dlrover.planner.costs import JobCosts


def _open(history: str):  # noqa: ANN202 - a JobHistory
    from lightning_dlrover.advisor.history import JobHistory, resolve_url

    return JobHistory(resolve_url(history))


def read_failures(history: str) -> tuple[int, float]:
    """``(failures, rank-hours)`` recorded in ``history``: the observed rate."""
    db = _open(history)
    try:
        return len(db.failures()), db.rank_hours()
    finally:
        db.close()


def read_costs(history: str, job_key: str) -> dict[str, float]:
    """The newest measured costs of ``job_key`` (:class:`JobCosts` field names, and ``step_s``)."""
    db = _open(history)
    try:
        known = set(JobCosts.__dataclass_fields__) - {"state_bytes", "sources"}
        return {name: value for name, value in db.costs(job_key).items() if name in known}
    finally:
        db.close()

