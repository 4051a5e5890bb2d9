"""Multi-job allocation of devices *and* batch sizes (Saxena et al., MASCOTS 2020): a dynamic program.

Each job can run at any global batch in its range and on any number of ranks that divides the batch; its
value at ``(ranks, batch)`` is its useful throughput there (samples/s, times a statistical efficiency when
the job gives one, as Pollux's goodput does). The allocator picks one ``(ranks, batch)`` per job, or none
(the job waits), so that the jobs' values summed are the largest the cluster's ``devices`` allow.

Recurrence (jobs ``1..J`` in order, ``d`` devices)::

    best_j(r)  = max over batches b in [lo_j, hi_j] with b % r == 0 of value_j(r, b)    (r >= 1)
    V[0][d]    = 0
    V[j][d]    = max( V[j-1][d],                                  # job j waits (if it may)
                      max over r in R_j, r <= d of V[j-1][d - r] + best_j(r) )

The answer is ``V[J][D]``; the choices are recovered by walking the argmax table back. ``best_j`` costs
``O(|R_j| * |B_j|)`` evaluations of the job's curve, the table ``O(J * D * R)`` with ``R`` the largest rank
count, done as ``R`` vectorised shifts per job (numpy): 100 jobs on 64 devices take milliseconds.

Example::

    >>> jobs = [Job("a", lambda r, b: 1000 * r ** 0.8, batch_range=(256, 1024)),
    ...         Job("b", lambda r, b: 800 * r ** 0.5, batch_range=(256, 512))]
    >>> allocation = allocate(jobs, devices=4)
    >>> allocation.ranks("a"), allocation.ranks("b")
    (3, 1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Job:
    """A job the allocator may scale.

    Args:
        name: unique name.
        value: useful throughput at ``(ranks, global batch)`` (e.g. samples/s x statistical efficiency); >= 0.
        batch_range: smallest and largest global batch the job trains well with (inclusive).
        ranks: rank counts the job may run on (default ``1..max_ranks``); a count is used only with a batch it divides.
        max_ranks: with ``ranks`` unset, the largest rank count.
        batch_step: candidate batches are ``lo, lo + step, ...`` up to ``hi`` (default: multiples of 8 in range,
            and ``lo`` and ``hi`` themselves).
        may_wait: whether the job may get no device (otherwise the allocation fails when it cannot run).
    """

    name: str
    value: Callable[[int, int], float]
    batch_range: tuple[int, int]
    ranks: Sequence[int] | None = None
    max_ranks: int = 64
    batch_step: int = 8
    may_wait: bool = True

    def __post_init__(self) -> None:
        lo, hi = self.batch_range
        if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 1 or lo > hi:
            raise ValueError(f"job {self.name!r}: batch_range={self.batch_range} must be two integers 1 <= min <= max.")
        ranks = self.candidate_ranks()
        if not ranks or min(ranks) < 1:
            raise ValueError(f"job {self.name!r}: ranks={self.ranks} must be positive rank counts.")
        if not any(b % r == 0 for r in ranks for b in self.candidate_batches()):
            raise ValueError(
                f"job {self.name!r}: no global batch in {self.batch_range} is divisible by any of its rank counts "
                f"{sorted(ranks)[:8]}...; widen the batch range or allow other rank counts."
            )

    def candidate_ranks(self) -> list[int]:
        return sorted(set(self.ranks)) if self.ranks is not None else list(range(1, self.max_ranks + 1))

    def candidate_batches(self) -> list[int]:
        lo, hi = self.batch_range
        step = max(1, self.batch_step)
        return sorted({lo, hi, *range(-(-lo // step) * step, hi + 1, step)})

    def best(self, devices: int) -> tuple[np.ndarray, np.ndarray]:
        """``(value, batch)`` of the best batch at every rank count ``0..devices`` (value -inf where none fits)."""
        value = np.full(devices + 1, -np.inf)
        batch = np.zeros(devices + 1, dtype=np.int64)
        batches = self.candidate_batches()
        for r in (r for r in self.candidate_ranks() if r <= devices):
            for b in batches:
                if b % r == 0:
                    v = float(self.value(r, b))
                    if v > value[r]:
                        value[r], batch[r] = v, b
        return value, batch


@dataclass
class Allocation:
    """The allocator's answer: ``choices[name] = (ranks, global batch)``; jobs that wait are absent."""

    choices: dict[str, tuple[int, int]]
    value: float
    devices: int

    def ranks(self, name: str) -> int:
        return self.choices.get(name, (0, 0))[0]

    def batch(self, name: str) -> int | None:
        return self.choices[name][1] if name in self.choices else None

    @property
    def used(self) -> int:
        return sum(r for r, _ in self.choices.values())


def allocate(jobs: Sequence[Job], devices: int) -> Allocation:
    """Each job's ``(ranks, batch)`` maximising the summed value on ``devices`` devices (see the module docs)."""
    if devices < 0:
        raise ValueError(f"devices={devices} must be >= 0.")
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"job names must be unique, got {names}.")
    table = np.zeros(devices + 1)  # V[j][d]
    picks, batches = [], []
    index = np.arange(devices + 1)
    for job in jobs:
        best, batch = job.best(devices)
        best[0] = 0.0 if job.may_wait else -np.inf
        candidates = np.full((devices + 1, devices + 1), -np.inf)  # [r, d]
        for r in np.flatnonzero(np.isfinite(best)):
            candidates[r, r:] = table[: devices + 1 - r] + best[r]
        pick = candidates.argmax(axis=0)
        table = candidates[pick, index]
        picks.append(pick)
        batches.append(batch)
    if not np.isfinite(table[devices]):
        stuck = [job.name for job in jobs if not job.may_wait]
        raise ValueError(f"jobs {stuck} may not wait, but {devices} devices cannot run them all at once.")
    choices, d = {}, devices
    for job, pick, batch in zip(reversed(jobs), reversed(picks), reversed(batches)):
        r = int(pick[d])
        if r:
            choices[job.name] = (r, int(batch[r]))
        d -= r
    return Allocation(dict(reversed(choices.items())), float(table[devices]), devices)
