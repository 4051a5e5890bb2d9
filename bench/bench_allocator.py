"""Decision time and quality of the multi-job allocator (``lightning_dlrover.elastic.allocate``).

Random jobs with concave, saturating throughput curves over (ranks, global batch) and batch ranges, on
64 devices; per job count, the median decision time of the dynamic program over ``--repeats`` instances,
and its summed value beside a greedy allocator (one device at a time to the job with the largest marginal
gain, batch chosen per rank count as in the DP): the DP is optimal, the greedy is the usual heuristic.

    PYTHONPATH=. python bench/bench_allocator.py            # 10, 100, 1000 jobs
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from lightning_dlrover.elastic import Job, allocate


def make_jobs(count: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        base, exponent = rng.uniform(50, 500), rng.uniform(0.2, 0.95)
        knee, sweet = rng.choice([2, 4, 8, 16]), rng.choice([256, 512, 1024, 2048])

        def value(r: int, b: int, base=base, exponent=exponent, knee=knee, sweet=sweet) -> float:
            scaling = r**exponent if r <= knee else knee**exponent * (1 + 0.1 * np.log(r / knee))
            return base * scaling * (1 - 0.25 * abs(np.log2(b / sweet)) / 4)

        lo = rng.choice([128, 256, 512])
        jobs.append(Job(f"job{i}", value, batch_range=(lo, lo * rng.choice([2, 4, 8])), max_ranks=16, batch_step=128))
    return jobs


def greedy(jobs: list[Job], devices: int) -> float:
    """One device at a time to the job whose best value grows most (ties: first job)."""
    best = [job.best(devices)[0] for job in jobs]
    ranks = [0] * len(jobs)
    total = 0.0
    for _ in range(devices):
        gains = []
        for j, b in enumerate(best):
            nxt = next((r for r in range(ranks[j] + 1, devices + 1) if np.isfinite(b[r])), None)
            current = b[ranks[j]] if ranks[j] else 0.0
            gains.append(-np.inf if nxt is None or nxt - ranks[j] > devices - sum(ranks) else b[nxt] - current)
        j = int(np.argmax(gains))
        if not np.isfinite(gains[j]) or gains[j] <= 0:
            break
        nxt = next(r for r in range(ranks[j] + 1, devices + 1) if np.isfinite(best[j][r]))
        total += gains[j]
        ranks[j] = nxt
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    header = f"{'jobs':>6}{'devices':>9}{'DP ms':>10}{'DP value':>12}{'greedy value':>14}{'DP / greedy':>13}{'target':>9}  ok"
    print(f"Multi-job allocation on {args.devices} devices; median of {args.repeats} random instances.")
    print(header)
    print("-" * len(header))
    for count in args.jobs:
        times, dp, gr = [], [], []
        for seed in range(args.repeats):
            jobs = make_jobs(count, seed)
            started = time.perf_counter()
            allocation = allocate(jobs, args.devices)
            times.append(time.perf_counter() - started)
            dp.append(allocation.value)
            gr.append(greedy(jobs, args.devices))
        ms = 1000 * statistics.median(times)
        ratio = statistics.median(d / g for d, g in zip(dp, gr))
        print(f"{count:>6}{args.devices:>9}{ms:>10.1f}{statistics.median(dp):>12.0f}{statistics.median(gr):>14.0f}"
              f"{ratio:>13.3f}{'1000 ms':>9}  {'yes' if ms < 1000 else 'NO'}")
    print("DP ms: decision time (curve evaluations included); values: summed useful throughput of the chosen "
          "(ranks, batch) per job; target: well under a second at 100 jobs.")


if __name__ == "__main__":
    main()
