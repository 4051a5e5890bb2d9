"""The ``ResourceAdvisor``'s options, validated once at construction (a bad one fails there, not at the first step)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lightning_dlrover.advisor.resources import SearchSpace
from lightning_dlrover.advisor.restart import RestartMode


def check_history_url(history: str | None) -> None:
    """Raises a ``ValueError`` now (not at the first step) if ``history`` names a database SQLAlchemy cannot use."""
    if history is None or history in ("user", "run"):
        return
    import sqlalchemy as sa

    from lightning_dlrover.advisor.history import resolve_url

    url = resolve_url(history)
    try:
        sa.engine.make_url(url).get_dialect()
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as err:
        raise ValueError(f"ResourceAdvisor(history={history!r}): not a database URL SQLAlchemy can open ({err}). Use "
                         "'user', 'run', a file path, sqlite:///path or e.g. postgresql://user@host/db.") from err


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
