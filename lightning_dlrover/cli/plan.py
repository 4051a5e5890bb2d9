"""``lightning-dlrover plan``: the fault-tolerance plan of a job, without training.

    lightning-dlrover plan --config configs/benchmark.yaml                  # at the config's own world size
    lightning-dlrover plan --config job.yaml --ranks 1024 --mtbf-hours 12 --plot goodput.png

Prints every strategy's best setting (checkpoints only at Young's interval, parity with restart recovery, parity
in process with hot spares) and the best candidates with their expected goodput, and the pick; ``--plot`` draws the
best goodput of each strategy against the world size (8-4096 ranks). Costs come from the job history's records of
this job (``--history``), else the defaults measured here (:mod:`lightning_dlrover.planner.costs`); failures from
``--mtbf-hours``, else the history's observed failures, else the published rates
(:mod:`lightning_dlrover.planner.failures`).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import yaml

from lightning_dlrover.planner import FailureModel, JobCosts, make_plan, sweep
from lightning_dlrover.planner.job import PlannedJob
from lightning_dlrover.planner.plan import SWEEP_RANKS


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lightning-dlrover plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="a `lightning-dlrover fit` config")
    parser.add_argument("--ranks", type=int, default=None, help="world size to plan for (default: the config's)")
    parser.add_argument("--ranks-per-machine", type=int, default=None,
                        help="ranks a machine holds, lost together (default: the config's trainer.devices)")
    parser.add_argument("--mtbf-hours", type=float, default=None,
                        help="the job's mean time between failures at --ranks, in hours (default: the history's "
                             "observed failures, else the published rates)")
    parser.add_argument("--machine-share", type=float, default=None,
                        help="share of failures that take a whole machine (default: the published 0.413)")
    parser.add_argument("--step-s", type=float, default=None, help="a step's seconds without parity (default: the "
                                                                     "history's, else estimated)")
    parser.add_argument("--history", default=None, help="job history (path or SQLAlchemy URL) to take costs and "
                                                        "observed failures from")
    parser.add_argument("--plot", type=Path, default=None, help="write goodput against ranks (8-4096) here (PNG)")
    args = parser.parse_args(argv)
    if not args.config.is_file():
        parser.error(f"--config {args.config} does not exist")
    for name in ("ranks", "ranks_per_machine"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value} must be >= 1")
    for name in ("mtbf_hours", "step_s"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{name.replace('_', '-')} {value} must be a positive number")
    if args.machine_share is not None and not 0 <= args.machine_share < 1:
        parser.error(f"--machine-share {args.machine_share} must be in [0, 1)")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        job = PlannedJob.from_config(yaml.safe_load(args.config.read_text()) or {})
        per_machine = args.ranks_per_machine or job.ranks_per_machine
        world = args.ranks or job.world_size
        observed = None
        recorded: dict[str, float] = {}
        if args.history is not None:
            from lightning_dlrover.planner.records import read_costs, read_failures

            recorded = read_costs(args.history, job.key())
            observed = read_failures(args.history)
        if args.mtbf_hours is not None:
            failures = FailureModel.from_job_mtbf(args.mtbf_hours, world, per_machine, args.machine_share)
        elif observed is not None and observed[0] > 0:
            failures = FailureModel.from_observed(*observed, ranks_per_machine=per_machine)
        else:
            failures = FailureModel.published(per_machine)
        step_s = args.step_s or recorded.pop("step_s", None)

        def costs_at(ranks: int) -> JobCosts:
            """Weak scaling: each rank keeps its share of the state and its step time."""
            state = job.state_bytes * ranks / job.world_size
            base = step_s or job.default_step_s()
            return JobCosts.estimate(base, state, ranks, per_machine, **recorded)

        plan = make_plan(costs_at(world), failures, world)
    except ValueError as err:
        print(f"lightning-dlrover plan: error: {err}", file=sys.stderr)
        return 2
    costs = plan.costs
    print(f"plan for {args.config}: {world} ranks ({per_machine} per machine), {len(job.tables)} tables, "
          f"{costs.state_bytes / 1e9:.2f} GB of embedding state, step {costs.step_s:.3f} s without parity")
    print(f"failures: {failures.source}: job MTBF {failures.job_mtbf_hours(world):.2f} h (rank MTBF "
          f"{failures.rank_mtbf_hours:,.0f} h, machine MTBF {failures.machine_mtbf_hours:,.0f} h)")
    print(f"costs: save {costs.save_s:.2f} s, load {costs.load_s:.2f} s, restart {costs.restart_s:.2f} s, in process "
          f"{costs.in_process_s:.2f} s, decode {costs.decode_s:.3f} s x k, parity {costs.parity_capture:.1%} + "
          f"{costs.parity_commit:.1%} / N of a step x r ({', '.join(sorted(set(costs.sources.values())))})")
    print(plan.table())
    best = plan.best.candidate
    if best.strategy == "checkpoint":
        print(f"pick: checkpoints only, every {plan.best.checkpoint_every_steps} steps (parity: null)")
    else:
        print(f"pick: {best.label}; YAML: parity: {{k: {best.k}, r: {best.r}, commit_every_n_steps: "
              f"{best.commit_every}}}" + (f", launch --spares {best.spares}" if best.spares else ""))
    if args.plot is not None:
        curves = sweep(costs_at, failures, SWEEP_RANKS)
        write_plot(args.plot, curves, failures)
        print(f"plot: {args.plot}")
    return 0


def write_plot(path: Path, curves: dict[str, list[float]], failures: FailureModel) -> None:
    """Goodput of each strategy's best setting against the world size (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy, values in curves.items():
        ax.plot(SWEEP_RANKS, values, marker="o", label=strategy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("expected goodput (useful / wall time)")
    ax.set_title(f"best setting per strategy; failures: {failures.source}", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
