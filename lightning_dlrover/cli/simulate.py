"""``lightning-dlrover simulate``: the multi-job simulator (:mod:`lightning_dlrover.elastic.simulator`) from the shell.

Prints one row per policy (jobs completed by the horizon, mean job completion time, restarts), writes a PNG
of completed jobs over time (node losses marked), and, with ``--decisions``, every allocation change as what a
cluster applies: a ``torchrun --nnodes N --nproc-per-node P`` line for the allocator's ``N x P`` ranks and the
PyTorchJob / ElasticJob replica counts (JSON lines). Bad input (a trace file line, a flag) is refused before
anything runs: one ``WHERE: what is wrong; the fix`` line per problem on stderr, all of them, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_dlrover.elastic.profile import Profile
from lightning_dlrover.elastic.simulator import (
    BATCH_STEP,
    POLICIES,
    Decision,
    SimResult,
    bursty_trace,
    node_loss_schedule,
    simulate,
    synthetic_trace,
)
from lightning_dlrover.elastic.trace import TraceJob, TraceProblem, check_fit, read_trace

BAD_INPUT = 2  # exit code of a refused trace or flag (argparse's own usage errors use it too)


def cluster_actions(decision: Decision, job: TraceJob, nproc_per_node: int) -> dict[str, Any]:
    """What a cluster applies for ``decision``: a torchrun line with the allocator's rank count as
    ``--nnodes N --nproc-per-node P`` (``N x P = ranks``; None when the job waits) and PyTorchJob / ElasticJob
    replica counts (the elastic range ``1..max_ranks / P`` nodes in the PyTorchJob's ``elasticPolicy``)."""
    if decision.ranks % nproc_per_node:
        raise ValueError(f"job {decision.job!r}: {decision.ranks} ranks is not a whole number of "
                         f"{nproc_per_node}-device nodes; allocate ranks in multiples of nproc_per_node.")
    min_nodes, max_nodes = 1, max(1, job.max_ranks // nproc_per_node)
    nodes = decision.ranks // nproc_per_node
    return {
        "time": decision.time, "job": decision.job, "ranks": decision.ranks, "nodes": nodes,
        "global_batch": decision.global_batch,
        "torchrun": (f"torchrun --nnodes {nodes} --nproc-per-node {nproc_per_node} "
                     f"-m lightning_dlrover fit --data.global_batch_size {decision.global_batch}") if nodes else None,
        "pytorchjob": {"kind": "PyTorchJob", "metadata": {"name": decision.job},
                       "spec": {"elasticPolicy": {"minReplicas": min_nodes, "maxReplicas": max_nodes},
                                "pytorchReplicaSpecs": {"Worker": {"replicas": nodes}}}},
        "elasticjob": {"kind": "ElasticJob", "metadata": {"name": decision.job},
                       "spec": {"replicaSpecs": {"worker": {"replicas": nodes}}}},
    }


def flag_problems(args: argparse.Namespace) -> list[TraceProblem]:
    """Problems of the command line's numbers (a negative device count, a zero horizon, ...)."""
    out = []

    def need(flag: str, value: float, ok: bool, fix: str) -> None:
        if not ok or not math.isfinite(value):
            out.append(TraceProblem(f"{flag} {value:g}", "out of range", fix))

    generated = args.trace in ("synthetic", "bursty")
    if generated:
        need("--jobs", args.jobs, args.jobs >= 1, "give 1 or more jobs")
        need("--interarrival", args.interarrival, args.interarrival > 0, "give the mean seconds between arrivals, > 0")
    need("--nproc-per-node", args.nproc_per_node, args.nproc_per_node >= 1, "give the devices of one node, >= 1")
    nproc = max(args.nproc_per_node, 1)
    need("--devices", args.devices, args.devices >= nproc,
         f"the cluster needs at least one node: give --devices {nproc} or more (a multiple of --nproc-per-node)")
    if args.devices >= nproc and args.devices % nproc:
        out.append(TraceProblem(f"--devices {args.devices}", f"not a whole number of {nproc}-device nodes",
                                f"give a multiple of --nproc-per-node, e.g. {args.devices // nproc * nproc}"))
    need("--horizon", args.horizon, args.horizon > 0, "give the seconds to simulate, > 0")
    need("--restart-s", args.restart_s, args.restart_s >= 0, "give the seconds a restart pauses a job, >= 0")
    need("--node-loss-every", args.node_loss_every, args.node_loss_every >= 0,
         "give the mean seconds between node losses, or 0 for none")
    need("--node-down-s", args.node_down_s, args.node_down_s >= 0, "give the seconds a lost node stays down, >= 0")
    return out


def make_trace(args: argparse.Namespace) -> tuple[list[TraceJob], list[TraceProblem]]:
    """The trace ``--trace`` names and every problem of it and of the flags (empty when the run can start)."""
    problems = flag_problems(args)
    if args.trace == "synthetic" and args.jobs >= 1 and args.interarrival > 0:
        jobs = synthetic_trace(args.jobs, args.seed, args.interarrival)
    elif args.trace == "bursty" and args.jobs >= 1 and args.interarrival > 0:
        jobs = bursty_trace(args.jobs, args.seed, args.interarrival)
    elif args.trace in ("synthetic", "bursty"):
        jobs = []
    elif not Path(args.trace).is_file():
        return [], [TraceProblem(f"--trace {args.trace}", "no such file",
                                 "give 'synthetic', 'bursty' or a JSON-lines trace file"), *problems]
    else:
        jobs, file_problems = read_trace(args.trace)
        problems = file_problems + problems
    fit = check_fit(jobs, args.nproc_per_node, BATCH_STEP, args.policies) if args.nproc_per_node >= 1 else []
    if fit and args.trace in ("synthetic", "bursty"):  # its jobs are not the user's to fix: one line, on the flag
        ok = [n for n in range(1, args.nproc_per_node) if not check_fit(jobs, n, BATCH_STEP, args.policies)]
        fit = [TraceProblem(f"--nproc-per-node {args.nproc_per_node}",
                            f"{len(fit)} job(s) of the {args.trace} trace cannot run, e.g. {fit[0].where}: "
                            f"{fit[0].problem}", (f"use --nproc-per-node {ok[-1]} or less" if ok else "lower it")
                            + ", or give a trace file")]
    problems += fit
    return jobs, sorted(problems, key=_order)


def _order(problem: TraceProblem) -> tuple:
    """File problems by line, then the flags'."""
    where, _, line = problem.where.rpartition(":")
    return (problem.where.startswith("--"), where if line.isdigit() else problem.where,
            int(line) if line.isdigit() else 0)


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


@dataclass
class PlotData:
    """What the plot draws: per policy the step curve of jobs completed (``(times, counts)``), the times a node
    was lost or came back, and the spans the cluster had fewer devices than at the start (shaded)."""

    curves: dict[str, tuple[list[float], list[int]]]
    node_losses: list[float]
    node_returns: list[float]
    down: list[tuple[float, float]]
    devices: int


def plot_data(results: list[SimResult]) -> PlotData:
    """The :class:`PlotData` of ``results`` (node changes are the same for every policy: taken from the first)."""
    curves = {}
    for r in results:
        finishes = sorted(f for _, _, f in r.completions)
        curves[r.policy] = ([0.0, *finishes], list(range(len(finishes) + 1)))
    capacity = results[0].capacity if results else []
    devices = capacity[0][1] if capacity else 0
    losses, returns, down, start, up = [], [], [], None, devices
    for time, devices_up in capacity[1:]:
        (losses if devices_up < up else returns).append(time)
        if devices_up < devices and start is None:
            start = time
        elif devices_up >= devices and start is not None:
            down.append((start, time))
            start = None
        up = devices_up
    if start is not None:
        down.append((start, results[0].horizon_s))
    return PlotData(curves, losses, returns, down, devices)


def plot(results: list[SimResult], path: str, title: str) -> None:
    """A PNG at ``path`` of :func:`plot_data`: jobs completed over time, node losses marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = plot_data(results)
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, (xs, ys) in data.curves.items():
        ax.step(xs, ys, where="post", label=policy)
    for i, (start, end) in enumerate(data.down):
        ax.axvspan(start, end, color="grey", alpha=0.15, lw=0, label=None if i else f"< {data.devices} devices")
    for i, t in enumerate(data.node_losses):
        ax.axvline(t, color="red", ls="--", lw=0.8, label=None if i else "node lost")
    for i, t in enumerate(data.node_returns):
        ax.axvline(t, color="green", ls=":", lw=0.8, label=None if i else "node back")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("jobs completed")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace, trace: list[TraceJob]) -> list[SimResult]:
    """Every policy of ``args`` on ``trace`` (checked: see :func:`make_trace`)."""
    profile = Profile.load(args.profile)
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
    """Runs the simulator; 0, or 2 (:data:`BAD_INPUT`) with every problem of the input on stderr."""
    args = parser().parse_args(argv)
    trace, problems = make_trace(args)
    if problems:
        print("\n".join(map(str, problems)), file=sys.stderr)
        return BAD_INPUT
    results = run(args, trace)
    print(format_table(results, Path(args.trace).stem))
    if args.plot:
        plot(results, args.plot, f"{args.trace} trace, {args.devices} devices")
    if args.json:
        Path(args.json).write_text(json.dumps([r.summary() for r in results], indent=1))
    if args.decisions:
        jobs = {j.name: j for j in trace}
        with open(args.decisions, "w") as out:
            for r in results:
                for d in r.decisions:
                    out.write(json.dumps({"policy": r.policy, **cluster_actions(d, jobs[d.job], args.nproc_per_node)})
                              + "\n")
    return 0
