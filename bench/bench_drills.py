"""Kill-rate drills for every mode (issue #29): the packaged chaos job, N random SIGKILLs of a rank, the same kill
sequence for each mode (drawn from the seed), against a fault-free run of the same mode.

Modes: ``launch`` with parity k1 r1 and ``--spares`` hot spares (recovery in process); ``torchrun`` with parity
(restart, decode from the survivors' spills); ``torchrun`` without parity (restart from the last checkpoint);
optionally (``--modes in-process-exec``) ``launch --no-zygote``: every worker a fresh interpreter that imports torch,
TorchRec and Lightning itself, as before the launcher forked its workers from a warm zygote.
The job: ``cli/configs/chaos.yaml`` on 1 node x 2 ranks, ``--steps`` steps, a ``ModelCheckpoint`` every ``--every``
steps, per-step digests on (the drills compare states and time their kills with them). Each kill lands a random
0..``--jitter`` s after the job committed a step past the previous recovery (``chaos --kills``).

Columns: wall times from the first process's start to the last one's exit (seconds; a range over the seeds);
``goodput`` the mode's own fault-free wall over the wall with kills; ``vs torchrun`` the fault-free wall of
``torchrun`` with parity over the wall with kills; recoveries by kind, steps lost (summed over the kills), and
whether every run's final digest equals the fault-free one.

    PYTHONPATH=. python bench/bench_drills.py                       # the issue's table: 3 seeds, ~30-60 min
    PYTHONPATH=. python bench/bench_drills.py --seeds 1             # one seed
    PYTHONPATH=. python bench/bench_drills.py --steps 200 --every 50 --jitter 10 --seeds 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from lightning_dlrover.cli.chaos import DEFAULT_CONFIG
from lightning_dlrover.monitor.events import read_events

MODES = {
    "launch, parity k1 r1, hot spares (in process)": ["--in-process"],
    "launch --no-zygote, parity k1 r1, hot spares (in process, every worker a fresh interpreter)": ["--in-process"],
    "torchrun, parity k1 r1 (restart, decode from spills)": [],
    "torchrun, no parity (restart from the last checkpoint)": ["--no-parity"],
}


def job_config(steps: int, every: int, directory: Path) -> Path:
    """The packaged chaos job with ``steps`` steps and a checkpoint every ``every`` steps."""
    config = yaml.safe_load(Path(str(DEFAULT_CONFIG)).read_text())
    config["trainer"]["max_steps"] = steps
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"]["every_n_train_steps"] = every
    config["data"]["train_batches"] = max(config["data"]["train_batches"], steps)
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def drill(mode: list[str], seed: int, args: argparse.Namespace, config: Path, workdir: Path,
          exec_only: bool = False) -> dict:
    """One ``chaos --kills`` drill (its fault-free run is made once per mode and reused); its ``--json`` facts."""
    out = workdir / f"seed{seed}.json"
    command = [sys.executable, "-m", "lightning_dlrover", "chaos", "--config", str(config), "--nodes", "1",
               "--nproc-per-node", "2", "--spares", str(args.spares), "--kills", str(args.kills),
               "--kill-jitter", str(args.jitter), "--seed", str(seed), "--workdir", str(workdir), "--reuse-reference",
               "--timeout", str(args.timeout), "--json", str(out), *mode]
    env = dict(os.environ, **({"LIGHTNING_DLROVER_NO_ZYGOTE": "1"} if exec_only else {}))
    with open(workdir / f"seed{seed}.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=3 * args.timeout,
                              env=env).returncode
    if not out.is_file():
        sys.exit(f"the drill {' '.join(command)} wrote no report (exit {code}); see {workdir / f'seed{seed}.log'}")
    return {**json.loads(out.read_text()), **breakdown(workdir / "faulted" / "events.jsonl")}


def breakdown(events_file: Path) -> dict:
    """Where a drill's time went, from its events: the recoveries (each kill to the next ``resumed``), the hot spares'
    set-up (``spares_started`` to each spare's ``spare_ready``: at idle priority beside the training ranks), and the
    replacements' readiness at each kill."""
    events = read_events([events_file]) if events_file.is_file() else []
    kills = [e.time for e in events if e.kind == "fault_injected"]
    resumed = [e.time for e in events if e.kind == "resumed"]
    recoveries = [min((r for r in resumed if r > k), default=k) - k for k in kills]
    ready = sorted(e.time for e in events if e.kind == "spare_ready")
    setups = []
    for started in (e for e in events if e.kind == "spares_started"):
        ends = [t for t in ready if t >= started.time][:len(started.fields["spares"])]
        setups += [t - started.time for t in ends]
    readiness = [v for e in events if e.kind == "replacement_planned" for v in e.fields.get("readiness", {}).values()]
    return {"recovery_s": [round(x, 2) for x in recoveries], "spare_setup_s": [round(x, 2) for x in setups],
            "readiness": readiness}


def span(values: list[float], fmt: str) -> str:
    low, high = min(values), max(values)
    return format(low, fmt) if format(low, fmt) == format(high, fmt) else f"{low:{fmt}}-{high:{fmt}}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, the same kill sequence for every mode")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--jitter", type=float, default=40.0, help="seconds: each kill 0..this after a commit")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=150, help="ModelCheckpoint(every_n_train_steps)")
    p.add_argument("--spares", type=int, default=3, help="hot spares of the in-process mode")
    p.add_argument("--timeout", type=int, default=900, help="seconds each run may take")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--modes", default="in-process,torchrun,no-parity",
                   help="which modes to drill, of in-process, in-process-exec (launch --no-zygote), torchrun, "
                        "no-parity (comma-separated)")
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed..first-seed+seeds-1")
    args = p.parse_args()
    keys = dict(zip(["in-process", "in-process-exec", "torchrun", "no-parity"], MODES))
    if unknown := set(args.modes.split(",")) - set(keys):
        p.error(f"--modes: unknown {sorted(unknown)}; choose from {list(keys)}")
    chosen = {keys[k]: MODES[keys[k]] for k in keys if k in args.modes.split(",")}
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench_drills-"))
    root.mkdir(parents=True, exist_ok=True)
    config = job_config(args.steps, args.every, root)
    results: dict[str, list[dict]] = {}
    for name, mode in chosen.items():
        exec_only = name == list(MODES)[1]
        workdir = root / ("in-process-exec" if exec_only else mode[0].strip("-") if mode else "torchrun")
        workdir.mkdir(exist_ok=True)
        results[name] = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            load = os.getloadavg()[0]
            facts = drill(mode, seed, args, config, workdir, exec_only)
            facts["load"] = (load, os.getloadavg()[0])  # 1-minute load average at the drill's start and end
            results[name].append(facts)
            print(f"{name}, seed {seed}: wall {facts['wall_s']}, fault-free wall {facts['fault_free_wall_s']}, goodput "
                  f"{facts['goodput']}, kills landed {facts['kills_landed']}, recoveries {facts['recoveries']}, steps "
                  f"lost {facts['steps_lost']}, digest match {facts['digest_match']}, load {load:.1f} -> "
                  f"{facts['load'][1]:.1f}; kill to resumed {facts['recovery_s']} s (readiness {facts['readiness']}), "
                  f"spares' set-up {facts['spare_setup_s']} s", flush=True)
    (root / "results.json").write_text(json.dumps(results, indent=1))
    torchrun = results[list(MODES)[2]][0]["fault_free_wall_s"] if list(MODES)[2] in results else None
    print(f"\n{args.steps} steps, a checkpoint every {args.every}, {args.kills} kills at U(0, {args.jitter}) s after a "
          f"commit, seeds {args.first_seed}..{args.first_seed + args.seeds - 1}; results in {root}\n")
    loads = [x for runs in results.values() for r in runs for x in r["load"]]
    print(f"1-minute load average over the drills: {min(loads):.1f}-{max(loads):.1f}\n")
    print("| mode | fault-free wall | wall with kills | goodput vs own fault-free | goodput vs torchrun fault-free | "
          "recoveries | steps lost | kills landed | digest |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        done = [r for r in runs if r["wall_s"]]
        walls = [r["wall_s"] for r in done]
        kinds: dict[str, int] = {}
        for r in runs:
            for kind, count in r["recoveries"].items():
                kinds[kind] = kinds.get(kind, 0) + count
        lost = [r["steps_lost"] for r in runs if r["steps_lost"] is not None]
        print(f"| {name} | {runs[0]['fault_free_wall_s']:.1f} s | {span(walls, '.1f') + ' s' if walls else 'not finished'} | "
              f"{span([r['goodput'] for r in done], '.2f') if done else '-'} | "
              f"{span([torchrun / w for w in walls], '.2f') if walls and torchrun else '-'} | "
              f"{', '.join(f'{k} {v}' for k, v in kinds.items() if v) or 'none'} | "
              f"{span(lost, 'd') if lost else 'unknown'} | {sum(r['kills_landed'] for r in runs)}/{args.kills * len(runs)} | "
              f"{'equal' if all(r['digest_match'] for r in runs) else 'DIFFERS'} |")
    launch = results.get(list(MODES)[0])
    if launch and torchrun:
        print(f"\nlaunch's fault-free wall / torchrun's: {launch[0]['fault_free_wall_s'] / torchrun:.3f}")


if __name__ == "__main__":
    main()
