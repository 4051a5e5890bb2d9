"""What each fault-tolerance option costs one job, in seconds: measured on the job (its first steps, a real save
of its state), taken from the job history of earlier runs of the same signature, or the defaults measured on this
project's machine (:data:`MEASURED_HERE`, each with the benchmark that measured it; ``bench/README.md``).

Parity's per-step cost is a share of the step without parity, split in two: ``parity_capture`` (the undo log kept
in every forward) and ``parity_commit`` (the delta exchange, the vote and the snapshots, once per commit), both at
``r = 1``; :func:`~.goodput.parity_overhead` scales them to ``(r, N)``. :meth:`JobCosts.fit_parity` fits them to
step times measured at two commit intervals.

A checkpoint's cost to training depends on how it is saved (:data:`SAVE_MODES`): a blocking save holds training for
its whole write; an asynchronous one (``async_checkpoint``) only while the state is copied into staging memory, the
write committing ``save_lag_s`` later; an incremental one (``incremental_checkpoint_every``) writes only the rows
changed since the previous save between its full links. :func:`save_costs` gives ``(save_s, save_lag_s)`` per mode:
the time training is blocked per save, averaged over a chain, and the time until the save is committed, from the
job's own ``checkpoint_saved`` events recorded in its history (:mod:`.records`) or :data:`SAVE_MODE_DEFAULTS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

GB = 1e9

#: Defaults measured on this project's machine (2 cores, gloo, local disk); ``bench/README.md`` has each run.
MEASURED_HERE: dict[str, float] = {
    "save_gb_per_s": 0.54,  # dcp save with fsync, 1.9 GiB in 3.74 s (bench_checkpoint.py)
    "load_gb_per_s": 2.5,  # dcp restore, 1.9 GiB in 0.80 s, page cache (bench_checkpoint.py)
    "restart_s": 4.7,  # torchrun restart of 2 ranks with parity, kill to training (chaos drills: 3.9-5.6 s)
    "in_process_s": 0.64,  # launch, kill to the next committed step at no state (bench_in_process.py intercept)
    "decode_s_per_gb": 1.0,  # in-process recovery grows ~1 ms per MiB of a lost rank's state (bench_in_process.py)
    # Whole-process CPU per step, 2 ranks k1r1, 26 x 100000 x 64 (bench_fault_tolerance.py): +19.9% at N = 1, +34.3%
    # at N = 16. Coalescing saved nothing there (bench/README.md: why), so fit_parity puts it all in the per-step part.
    "parity_capture": 0.20,  # parity's cost every step (undo log, and the commit as coalescing fails to shrink it)
    "parity_commit": 0.0,  # the part a commit every N steps divides by N
    "launch_overhead": 0.08,  # steps under `lightning-dlrover launch` against torchrun (chaos drills)
    "refill_hours": 1.0,  # assumed: hours until a lost rank's spare is replaced
    "spare_start_s": math.inf,  # a spare is a machine: no process re-spawned at once (see JobCosts.spare_start_s)
}


#: How a job saves checkpoints (``DLRoverStrategy(async_checkpoint=..., incremental_checkpoint_every=...)``).
SAVE_MODES = ("blocking", "async", "incremental", "async+incremental")
#: Save costs measured here where a job has no history (bench/README.md, bench_checkpoint.py, 2 ranks, 1.9 GiB of
#: state): an asynchronous save blocked training 0.277 s and committed 3.86 s after it started, where a blocking save
#: took 4.84 s in the same run (load 4.5-5.6): 0.137 s blocked and 1.90 s written per GB. A delta of an incremental
#: chain: 0.05-0.09 s blocked, written in 0.11-0.24 s (asynchronous), 0.08-0.38 s blocking (rows of 1-64 steps,
#: loaded machine): the largest, as it does not grow with the tables. A chain's full link costs a full save.
SAVE_MODE_DEFAULTS: dict[str, float] = {
    "async_blocked_s_per_gb": 0.277 / 2.028,
    "async_write_s_per_gb": 3.864 / 2.028,
    "delta_blocked_s": 0.09,  # asynchronous delta: blocked
    "delta_write_s": 0.24,  # asynchronous delta: until committed
    "delta_blocking_s": 0.38,  # blocking delta
}
#: Saves per chain of an incremental job when the config does not say (``incremental_checkpoint_every``).
INCREMENTAL_EVERY = 4


def save_costs(mode: str, machine_gb: float, incremental_every: int | None = None) -> tuple[float, float]:
    """``(save_s, save_lag_s)`` of ``mode`` from :data:`SAVE_MODE_DEFAULTS` for a machine's share of the state
    (``machine_gb``; machines save in parallel): the seconds training is blocked per save (an incremental chain's
    mean over its full link and deltas) and the seconds more until the save is committed."""
    if mode not in SAVE_MODES:
        raise ValueError(f"save mode {mode!r} is not one of {SAVE_MODES}.")
    _check("machine_gb", machine_gb)
    d = SAVE_MODE_DEFAULTS
    blocking = machine_gb / MEASURED_HERE["save_gb_per_s"]
    full = {"blocking": (blocking, 0.0), "incremental": (blocking, 0.0),
            "async": (machine_gb * d["async_blocked_s_per_gb"], machine_gb * (d["async_write_s_per_gb"]
                                                                              - d["async_blocked_s_per_gb"])),
            "async+incremental": (machine_gb * d["async_blocked_s_per_gb"],
                                  machine_gb * (d["async_write_s_per_gb"] - d["async_blocked_s_per_gb"]))}[mode]
    if "incremental" not in mode:
        return full
    every = incremental_every or INCREMENTAL_EVERY
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"incremental_checkpoint_every={every!r} must be an integer >= 1.")
    delta = (d["delta_blocked_s"], d["delta_write_s"] - d["delta_blocked_s"]) if mode.startswith("async") else \
        (d["delta_blocking_s"], 0.0)
    delta = tuple(min(x, f) for f, x in zip(full, delta))  # a delta holds at most the whole state
    return tuple((f + (every - 1) * x) / every for f, x in zip(full, delta))


def _check(name: str, value: float, allow_zero: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value!r} must be a finite number {need} (seconds, shares or GB as documented).")


@dataclass(frozen=True)
class JobCosts:
    """The costs of one job (seconds; ``parity_*`` and ``launch_overhead`` are shares of ``step_s``).

    Args:
        step_s: a training step without parity.
        state_bytes: the job's checkpointed state over all ranks (tables, optimizer state, dense part).
        save_s / load_s: the seconds a checkpoint save blocks training (a blocking save: all of it; an
            asynchronous or incremental one: see :func:`save_costs`) / a restore of that state.
        save_lag_s: the seconds more until a save is committed (an asynchronous save's background write): a
            failure in that window falls back to the save before.
        restart_s: from a failure to training again after every worker restarts (state restore not included).
        in_process_s: from a failure to training again when a hot spare takes the lost rank in process.
        decode_s: decoding one lost rank's state from ``k = 1`` sources (``k`` sources: ``k`` times as long).
        parity_capture / parity_commit: parity's per-step share at ``r = 1`` (see the module docs).
        launch_overhead: the share steps are slower under ``lightning-dlrover launch``.
        refill_hours: hours until a used hot spare is replaced.
        spare_start_s: seconds a new spare process takes to start (imports) at normal priority, where ``launch``
            re-spawns one at once on the lost rank's device (CPU jobs; ``replacement_planned`` to ``spare_ready``
            of a spare handed a rank while starting measures it); ``inf`` (the default): a used spare waits
            ``refill_hours`` for a replacement machine.
        spare_idle_start_s: seconds the same start takes at the idle priority a waiting spare runs at (``spares_started``
            to ``spare_ready`` in a run without failures); ``None``: as ``spare_start_s`` (idle cores to spare);
            ``inf``: it never ends while the ranks and other programs keep the cores busy.
        sources: where each cost came from (``measured``, ``history``, ``default``).
    """

    step_s: float
    state_bytes: float
    save_s: float
    load_s: float
    save_lag_s: float = 0.0
    restart_s: float = MEASURED_HERE["restart_s"]
    in_process_s: float = MEASURED_HERE["in_process_s"]
    decode_s: float = 0.0
    parity_capture: float = MEASURED_HERE["parity_capture"]
    parity_commit: float = MEASURED_HERE["parity_commit"]
    launch_overhead: float = MEASURED_HERE["launch_overhead"]
    refill_hours: float = MEASURED_HERE["refill_hours"]
    spare_start_s: float = MEASURED_HERE["spare_start_s"]
    spare_idle_start_s: float | None = None
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _check("step_s", self.step_s, allow_zero=False)
        if self.state_bytes <= 0:
            raise ValueError(f"state_bytes={self.state_bytes!r}: the job has no embedding state to protect (a config "
                             "with no embedding tables?). The planner needs the tables' rows and dimension.")
        for name in ("save_s", "load_s", "save_lag_s", "restart_s", "in_process_s", "decode_s", "parity_capture", "parity_commit",
                     "launch_overhead", "refill_hours"):
            _check(name, getattr(self, name))
        if self.spare_start_s != math.inf:
            _check("spare_start_s", self.spare_start_s)
        if self.spare_idle_start_s not in (None, math.inf):
            _check("spare_idle_start_s", self.spare_idle_start_s, allow_zero=False)

    @classmethod
    def estimate(cls, step_s: float, state_bytes: float, world_size: int, ranks_per_machine: int = 8,
                 save_mode: str = "blocking", incremental_every: int | None = None, **measured: float) -> JobCosts:
        """Costs from the defaults measured here, scaled to the job: a save (of ``save_mode``, :func:`save_costs`)
        and a restore move each machine's share of ``state_bytes`` at this machine's rate (machines write in
        parallel), a decode one rank's share. Any cost given in ``measured`` (a :class:`JobCosts` field) replaces
        its default."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world size {world_size!r} must be an integer >= 1.")
        _check("state_bytes", state_bytes)
        machines = math.ceil(world_size / ranks_per_machine)
        per_machine, per_rank = state_bytes / machines / GB, state_bytes / world_size / GB
        save_s, save_lag_s = save_costs(save_mode, per_machine, incremental_every)
        values: dict[str, Any] = {
            "save_s": save_s,
            "save_lag_s": save_lag_s,
            "load_s": per_machine / MEASURED_HERE["load_gb_per_s"],
            "decode_s": per_rank * MEASURED_HERE["decode_s_per_gb"],
        }
        unknown = set(measured) - {f for f in cls.__dataclass_fields__ if f not in ("step_s", "state_bytes", "sources")}
        if unknown:
            raise ValueError(f"unknown costs {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}.")
        sources = {name: "default" for name in ("save_s", "save_lag_s", "load_s", "decode_s", "restart_s", "in_process_s",
                                                "parity_capture", "parity_commit", "launch_overhead", "refill_hours",
                                                "spare_start_s")}
        sources.update({name: "measured" for name in measured})
        values.update(measured)
        return cls(step_s=step_s, state_bytes=state_bytes, sources=sources, **values)

    def with_measured(self, source: str = "measured", **values: float) -> JobCosts:
        """These costs with some replaced (``source``: where the new ones come from)."""
        return replace(self, **values, sources={**self.sources, **{name: source for name in values}})

    @staticmethod
    def fit_parity(base_step_s: float, steps: dict[int, float], r: int = 1) -> tuple[float, float]:
        """``(capture, commit)`` shares from the step time without parity and with parity ``r`` at two or more commit
        intervals (``{N: step seconds}``): least squares of ``step / base - 1 = r * (capture + commit / N)``."""
        _check("base_step_s", base_step_s, allow_zero=False)
        if len(steps) < 2:
            raise ValueError(f"fit_parity needs step times at two or more commit intervals, got {sorted(steps)}.")
        xs = [1.0 / n for n in steps]
        ys = [(s / base_step_s - 1.0) / r for s in steps.values()]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        commit = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        commit = max(commit, 0.0)
        capture = max(my - commit * mx, 0.0)
        return capture, commit
