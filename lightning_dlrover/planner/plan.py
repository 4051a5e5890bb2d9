"""The fault-tolerance plan of a job: every candidate setting's expected goodput, and the best.

Candidates (:func:`candidates`): checkpoints only; parity ``k`` in 1, 2, 4, 8 and ``r`` in 1, 2 (``k + r`` at most
the world size) with a commit every 1, 4, 16 or 64 steps, recovered by a restart of every worker, or in process
with 1, 2, one machine's or two machines' worth of hot spares. :func:`make_plan` estimates each
(:mod:`.goodput`) and picks the highest goodput; a tie (to 4 decimals) goes to the cheaper setting (fewer spares,
smaller ``r``, larger ``k``: less memory; smaller ``N``: fewer steps trained again). :func:`sweep` does it for a range of world sizes (the ``plan`` command's plot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_dlrover.planner.costs import JobCosts
from lightning_dlrover.planner.failures import FailureModel
from lightning_dlrover.planner.goodput import STRATEGIES, Candidate, Estimate, estimate

K_CHOICES = (1, 2, 4, 8)
R_CHOICES = (1, 2)
COMMIT_CHOICES = (1, 4, 16, 64)
#: Ranks the plot of goodput against ranks covers.
SWEEP_RANKS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def spare_choices(ranks_per_machine: int) -> tuple[int, ...]:
    return tuple(sorted({1, 2, ranks_per_machine, 2 * ranks_per_machine}))


def candidates(world_size: int, ranks_per_machine: int = 8, strategies: tuple[str, ...] = STRATEGIES) -> list[Candidate]:
    """Every setting the planner weighs for ``world_size`` ranks (see the module docs)."""
    if world_size < 2 and any(s != "checkpoint" for s in strategies):
        strategies = ("checkpoint",) if "checkpoint" in strategies else ()
    out = [Candidate("checkpoint")] if "checkpoint" in strategies else []
    for k in K_CHOICES:
        for r in R_CHOICES:
            if k + r > world_size:
                continue
            for n in COMMIT_CHOICES:
                if "parity-restart" in strategies:
                    out.append(Candidate("parity-restart", k, r, n))
                if "parity-in-process" in strategies:
                    out += [Candidate("parity-in-process", k, r, n, s) for s in spare_choices(ranks_per_machine)]
    return out


def _cost_rank(e: Estimate) -> tuple:
    c = e.candidate
    return (-round(e.goodput, 4), STRATEGIES.index(c.strategy), c.spares, c.r, -c.k, c.commit_every)


@dataclass(frozen=True)
class Plan:
    """Every candidate's estimate (best first) for one job."""

    world_size: int
    costs: JobCosts
    failures: FailureModel
    estimates: list[Estimate]

    @property
    def best(self) -> Estimate:
        return self.estimates[0]

    def best_of(self, strategy: str) -> Estimate | None:
        """The best candidate of ``strategy`` (``None``: it has none at this world size)."""
        return next((e for e in self.estimates if e.candidate.strategy == strategy), None)

    def table(self, top: int = 12) -> str:
        """The best of each strategy, then the ``top`` candidates overall, as text."""
        head = (f"{'strategy':<20}{'k':>3}{'r':>3}{'commit N':>9}{'spares':>7}{'goodput':>9}{'ckpt every':>12}"
                f"{'ckpt steps':>11}{'step s':>8}{'covered':>8}{'parity GB/rank':>15}")
        lines = [head, "-" * len(head)]
        shown = [e for e in (self.best_of(s) for s in STRATEGIES) if e is not None]
        shown += [e for e in self.estimates[:top] if e not in shown]
        for e in shown:
            c = e.candidate
            parity = c.strategy != "checkpoint"
            every = "-" if math.isinf(e.checkpoint_every_s) else _duration(e.checkpoint_every_s)
            steps = "-" if e.checkpoint_every_steps is None else str(e.checkpoint_every_steps)
            mark = "  <- pick" if e is self.best else ""
            lines.append(f"{c.strategy:<20}{c.k if parity else '-':>3}{c.r if parity else '-':>3}"
                         f"{c.commit_every if parity else '-':>9}{c.spares if c.spares else '-':>7}{e.goodput:>9.4f}"
                         f"{every:>12}{steps:>11}{e.step_s:>8.3f}{e.covered_share:>8.0%}"
                         f"{e.parity_bytes_per_rank / 1e9 if parity else 0:>15.3f}{mark}")
        return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def make_plan(costs: JobCosts, failures: FailureModel, world_size: int,
              strategies: tuple[str, ...] = STRATEGIES) -> Plan:
    """Estimates every candidate at ``world_size`` ranks and sorts them, best first."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"--ranks {world_size!r} must be an integer >= 1.")
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        raise ValueError(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}.")
    options = candidates(world_size, failures.ranks_per_machine, strategies)
    if not options:
        raise ValueError(f"no candidate of {strategies} runs at {world_size} rank(s): parity needs k + r <= the "
                         "world size, so at least 2 ranks.")
    estimates = sorted((estimate(c, costs, failures, world_size) for c in options), key=_cost_rank)
    return Plan(world_size, costs, failures, estimates)


def sweep(costs_at: callable, failures: FailureModel, ranks: tuple[int, ...] = SWEEP_RANKS,
          strategies: tuple[str, ...] = STRATEGIES) -> dict[str, list[float]]:
    """The best goodput of each of ``strategies`` at each world size of ``ranks`` (``costs_at(world_size)``: the
    job's costs there, e.g. its state spread over more machines)."""
    out: dict[str, list[float]] = {s: [] for s in strategies}
    for world in ranks:
        plan = make_plan(costs_at(world), failures, world, strategies)
        for strategy in strategies:
            best = plan.best_of(strategy)
            out[strategy].append(best.goodput if best is not None else float("nan"))
    return out


def plan_job(world_size: int, state_bytes: float, step_s: float, ranks_per_machine: int,
             mtbf_hours: float | None = None, machine_share: float | None = None,
             measured: dict[str, float] | None = None) -> Plan:
    """The plan of a job at start (``ParityConfig.auto``): its costs estimated from its state and step (``measured``
    replaces any), failures from ``mtbf_hours`` (the job's, at ``world_size``) or the published rates. Parity needs
    ``k + r <= world_size``: at fewer than 2 ranks this raises."""
    if world_size < 2:
        raise ValueError(f"parity: auto at world size {world_size}: parity needs at least 2 ranks (k + r <= the world "
                         "size). Run 2 or more ranks, or set parity: null.")
    per_machine = min(ranks_per_machine, world_size)
    failures = (FailureModel.from_job_mtbf(mtbf_hours, world_size, per_machine, machine_share)
                if mtbf_hours is not None else FailureModel.published(per_machine))
    costs = JobCosts.estimate(step_s, state_bytes, world_size, per_machine, **(measured or {}))
    return make_plan(costs, failures, world_size)
