"""Expected goodput (useful training time over wall time) of a job under failures, per fault-tolerance strategy.

Failures arrive at ``lambda`` per wall second (:class:`~.failures.FailureModel`, Poisson); each costs its *loss*
``L``: the time to recover and the work trained again. A failure that lands within the loss window of the previous
one restarts it, so the share of wall time that trains is ``exp(-lambda * L)`` (the chance that no failure landed
in the last ``L`` seconds); to first order ``1 - lambda * L``, Young's and Daly's regime (``lambda * L << 1``).
Checkpoints every ``tau`` seconds of training block it ``C`` each (a blocking save's whole write, an asynchronous
or incremental save's copy: :func:`~.costs.save_costs`) and are committed ``D`` (``save_lag_s``) after that: a
failure loses back to the newest committed one, on average ``(tau + C) / 2 + D`` of work; ``tau`` is at least ``D``
(a save waits for the one still being written).

- **checkpoint** (checkpoints only): ``G = tau / (tau + C) * exp(-lambda * L)``, ``L = R_restart + R_load +
  (tau + C) / 2 + D``, at Young's optimal interval ``tau* = sqrt(2 * C * MTBF)`` (Young 1974; Daly 2006: the
  first-order term of his optimum), never below one step nor ``D``.
- **parity-restart** (parity ``(k, r)``, a commit every ``N`` steps, every worker restarted, the lost ranks
  decoded): steps cost ``1 + o`` times as long, ``o = r * (capture + commit / N)`` (the undo log is kept every
  step; the delta exchange and vote once per window, to ``r`` parity holders); a failure parity covers loses
  ``R_restart + R_decode * k + N * t / 2`` (``t``: the step with parity); one it cannot cover (a whole machine
  when the placement puts more than ``r`` members of a group on it) falls back to the newest checkpoint, kept
  at Young's interval for those failures alone. ``G = 1 / (1 + o) * tau / (tau + C) * exp(-lambda_c * L_c -
  lambda_u * L_u)``.
- **parity-in-process** (the same, under ``lightning-dlrover launch`` with ``S`` hot spares): a covered failure
  costs ``R_in_process + R_decode * k + N * t / 2`` while spares last; lost ranks wait ``refill_hours`` for a replacement, so the
  ranks out are Poisson with mean ``(lost ranks per hour) * refill_hours`` and a failure taking ``n`` ranks finds
  spares with probability ``P(Poisson <= S - n)``, else ``launch`` restarts every worker from the newest
  checkpoint (kept at Young's interval for those failures). Where ``launch`` starts a new spare process at once
  (``spare_start_s`` finite: the lost rank's device can be used again, as on CPU) the refill takes ``T``, the
  spare's start at idle priority (``spare_idle_start_s``), instead, and a failure that finds no spare ready
  promotes the one still starting and waits for the rest of its start at normal priority (``P =
  spare_start_s``): on average ``P / T * (T - 1/lambda + T / (exp(lambda * T) - 1))`` seconds (``P`` where the
  idle start never ends, ``T`` infinite), then recovers in process. A
  failure inside an in-process recovery (share ``1 - exp(-lambda * R)``, ``R`` that recovery) makes ``launch``
  restart every worker from the newest checkpoint. The spares' time is paid for: ``G`` is multiplied by
  ``W / (W + S)``.

All times in seconds; the costs are :class:`~.costs.JobCosts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_dlrover.planner.costs import JobCosts
from lightning_dlrover.planner.failures import FailureModel

STRATEGIES = ("checkpoint", "parity-restart", "parity-in-process")


def young_daly_interval(save_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that minimise the expected waste: ``sqrt(2 * C * MTBF)``."""
    return math.sqrt(2.0 * save_s * mtbf_s)


@dataclass(frozen=True)
class Candidate:
    """One fault-tolerance setting: a strategy of :data:`STRATEGIES` and its parity, commit interval and spares."""

    strategy: str
    k: int = 0
    r: int = 0
    commit_every: int = 1
    spares: int = 0

    @property
    def label(self) -> str:
        if self.strategy == "checkpoint":
            return "checkpoint"
        spares = f" S={self.spares}" if self.strategy == "parity-in-process" else ""
        return f"{self.strategy} k={self.k} r={self.r} N={self.commit_every}{spares}"


@dataclass(frozen=True)
class Estimate:
    """The expected goodput of a candidate, and the checkpoint interval it runs with (``inf``: none needed)."""

    candidate: Candidate
    goodput: float
    checkpoint_every_s: float
    step_s: float  # a training step with this setting
    failures_per_hour: float
    covered_share: float  # of failures, those parity recovers without a checkpoint
    parity_bytes_per_rank: float = 0.0  # the parity a rank holds beside its own state: r / k of it

    @property
    def memory_share(self) -> float:
        """Parity's memory as a share of a rank's state (``r / k``; 0 without parity)."""
        c = self.candidate
        return c.r / c.k if c.strategy != "checkpoint" else 0.0

    @property
    def checkpoint_every_steps(self) -> int | None:
        """The checkpoint interval in steps (``None``: no periodic checkpoint)."""
        return None if math.isinf(self.checkpoint_every_s) else max(1, round(self.checkpoint_every_s / self.step_s))


def covers_machine_loss(world_size: int, ranks_per_machine: int, k: int, r: int) -> bool:
    """Whether parity ``(k, r)`` recovers the loss of a whole machine: it holds at most ``r`` ranks, or the
    placement's ring puts at most ``r`` members of each group on one machine (``ceil((k + r) / M) <= r``, ``M``
    machines; see :mod:`lightning_dlrover.fault.coding.placement`)."""
    machines = math.ceil(world_size / ranks_per_machine)
    if min(ranks_per_machine, world_size) <= r:
        return True
    return machines > 1 and world_size % ranks_per_machine == 0 and math.ceil((k + r) / machines) <= r


def parity_overhead(costs: JobCosts, r: int, commit_every: int) -> float:
    """Parity's share added to a step: ``r * (capture + commit / N)``."""
    return r * (costs.parity_capture + costs.parity_commit / commit_every)


def _checkpointing(costs: JobCosts, rate_per_s: float, step_s: float, every_s: float | None = None) -> tuple[float, float]:
    """``(tau, share of training time left)`` at ``every_s``, else Young's interval for failures at ``rate_per_s``
    (none: inf, 1), never below a step nor the time a save takes to commit."""
    save_s = costs.save_s
    if every_s is not None:
        return every_s, every_s / (every_s + save_s)
    if rate_per_s <= 0:
        return math.inf, 1.0
    tau = max(young_daly_interval(save_s, 1.0 / rate_per_s), step_s, costs.save_lag_s)
    return tau, tau / (tau + save_s)


def checkpoint_loss(costs: JobCosts, tau: float) -> float:
    """Seconds a failure costs that every worker restarts from the newest committed checkpoint: the restart, the
    restore and the work since that checkpoint, ``(tau + C) / 2 + D``."""
    return costs.restart_s + costs.load_s + (tau + costs.save_s) / 2 + costs.save_lag_s


def estimate(candidate: Candidate, costs: JobCosts, failures: FailureModel, world_size: int,
             checkpoint_every_s: float | None = None) -> Estimate:
    """The expected goodput of ``candidate`` for a job of ``world_size`` ranks (see the module docs); checkpoints
    every ``checkpoint_every_s`` seconds of training if given (a job's own interval), else at Young's."""
    rank_rate = failures.rank_rate(world_size) / 3600.0
    machine_rate = failures.machine_rate(world_size) / 3600.0 if world_size > 1 or failures.ranks_per_machine == 1 \
        else 0.0  # one rank on one machine: a machine loss is a rank failure (counted in rank_rate)
    total = rank_rate + machine_rate
    if candidate.strategy == "checkpoint":
        tau, kept = _checkpointing(costs, total, costs.step_s, checkpoint_every_s)
        loss = checkpoint_loss(costs, tau) if total else 0.0
        return Estimate(candidate, kept * math.exp(-total * loss), tau, costs.step_s, total * 3600, 0.0)
    if candidate.strategy not in STRATEGIES:
        raise ValueError(f"strategy {candidate.strategy!r} is not one of {STRATEGIES}.")
    k, r, n = candidate.k, candidate.r, candidate.commit_every
    if k < 1 or r < 1 or n < 1:
        raise ValueError(f"{candidate.label}: parity needs k >= 1, r >= 1 and a commit interval >= 1.")
    if k + r > world_size:
        raise ValueError(f"{candidate.label}: k + r = {k + r} ranks per parity group, more than the world size "
                         f"{world_size}.")
    step = costs.step_s * (1.0 + parity_overhead(costs, r, n))
    machine_ranks = min(failures.ranks_per_machine, world_size)
    machine_covered = covers_machine_loss(world_size, failures.ranks_per_machine, k, r)
    covered = [(rank_rate, 1)] + ([(machine_rate, machine_ranks)] if machine_covered else [])
    uncovered = 0.0 if machine_covered else machine_rate
    lost_work = n * step / 2
    restart_loss = costs.restart_s + costs.decode_s * k + lost_work
    waste, paid = 0.0, 1.0
    if candidate.strategy == "parity-restart":
        waste += sum(rate for rate, _ in covered) * restart_loss
    else:
        spares = candidate.spares
        if spares < 1:
            raise ValueError(f"{candidate.label}: in-process recovery needs at least one hot spare.")
        respawn = math.isfinite(costs.spare_start_s)  # launch starts a new spare process at once
        idle_s = costs.spare_start_s if costs.spare_idle_start_s is None else costs.spare_idle_start_s
        refill_s = idle_s if respawn else costs.refill_hours * 3600.0
        out = (rank_rate + machine_rate * machine_ranks) * refill_s  # mean ranks waiting for a spare
        for rate, lost in covered:
            found = _poisson_cdf(spares - lost, out)
            recovery = costs.in_process_s + costs.decode_s * k
            if respawn:  # no spare ready: the one starting takes the rank when it is up
                wait = costs.spare_start_s if math.isinf(idle_s) else \
                    costs.spare_start_s / idle_s * _remaining_start(idle_s, total)
                recovery += (1 - found) * wait
                found = 1.0
            inside = 1.0 - math.exp(-total * recovery)  # the next failure lands inside this recovery
            waste += rate * found * (1 - inside) * (recovery + lost_work)
            uncovered += rate * (1 - found * (1 - inside))  # launch restarts every worker from the checkpoint
        paid = world_size / (world_size + spares)
        step *= 1.0 + costs.launch_overhead
    tau, kept = _checkpointing(costs, uncovered, step, checkpoint_every_s if uncovered else None)
    if uncovered:
        waste += uncovered * checkpoint_loss(costs, tau)
    share = sum(rate for rate, _ in covered) / total if total else 1.0
    goodput = costs.step_s / step * kept * math.exp(-waste) * paid
    return Estimate(candidate, goodput, tau, step, total * 3600, share, costs.state_bytes / world_size * r / k)


def _remaining_start(start_s: float, rate: float) -> float:
    """The mean rest of a spare's start of ``start_s`` seconds, begun at the previous failure, at the next failure
    (Poisson at ``rate``) when that comes before the spare is up."""
    x = rate * start_s
    if x < 1e-6:
        return start_s / 2
    return start_s - 1.0 / rate + start_s / math.expm1(x)


def _poisson_cdf(n: int, mean: float) -> float:
    """``P(X <= n)`` of a Poisson variable of ``mean``."""
    if n < 0:
        return 0.0
    term = total = math.exp(-mean)
    for i in range(1, n + 1):
        term *= mean / i
        total += term
    return min(total, 1.0)
