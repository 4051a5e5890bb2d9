"""Elastic batch scaling: simulator policies on two trace shapes, and allocator decision times.

1. The simulator (``lightning_dlrover.elastic.simulator``) with the DLRM profile measured on this machine
   (``python -m lightning_dlrover.cli.profile``): jobs completed by the horizon and mean JCT of the
   fixed-batch baseline, the DP with elastic batch (Saxena et al.) and the goodput policy, on the synthetic
   (Poisson, equal jobs) and bursty (bursts, mixed sizes and ranges) traces, with node losses; ratios to fixed.
   Every trace seed is run with the profile's median curve (the totals and medians columns) and with each
   convergence seed's own curve (the ratio columns: mean +- standard deviation over trace seed x curve seed).
   A result marked ``<=`` / ``>=`` ran a job at a censored batch (one that never reached the target in the
   profile): its progress there is an upper bound, so its jobs are at most and its JCT at least what it shows.
2. Allocator decision time at 10/100/1000 jobs on 64 devices (``bench/bench_allocator.py``'s jobs).

    PYTHONPATH=. python bench/bench_elastic.py [--seeds 0 1 2] [--profile-seeds 0 1 2] [--plot bench_elastic.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_allocator import make_jobs  # noqa: E402

from lightning_dlrover.cli.simulate import plot  # noqa: E402
from lightning_dlrover.elastic import allocate  # noqa: E402
from lightning_dlrover.elastic.profile import DEFAULT_PROFILE, Profile  # noqa: E402
from lightning_dlrover.elastic.simulator import POLICIES, bursty_trace, node_loss_schedule, simulate, synthetic_trace  # noqa: E402


def _spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    return f"{mean:.2f}+-{statistics.stdev(values) if len(values) > 1 else 0.0:.2f}"


def profile_table(path: str | None) -> list[int]:
    """Prints each batch's samples to the target per convergence seed (``>N``: censored); returns the seeds."""
    raw = json.loads(Path(path).read_text() if path else resources.files("lightning_dlrover.elastic").joinpath(
        DEFAULT_PROFILE).read_text())
    seeds = raw.get("meta", {}).get("seeds", [])
    per_seed = raw.get("samples_to_target_seeds", {})
    censored = f">{raw.get('censored_at')}"
    print(f"profile: warm-up {raw.get('meta', {}).get('warmup_steps', 0)} steps, seeds {seeds}, "
          f"all-reduce {raw['allreduce_s'] * 1e3:.2f} ms")
    print(f"{'batch':>6} {'per seed':<28} {'median':>8} {'mean+-sd (reached)':>20}")
    for batch, median in raw["samples_to_target"].items():
        hits = per_seed.get(batch, [])
        reached = [h for h in hits if h is not None]
        cells = " ".join(f"{h:.0f}" if h is not None else censored for h in hits)
        spread = (f"{statistics.mean(reached):.0f}+-{statistics.stdev(reached) if len(reached) > 1 else 0:.0f}"
                  f" ({len(reached)}/{len(hits)})") if reached else "-"
        print(f"{batch:>6} {cells:<28} {median if median is not None else censored:>8} {spread:>20}")
    return seeds if per_seed else []


def simulator_table(args: argparse.Namespace) -> None:
    seeds = profile_table(args.profile)
    median = Profile.load(args.profile)
    curves = [Profile.load(args.profile, seed=s) for s in (args.profile_seeds or seeds)] or [median]
    print(f"\n{'trace':<10} {'policy':<8} {'completed':>10} {'vs fixed':>12} {'median JCT s':>12} {'vs fixed':>12} "
          f"{'restarts':>8}")
    for name, make in (("synthetic", synthetic_trace), ("bursty", bursty_trace)):
        rows = {p: [] for p in POLICIES}
        ratios = {p: ([], []) for p in POLICIES}
        bounded = {p: False for p in POLICIES}
        for seed in args.seeds:
            trace = make(args.jobs, seed, args.interarrival)
            losses = node_loss_schedule(seed, args.horizon, args.node_loss_every, 300.0, 1)
            results = [simulate(trace, median, p, args.devices, args.horizon, args.restart_s, losses) for p in POLICIES]
            for r in results:
                rows[r.policy].append(r)
            if args.plot and seed == args.seeds[0]:
                plot(results, args.plot.replace(".png", f"_{name}.png"), f"{name} trace, seed {seed}")
            for curve in curves:
                each = {p: simulate(trace, curve, p, args.devices, args.horizon, args.restart_s, losses)
                        for p in POLICIES}
                for p, r in each.items():
                    ratios[p][0].append(r.completed / each["fixed"].completed)
                    ratios[p][1].append((r.mean_jct_s or float("nan")) / each["fixed"].mean_jct_s)
                    bounded[p] |= r.optimistic
        done = {p: sum(r.completed for r in rs) for p, rs in rows.items()}
        jct = {p: statistics.median(r.mean_jct_s for r in rs if r.mean_jct_s) for p, rs in rows.items()}
        for p in POLICIES:
            le, ge = ("<=", ">=") if bounded[p] or any(r.optimistic for r in rows[p]) else ("", "")
            print(f"{name:<10} {p:<8} {done[p]:>5}/{len(args.seeds) * args.jobs:<4} {le + _spread(ratios[p][0]):>12} "
                  f"{jct[p]:>12.0f} {ge + _spread(ratios[p][1]):>12} {sum(r.restarts for r in rows[p]):>8}")


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
    parser.add_argument("--profile-seeds", type=int, nargs="*", default=None,
                        help="convergence seeds whose own curves to run too (default: all the profile has)")
    parser.add_argument("--plot", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    simulator_table(args)
    allocator_times(args.repeats)


if __name__ == "__main__":
    main()
