"""Elastic batch scaling: simulator policies on two trace shapes, and allocator decision times.

1. The simulator (``lightning_dlrover.elastic.simulator``) with the DLRM profile measured on this machine
   (``python -m lightning_dlrover.cli.profile``): jobs completed by the horizon and mean JCT of the
   fixed-batch baseline, the DP with elastic batch (Saxena et al.) and the goodput policy, on the synthetic
   (Poisson, equal jobs) and bursty (bursts, mixed sizes and ranges) traces, with node losses; ratios to fixed.
   Several seeds; the table shows the totals and medians.
2. Allocator decision time at 10/100/1000 jobs on 64 devices (``bench/bench_allocator.py``'s jobs).

    PYTHONPATH=. python bench/bench_elastic.py [--seeds 0 1 2] [--plot bench_elastic.png]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_allocator import make_jobs  # noqa: E402

from lightning_dlrover.cli.simulate import plot  # noqa: E402
from lightning_dlrover.elastic import allocate  # noqa: E402
from lightning_dlrover.elastic.profile import Profile  # noqa: E402
from lightning_dlrover.elastic.simulator import POLICIES, bursty_trace, node_loss_schedule, simulate, synthetic_trace  # noqa: E402


def simulator_table(args: argparse.Namespace) -> None:
    profile = Profile.load(args.profile)
    print(f"profile: samples to target {profile.samples_to_target}, step s {profile.step_s}, "
          f"all-reduce {profile.allreduce_s * 1e3:.2f} ms")
    print(f"{'trace':<10} {'policy':<8} {'completed':>10} {'vs fixed':>8} {'median JCT s':>12} {'vs fixed':>8} "
          f"{'restarts':>8}")
    for name, make in (("synthetic", synthetic_trace), ("bursty", bursty_trace)):
        rows = {p: [] for p in POLICIES}
        for seed in args.seeds:
            trace = make(args.jobs, seed, args.interarrival)
            losses = node_loss_schedule(seed, args.horizon, args.node_loss_every, 300.0, 1)
            results = [simulate(trace, profile, p, args.devices, args.horizon, args.restart_s, losses) for p in POLICIES]
            for r in results:
                rows[r.policy].append(r)
            if args.plot and seed == args.seeds[0]:
                plot(results, args.plot.replace(".png", f"_{name}.png"), f"{name} trace, seed {seed}")
        done = {p: sum(r.completed for r in rs) for p, rs in rows.items()}
        jct = {p: statistics.median(r.mean_jct_s for r in rs if r.mean_jct_s) for p, rs in rows.items()}
        for p in POLICIES:
            print(f"{name:<10} {p:<8} {done[p]:>5}/{len(args.seeds) * args.jobs:<4} {done[p] / done['fixed']:>7.2f}x "
                  f"{jct[p]:>12.0f} {jct[p] / jct['fixed']:>7.2f}x {sum(r.restarts for r in rows[p]):>8}")


def allocator_times(repeats: int) -> None:
    print(f"\n{'jobs':>6} {'devices':>8} {'decision ms (median)':>21}")
    for count in (10, 100, 1000):
        times = []
        for seed in range(repeats):
            jobs = make_jobs(count, seed)
            start = time.perf_counter()
            allocate(jobs, 64)
            times.append((time.perf_counter() - start) * 1e3)
        print(f"{count:>6} {64:>8} {statistics.median(times):>21.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--devices", type=int, default=32)
    parser.add_argument("--interarrival", type=float, default=60.0)
    parser.add_argument("--horizon", type=float, default=4 * 3600.0)
    parser.add_argument("--restart-s", type=float, default=20.0)
    parser.add_argument("--node-loss-every", type=float, default=1800.0)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    simulator_table(args)
    allocator_times(args.repeats)


if __name__ == "__main__":
    main()
