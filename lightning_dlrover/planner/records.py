"""The planner's inputs from a job history (:class:`~lightning_dlrover.advisor.history.JobHistory`): the failures
its jobs observed (the advisor records them from the fault events) and the costs measured on earlier runs of a
job. SQLAlchemy is imported only here, when a history is read."""

from __future__ import annotations

from lightning_dlrover.planner.costs import SAVE_MODES, JobCosts


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


def step_name(parity: tuple[int, int, int] | None) -> str:
    """The history's name of a step time measured with ``parity`` ``(k, r, N)`` (``None``: without parity)."""
    return "step_s" if parity is None else "step_s_k{}r{}n{}".format(*parity)


def _parity_steps(recorded: dict[str, float]) -> dict[tuple[int, int, int], float]:
    out = {}
    for name, value in recorded.items():
        if name.startswith("step_s_k"):
            k, rest = name[len("step_s_k"):].split("r", 1)
            r, n = rest.split("n", 1)
            out[int(k), int(r), int(n)] = value
    return out


def save_names(mode: str) -> tuple[str, str]:
    """The history's names of a save's blocked time and its lag until committed, measured with save ``mode``
    (:data:`~.costs.SAVE_MODES`): ``save_s.<mode>``, ``save_lag_s.<mode>``."""
    return f"save_s.{mode}", f"save_lag_s.{mode}"


def costs_from_records(recorded: dict[str, float], save_mode: str | None = None) -> dict[str, float]:
    """The planner's costs from a job's records (:class:`JobCosts` field names, and ``step_s``). Step times the job
    measured on itself (:func:`step_name`) give the step without parity and parity's per-step share: with steps
    without parity and with parity ``r`` at two or more commit intervals, :meth:`JobCosts.fit_parity`; at one, that
    share all per step; with parity steps alone, the step without parity is theirs less the default share. Saves the
    job measured with ``save_mode`` (:func:`save_names`, from its ``checkpoint_saved`` events) give ``save_s`` (the
    time training was blocked) and ``save_lag_s``; they win over a ``save_s`` recorded without a mode."""
    known = set(JobCosts.__dataclass_fields__) - {"state_bytes", "sources"}
    out = {name: value for name, value in recorded.items() if name in known}
    if save_mode is not None:
        blocked, lag = save_names(save_mode)
        if blocked in recorded:
            out["save_s"], out["save_lag_s"] = recorded[blocked], recorded.get(lag, 0.0)
    with_parity = _parity_steps(recorded)
    if not with_parity or {"parity_capture", "parity_commit"} & set(recorded):
        return out  # no parity steps, or parity's share itself was measured (bench_fault_tolerance.py)
    r = max({r for _, r, _ in with_parity}, key=lambda r: sum(key[1] == r for key in with_parity))
    steps = {n: value for (_, rr, n), value in with_parity.items() if rr == r}
    if "step_s" not in out:
        n, value = min(steps.items())
        share = r * (JobCosts.__dataclass_fields__["parity_capture"].default
                     + JobCosts.__dataclass_fields__["parity_commit"].default / n)
        out["step_s"] = value / (1 + share)
        return out
    if len(steps) >= 2:
        out["parity_capture"], out["parity_commit"] = JobCosts.fit_parity(out["step_s"], steps, r)
    else:
        [(n, value)] = steps.items()
        out["parity_capture"], out["parity_commit"] = max(value / out["step_s"] - 1, 0.0) / r, 0.0
    return out


def read_costs(history: str, job_key: str, save_mode: str | None = None) -> dict[str, float]:
    """The newest measured costs of ``job_key`` (:class:`JobCosts` field names, and ``step_s``; see
    :func:`costs_from_records`)."""
    db = _open(history)
    try:
        return costs_from_records(db.costs(job_key), save_mode)
    finally:
        db.close()


def read_costs_by_mode(history: str, job_key: str) -> dict[str, dict[str, float]]:
    """:func:`read_costs` of ``job_key`` for each save mode (:data:`~.costs.SAVE_MODES`), from one read."""
    db = _open(history)
    try:
        recorded = db.costs(job_key)
    finally:
        db.close()
    return {mode: costs_from_records(recorded, mode) for mode in SAVE_MODES}


def record_costs(history: str, job_key: str, values: dict[str, float]) -> None:
    """Adds costs measured on a run of ``job_key`` to ``history`` (the newest of each name wins)."""
    db = _open(history)
    try:
        db.add_costs(job_key, values)
    finally:
        db.close()

