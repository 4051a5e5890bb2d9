"""The multi-job allocator's dynamic program against brute force, and its input checks."""

import itertools
import random

import pytest

from lightning_dlrover.elastic import Job, allocate


def curve(seed: int):
    """A concave, saturating throughput curve with a batch-size preference, different per seed."""
    rng = random.Random(seed)
    base, exponent, sweet = rng.uniform(100, 1000), rng.uniform(0.3, 1.0), rng.choice([64, 128, 256])

    def value(ranks: int, batch: int) -> float:
        return base * ranks**exponent * (1 - 0.3 * abs(batch - sweet) / 256) / (1 + 0.05 * batch / ranks / 64)

    return value


def brute_force(jobs, devices):
    options = []
    for job in jobs:
        opts = [(0, None)] if job.may_wait else []
        opts += [(r, b) for r in job.candidate_ranks() if r <= devices for b in job.candidate_batches() if b % r == 0]
        options.append(opts)
    best = -1.0
    for combo in itertools.product(*options):
        if sum(r for r, _ in combo) <= devices:
            total = sum(job.value(r, b) for job, (r, b) in zip(jobs, combo) if r)
            best = max(best, total)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_dynamic_program_finds_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    devices = rng.randint(0, 6)
    jobs = [Job(f"j{i}", curve(seed * 10 + i), batch_range=(rng.choice([32, 64]), rng.choice([128, 256])),
                max_ranks=rng.randint(1, 4), batch_step=32, may_wait=True) for i in range(rng.randint(1, 3))]
    allocation = allocate(jobs, devices)
    assert allocation.used <= devices
    recomputed = sum(job.value(*allocation.choices[job.name]) for job in jobs if job.name in allocation.choices)
    assert allocation.value == pytest.approx(recomputed)
    assert allocation.value == pytest.approx(brute_force(jobs, devices))
    for job in jobs:
        if job.name in allocation.choices:
            ranks, batch = allocation.choices[job.name]
            lo, hi = job.batch_range
            assert lo <= batch <= hi and batch % ranks == 0


def test_jobs_that_may_not_wait_get_devices_or_a_clear_error():
    jobs = [Job("big", lambda r, b: r, batch_range=(64, 64), ranks=[4], may_wait=False),
            Job("small", lambda r, b: 10 * r, batch_range=(64, 64), ranks=[1, 2])]
    assert allocate(jobs, 5).choices == {"big": (4, 64), "small": (1, 64)}
    with pytest.raises(ValueError, match=r"jobs \['big'\] may not wait, but 3 devices cannot run them all"):
        allocate(jobs, 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_range": (512, 256)}, r"batch_range=\(512, 256\) must be two integers 1 <= min <= max"),
        ({"batch_range": (0, 8)}, "must be two integers 1 <= min <= max"),
        ({"batch_range": (7, 7), "ranks": [2, 4]}, r"no global batch in \(7, 7\) is divisible by any of its rank counts"),
    ],
)
def test_bad_ranges_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Job("x", lambda r, b: 1.0, **kwargs)


def test_duplicate_names_are_rejected():
    job = Job("x", lambda r, b: 1.0, batch_range=(8, 8))
    with pytest.raises(ValueError, match="job names must be unique"):
        allocate([job, job], 2)
