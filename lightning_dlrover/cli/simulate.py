"""``lightning-dlrover simulate``: the multi-job simulator (:mod:`lightning_dlrover.elastic.simulator`) from the shell.

Prints one row per policy (jobs completed by the horizon, mean job completion time, restarts), writes a PNG
of completed jobs over time, and, with ``--decisions``, every allocation change as what a cluster applies:
a ``torchrun --nnodes MIN:MAX`` line and the PyTorchJob / ElasticJob replica counts (JSON lines).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lightning_dlrover.elastic.profile import Profile
from lightning_dlrover.elastic.simulator import (
    POLICIES, Decision, SimResult, TraceJob, bursty_trace, load_trace, node_loss_schedule, simulate, synthetic_trace,
)


def cluster_actions(decision: Decision, job: TraceJob, nproc_per_node: int) -> dict[str, Any]:
    """What a cluster applies for ``decision``: a torchrun line and PyTorchJob / ElasticJob replica counts."""
    min_nodes, max_nodes = 1, max(1, job.max_ranks // nproc_per_node)
    nodes = decision.ranks // nproc_per_node
    return {
        "time": decision.time, "job": decision.job, "ranks": decision.ranks, "global_batch": decision.global_batch,
        "torchrun": (f"torchrun --nnodes {min_nodes}:{max_nodes} --nproc-per-node {nproc_per_node} "
                     f"-m lightning_dlrover fit --data.global_batch_size {decision.global_batch}") if nodes else None,
        "pytorchjob": {"kind": "PyTorchJob", "metadata": {"name": decision.job},
                       "spec": {"elasticPolicy": {"minReplicas": min_nodes, "maxReplicas": max_nodes},
                                "pytorchReplicaSpecs": {"Worker": {"replicas": nodes}}}},
        "elasticjob": {"kind": "ElasticJob", "metadata": {"name": decision.job},
                       "spec": {"replicaSpecs": {"worker": {"replicas": nodes}}}},
    }


def make_trace(kind: str, jobs: int, seed: int, interarrival_s: float) -> list[TraceJob]:
    if kind == "synthetic":
        return synthetic_trace(jobs, seed, interarrival_s)
    if kind == "bursty":
        return bursty_trace(jobs, seed, interarrival_s)
    if not Path(kind).is_file():
        raise SystemExit(f"--trace {kind!r}: not 'synthetic', 'bursty' or an existing JSON-lines trace file.")
    return load_trace(kind)


def format_table(results: list[SimResult], trace: str) -> str:
    base = next((r for r in results if r.policy == "fixed"), None)
    lines = [f"{'trace':<10} {'policy':<8} {'completed':>9} {'vs fixed':>8} {'mean JCT s':>10} {'vs fixed':>8} "
             f"{'restarts':>8}"]
    for r in results:
        ratio = f"{r.completed / base.completed:.2f}x" if base and base.completed else "-"
        jct = f"{r.mean_jct_s:.0f}" if r.mean_jct_s is not None else "-"
        jct_ratio = (f"{r.mean_jct_s / base.mean_jct_s:.2f}x"
                     if base and base.mean_jct_s and r.mean_jct_s is not None else "-")
        lines.append(f"{trace:<10} {r.policy:<8} {r.completed:>5}/{r.jobs:<3} {ratio:>8} {jct:>10} {jct_ratio:>8} "
                     f"{r.restarts:>8}{' *' if r.optimistic else ''}")
    if any(r.optimistic for r in results):
        lines.append("* trained at a batch that never reached the target in the profile: its progress there is an "
                     "upper bound (jobs at most, JCT at least what it shows)")
    return "\n".join(lines)


def plot(results: list[SimResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        finishes = sorted(f for _, _, f in r.completions)
        ax.step([0, *finishes], range(len(finishes) + 1), where="post", label=r.policy)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("jobs completed")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> list[SimResult]:
    profile = Profile.load(args.profile)
    trace = make_trace(args.trace, args.jobs, args.seed, args.interarrival)
    losses = node_loss_schedule(args.seed, args.horizon, args.node_loss_every, args.node_down_s, args.nproc_per_node)
    return [simulate(trace, profile, policy, args.devices, args.horizon, args.restart_s, losses, args.nproc_per_node)
            for policy in args.policies]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-dlrover simulate", description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="synthetic", help="synthetic, bursty, or a JSON-lines trace file")
    p.add_argument("--jobs", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interarrival", type=float, default=30.0, help="mean seconds between arrivals")
    p.add_argument("--devices", type=int, default=64)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--horizon", type=float, default=3600.0)
    p.add_argument("--restart-s", type=float, default=20.0, help="pause of a job whose ranks or batch change")
    p.add_argument("--node-loss-every", type=float, default=0.0, help="mean seconds between node losses (0: none)")
    p.add_argument("--node-down-s", type=float, default=300.0)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--profile", default=None, help="profile JSON (default: the one shipped, measured here)")
    p.add_argument("--plot", default=None, help="PNG of jobs completed over time")
    p.add_argument("--json", default=None, help="write the results as JSON")
    p.add_argument("--decisions", default=None, help="write every decision as cluster actions (JSON lines)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    results = run(args)
    print(format_table(results, Path(args.trace).stem))
    if args.plot:
        plot(results, args.plot, f"{args.trace} trace, {args.devices} devices")
    if args.json:
        Path(args.json).write_text(json.dumps([r.summary() for r in results], indent=1))
    if args.decisions:
        jobs = {j.name: j for j in make_trace(args.trace, args.jobs, args.seed, args.interarrival)}
        with open(args.decisions, "w") as out:
            for r in results:
                for d in r.decisions:
                    out.write(json.dumps({"policy": r.policy, **cluster_actions(d, jobs[d.job], args.nproc_per_node)})
                              + "\n")
    return 0
