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

from lightning_dlrover.planner import FailureModel, sweep
from lightning_dlrover.planner.costs import SAVE_MODES
from lightning_dlrover.planner.inputs import Pick, PlanInputs, plan_inputs
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
    parser.add_argument("--save-mode", choices=SAVE_MODES, default=None,
                        help="how the job saves checkpoints (default: the config's async_checkpoint and "
                             "incremental_checkpoint_every); every mode's pick is printed beside")
    parser.add_argument("--sweep-saves", action="store_true",
                        help="print the pick's checkpoint interval and goodput at 8-4096 ranks per save mode")
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
        inputs = plan_inputs(job, args.ranks, args.ranks_per_machine, args.history, args.mtbf_hours,
                             args.machine_share, args.step_s, args.save_mode)
        plan = inputs.plan()
        by_mode = {mode: inputs.plan(save_mode=mode) for mode in SAVE_MODES}
    except ValueError as err:
        print(f"lightning-dlrover plan: error: {err}", file=sys.stderr)
        return 2
    world, failures, costs = inputs.world, inputs.failures, plan.costs
    print(f"plan for {args.config}: {world} ranks ({inputs.per_machine} per machine), {len(job.tables)} tables, "
          f"{costs.state_bytes / 1e9:.2f} GB of embedding state, step {costs.step_s:.3f} s without parity")
    print(f"failures: {failures.source}: job MTBF {failures.job_mtbf_hours(world):.2f} h (rank MTBF "
          f"{failures.rank_mtbf_hours:,.0f} h, machine MTBF {failures.machine_mtbf_hours:,.0f} h)")
    print(f"costs: save {costs.save_s:.2f} s ({inputs.save_mode}: blocked per save; committed {costs.save_lag_s:.2f} "
          f"s later), load {costs.load_s:.2f} s, restart {costs.restart_s:.2f} s, in process "
          f"{costs.in_process_s:.2f} s, decode {costs.decode_s:.3f} s x k, parity {costs.parity_capture:.1%} + "
          f"{costs.parity_commit:.1%} / N of a step x r ({', '.join(sorted(set(costs.sources.values())))})")
    print(plan.table())
    pick = Pick.of(plan.best)
    every = (f"checkpoint every {pick.checkpoint_every_steps} steps ({_every(pick.checkpoint_every_s)})"
             if pick.checkpoint_every_steps else "no periodic checkpoint needed")
    if pick.parity is None:
        print(f"pick: checkpoints only, {every} (parity: null); launch --spares 0")
    else:
        print(f"pick: {plan.best.candidate.label}; YAML: parity: {{k: {pick.parity['k']}, r: {pick.parity['r']}, "
              f"commit_every_n_steps: {pick.parity['commit_every_n_steps']}}}; {every}; launch --spares "
              f"{pick.spares}" + ("" if pick.spares else " (the pick does not recover in process)"))
    print(save_modes_table(by_mode, inputs))
    if args.sweep_saves:
        print(sweep_saves(inputs))
    if args.plot is not None:
        curves = sweep(inputs.costs_at, failures, SWEEP_RANKS)
        extra = {f"checkpoint ({mode} saves)": sweep(lambda n, m=mode: inputs.costs_at(n, m), failures, SWEEP_RANKS,
                                                     ("checkpoint",))["checkpoint"]
                 for mode in ("async", "async+incremental") if mode != inputs.save_mode}
        write_plot(args.plot, {**curves, **extra}, failures)
        print(f"plot: {args.plot}")
    return 0


def _every(seconds: float) -> str:
    return "-" if math.isinf(seconds) else (f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min")


def save_modes_table(by_mode: dict, inputs: PlanInputs) -> str:
    """The pick of each save mode at the plan's world size: what a save blocks, its interval and goodput."""
    lines = [f"by save mode at {inputs.world} ranks (costs: the history's saves of that mode, else bench_checkpoint's "
             "measured here):",
             f"  {'save mode':<18}{'blocked s':>10}{'lag s':>8}{'source':>10}  {'pick':<36}{'ckpt every':>11}"
             f"{'steps':>8}{'goodput':>9}{'ckpt only':>10}"]
    for mode, plan in by_mode.items():
        pick, costs = Pick.of(plan.best), plan.costs
        only = plan.best_of("checkpoint")
        mark = "  <- the job's" if mode == inputs.save_mode else ""
        lines.append(f"  {mode:<18}{costs.save_s:>10.3f}{costs.save_lag_s:>8.2f}{costs.sources['save_s']:>10}  "
                     f"{plan.best.candidate.label:<36}{_every(pick.checkpoint_every_s):>11}"
                     f"{pick.checkpoint_every_steps or '-':>8}{plan.best.goodput:>9.4f}{only.goodput:>10.4f}{mark}")
    return "\n".join(lines)


def sweep_saves(inputs: PlanInputs) -> str:
    """The pick's checkpoint interval (steps) and goodput at 8-4096 ranks, per save mode."""
    modes = ("blocking", "async", "async+incremental")
    head = f"{'ranks':>6}{'job MTBF h':>11}" + "".join(f"{m + ' every':>24}{'goodput':>9}" for m in modes) + "  pick"
    lines = ["pick's checkpoint interval and goodput against ranks, per save mode (weak scaling):", head]
    for ranks in SWEEP_RANKS:
        row, picks = f"{ranks:>6}{inputs.failures.job_mtbf_hours(ranks):>11.1f}", []
        for mode in modes:
            plan = inputs.plan(ranks, mode)
            pick = Pick.of(plan.best)
            every = f"{pick.checkpoint_every_steps} ({_every(pick.checkpoint_every_s)})" \
                if pick.checkpoint_every_steps else "-"
            row += f"{every:>24}{plan.best.goodput:>9.4f}"
            picks.append(plan.best.candidate.strategy)
        lines.append(row + "  " + "/".join(dict.fromkeys(picks)))
    return "\n".join(lines)


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
