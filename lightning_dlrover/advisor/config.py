"""The ``ResourceAdvisor``'s options, validated once at construction (a bad one fails there, not at the first step)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lightning_dlrover.advisor.resources import SearchSpace
from lightning_dlrover.advisor.restart import RestartMode

#: The pip package of a database driver module, where the names differ.
_DRIVER_PACKAGES = {"psycopg2": "psycopg2-binary", "pymysql": "PyMySQL", "MySQLdb": "mysqlclient"}


def check_history_url(history: str | None) -> None:
    """Raises a ``ValueError`` now (not at the first step) if ``history`` names a database SQLAlchemy cannot use:
    not a URL it knows, a driver that is not installed (the message names the ``pip install``), or an SQLite file
    whose directory cannot be created or written."""
    if history is None or history == "run":  # "run": under default_root_dir, which the trainer creates
        return
    import sqlalchemy as sa

    from lightning_dlrover.advisor.history import resolve_url

    url = resolve_url(history)
    try:
        parsed = sa.engine.make_url(url)
        dialect = parsed.get_dialect()
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as err:
        raise ValueError(f"ResourceAdvisor(history={history!r}): not a database URL SQLAlchemy can open ({err}). Use "
                         "'user', 'run', a file path, sqlite:///path or e.g. postgresql://user@host/db.") from err
    try:
        dialect.import_dbapi()
    except ImportError as err:
        module = (getattr(err, "name", None) or dialect.driver).split(".")[0]
        raise ValueError(f"ResourceAdvisor(history={history!r}): its database driver {module!r} is not installed; "
                         f"`pip install {_DRIVER_PACKAGES.get(module, module)}`, or use another history "
                         "(e.g. a file path).") from None
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        _check_writable(Path(parsed.database), history)


def _check_writable(path: Path, history: str) -> None:
    """Raises a ``ValueError`` if the SQLite file ``path`` cannot be created or written (its directory included)."""
    existing = path if path.exists() else next((p for p in path.parents if p.exists()), Path("/"))
    if existing == path:
        ok, what = path.is_file() and os.access(path, os.R_OK | os.W_OK), "is not a writable file"
    else:
        ok, what = existing.is_dir() and os.access(existing, os.W_OK | os.X_OK), f"cannot be created in {existing}"
    if not ok:
        raise ValueError(f"ResourceAdvisor(history={history!r}): the history file {path} {what}; give a writable path "
                         "(history='run' keeps it under the run's directory), or history=None for none.")


@dataclass(frozen=True)
class AdvisorConfig:
    """The options of :class:`~lightning_dlrover.advisor.callback.ResourceAdvisor`, under its argument names (see
    its docstring). ``search`` given as a dict becomes a :class:`SearchSpace`; the straggler options are checked by
    the :class:`~lightning_dlrover.advisor.detectors.StragglerDetector` they build."""

    profile_steps: int = 30
    probe_steps: int = 6
    settle_steps: int = 2
    apply: bool = False
    objective: Literal["throughput", "cost"] = "throughput"
    target_samples_per_sec: float | None = None
    search: SearchSpace | dict | None = None
    history: str | None = "user"
    warm_start: bool = True
    min_similarity: float = 0.3
    check_every_n_steps: int = 10
    straggler_threshold: float = 1.5
    straggler_patience: int = 2
    memory_limit_bytes: int | None = None
    oom_horizon_steps: int | None = None
    hot_rank_factor: float = 1.5
    cost_per_node_hour: float = 1.0
    cost_per_core_hour: float = 0.0
    extrapolate: bool = False
    report_dir: str | None = None
    restart: RestartMode = "print"

    def __post_init__(self) -> None:
        if self.profile_steps < 0:
            raise ValueError(f"ResourceAdvisor(profile_steps={self.profile_steps}): the profiling window must be >= 0 "
                             "steps.")
        if self.settle_steps < 0 or self.probe_steps <= self.settle_steps:
            raise ValueError(f"ResourceAdvisor(probe_steps={self.probe_steps}, settle_steps={self.settle_steps}): need "
                             "0 <= settle_steps < probe_steps (a probe must measure at least one step).")
        if self.check_every_n_steps < 2:
            raise ValueError(f"ResourceAdvisor(check_every_n_steps={self.check_every_n_steps}) must be >= 2.")
        if self.objective == "cost" and not self.target_samples_per_sec:
            raise ValueError("ResourceAdvisor(objective='cost') needs target_samples_per_sec (the throughput to reach).")
        if self.objective not in ("throughput", "cost"):
            raise ValueError(f"ResourceAdvisor(objective={self.objective!r}) must be 'throughput' or 'cost'.")
        check_history_url(self.history)
        if self.restart not in ("print", "stop"):
            raise ValueError(f"ResourceAdvisor(restart={self.restart!r}) must be 'print' or 'stop'.")
        if isinstance(self.search, dict):
            object.__setattr__(self, "search", SearchSpace(**self.search))

    def report_path(self, default_root_dir: str) -> Path:
        """Where the reports and a restart's checkpoint go: ``report_dir``, else ``<default_root_dir>/advisor``."""
        return Path(self.report_dir or Path(default_root_dir) / "advisor")
