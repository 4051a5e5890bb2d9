"""Trace-driven simulation of a cluster shared by DLRM jobs under three allocation policies.

Jobs arrive from a trace (:mod:`lightning_dlrover.elastic.trace`); each needs ``work x samples_needed(B)``
training samples at global batch ``B`` (the convergence curve measured from our DLRM,
:class:`~lightning_dlrover.elastic.profile.Profile`), and runs at ``throughput(ranks, B)`` samples/s (measured
step times plus a ring all-reduce). On every arrival, completion and node loss or return, the allocator
(:func:`~lightning_dlrover.elastic.allocate`) re-divides the devices. Policies differ only in the value they
give the allocator for a job at ``(ranks, B)``:

* ``fixed``: the job's base batch only; value = its rate of progress there (scaling GPUs at a fixed batch,
  the paper's baseline);
* ``dp``: any batch in range, valued as if the samples needed did not depend on the batch (Saxena et al.'s
  premise): ``throughput(ranks, B) / (work x samples_needed(B0))``;
* ``goodput``: any batch in range whose samples needed are measured, valued by true progress:
  ``throughput(ranks, B) / (work x samples_needed(B))`` (throughput x statistical efficiency, as Pollux does).

A batch that never reached the target in the profile (censored, :meth:`Profile.known` false) needs *more* than
``samples_needed(B)`` samples: ``goodput`` does not choose it (it cannot value it), and a policy that runs a job
there (``dp``) progresses at ``samples_needed(B)``, an upper bound on its progress; its result is then marked
``optimistic`` (jobs completed at most, JCT at least what it reports).

Progress always follows the measured curve. A job whose ``(ranks, B)`` changes pauses ``restart_s`` seconds
(an elastic restart); the allocator sees this as a cost (a choice other than the current one is worth
``1 - restart_s / reallocation_interval`` of its value) so it does not churn. Candidate batches are multiples
of ``batch_step`` in range. Deterministic for a seed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import numpy as np

from lightning_dlrover.elastic.allocator import Job, allocate
from lightning_dlrover.elastic.profile import Profile
from lightning_dlrover.elastic.trace import TraceError, TraceJob, TraceProblem, check_fit

POLICIES = ("fixed", "dp", "goodput")
BATCH_STEP = 32  # candidate batches are multiples of this in a job's range (and the range's ends)


def synthetic_trace(jobs: int = 40, seed: int = 0, interarrival_s: float = 30.0, work: float = 100.0) -> list[TraceJob]:
    """Poisson arrivals, equal-sized jobs (``work`` profiled runs each) with the same batch range."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(interarrival_s, jobs))
    return [TraceJob(f"job{i:03d}", float(t), work, (64, 1024), 128, 8) for i, t in enumerate(times)]


def bursty_trace(jobs: int = 40, seed: int = 0, interarrival_s: float = 30.0, work: float = 100.0) -> list[TraceJob]:
    """Bursts of arrivals (a burst every ``8 x interarrival_s`` on average, 1-8 jobs each, seconds apart) and
    mixed job sizes (log-normal, median ``work``, a few 5x-10x that) and batch ranges."""
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    while len(out) < jobs:
        t += rng.exponential(8 * interarrival_s)
        for _ in range(min(int(rng.integers(1, 9)), jobs - len(out))):
            size = work * float(np.clip(rng.lognormal(0.0, 0.9), 0.2, 10.0))
            lo, hi = [(64, 1024), (64, 512), (128, 1024)][int(rng.integers(0, 3))]
            out.append(TraceJob(f"job{len(out):03d}", t + float(rng.uniform(0, 5)), size, (lo, hi), 128,
                                int(rng.choice([4, 8, 16]))))
    return sorted(out, key=lambda j: j.arrival)


@dataclass(frozen=True)
class Decision:
    """An allocation change of one job: at ``time`` it runs on ``ranks`` at ``global_batch`` (0 ranks: waits)."""

    time: float
    job: str
    ranks: int
    global_batch: int


@dataclass
class SimResult:
    """Outcome of one policy on one trace."""

    policy: str
    completed: int
    jobs: int
    mean_jct_s: float | None
    horizon_s: float
    completions: list[tuple[str, float, float]] = field(default_factory=list)  # (job, arrival, finish)
    decisions: list[Decision] = field(default_factory=list)
    restarts: int = 0
    capacity: list[tuple[float, int]] = field(default_factory=list)  # (time, devices up): at 0, after each change
    optimistic: bool = False  # some job ran at a censored batch: its progress there is an upper bound

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("completions"), out.pop("decisions"), out.pop("capacity")
        return out


@dataclass
class _Running:
    job: TraceJob
    left: float = 1.0  # fraction of the job still to do
    choice: tuple[int, int] | None = None
    paused_until: float = 0.0


def node_loss_schedule(seed: int, horizon: float, mean_between_s: float, down_s: float,
                       devices_per_node: int) -> list[tuple[float, int]]:
    """``(time, device change)`` pairs: a node lost (``-devices_per_node``) and back ``down_s`` later."""
    if mean_between_s <= 0:
        return []
    rng, out, t = np.random.default_rng(seed + 7919), [], 0.0
    while (t := t + float(rng.exponential(mean_between_s))) < horizon:
        out += [(t, -devices_per_node), (t + down_s, devices_per_node)]
    return sorted(out)


def simulate(trace: list[TraceJob], profile: Profile, policy: str, devices: int, horizon_s: float,
             restart_s: float = 20.0, node_losses: list[tuple[float, int]] | None = None,
             nproc_per_node: int = 1, reallocation_s: float = 120.0, batch_step: int = BATCH_STEP) -> SimResult:
    """Runs ``trace`` under ``policy`` (see the module docs) until ``horizon_s``."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is unknown; choose one of {list(POLICIES)}.")
    problems = check_fit(trace, nproc_per_node, batch_step, [policy]) if nproc_per_node >= 1 else [
        TraceProblem("nproc_per_node", f"{nproc_per_node} is not a positive device count", "give 1 or more")]
    if devices < 0:
        problems.append(TraceProblem("devices", f"{devices} is negative", "give 0 or more devices"))
    if problems:
        raise TraceError(problems)
    arrivals = list(trace)
    changes = sorted(node_losses or [])
    active: dict[str, _Running] = {}
    result = SimResult(policy, 0, len(trace), None, horizon_s, capacity=[(0.0, devices)])
    t, capacity = 0.0, devices
    keep = max(0.0, 1.0 - restart_s / reallocation_s)

    throughput, samples_needed = lru_cache(None)(profile.throughput), lru_cache(None)(profile.samples_needed)

    def rate(run: _Running, ranks: int, batch: int, believed: bool) -> float:
        need = samples_needed(batch if not believed or policy != "dp" else run.job.base_batch)
        return throughput(ranks, batch) / (run.job.work * need)

    def reallocate() -> None:
        jobs = []
        for name, run in active.items():
            lo, hi = (run.job.base_batch,) * 2 if policy == "fixed" else run.job.batch_range
            if policy == "goodput":  # only batches whose samples needed are measured
                hi = max(lo, min(hi, profile.largest_known))
            current = run.choice

            def value(r: int, b: int, run: _Running = run, current: tuple[int, int] | None = current) -> float:
                v = rate(run, r, b, believed=True)
                return v if current == (r, b) else v * keep
            ranks = [n for n in range(nproc_per_node, run.job.max_ranks + 1, nproc_per_node)]
            jobs.append(Job(name, value, (lo, hi), ranks=ranks, batch_step=batch_step))
        choices = allocate(jobs, max(capacity, 0)).choices if jobs else {}
        for name, run in active.items():
            new = choices.get(name)
            if new != run.choice:
                result.decisions.append(Decision(t, name, *(new or (0, 0))))
                if new is not None:
                    run.paused_until = t + restart_s
                    result.optimistic |= not profile.known(new[1])
                    result.restarts += 1
                run.choice = new

    while t < horizon_s:
        # the next event: an arrival, a node change, a completion, or the horizon
        nxt = min(arrivals[0].arrival if arrivals else math.inf, changes[0][0] if changes else math.inf, horizon_s)
        finishing = None
        for name, run in active.items():
            if run.choice is not None:
                done_at = max(t, run.paused_until) + run.left / rate(run, *run.choice, believed=False)
                if done_at < nxt:
                    nxt, finishing = done_at, name
        for run in active.values():
            if run.choice is not None:
                run.left -= max(0.0, nxt - max(t, run.paused_until)) * rate(run, *run.choice, believed=False)
        t = nxt
        if finishing is not None:
            run = active.pop(finishing)
            result.completions.append((finishing, run.job.arrival, t))
        elif arrivals and arrivals[0].arrival <= t:
            job = arrivals.pop(0)
            active[job.name] = _Running(job)
        elif changes and changes[0][0] <= t:
            capacity += changes.pop(0)[1]
            result.capacity.append((t, capacity))
        else:
            break
        reallocate()
    result.completed = len(result.completions)
    if result.completions:
        result.mean_jct_s = float(np.mean([finish - arrival for _, arrival, finish in result.completions]))
    return result
