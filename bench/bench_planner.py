"""The fault-tolerance planner against real drills: measured goodput under random SIGKILLs vs the planner's prediction.

For each mode (checkpoints only, parity with restart recovery, parity in process with a hot spare) and kill rate,
runs ``lightning-dlrover chaos --kills K --kill-rate R`` (a Poisson schedule of SIGKILLs of random ranks, 2 ranks,
the chaos config's DLRM) and reads its JSON report: the drill's wall time, the fault-free wall time of the same mode
and the kills that landed. The measured goodput is the drill's (fault-free wall / wall: the fault-free run of the
same mode is the reference, so parity's per-step cost and the checkpoint saves are in both and only the failures
are measured). The prediction is the planner's for the same job, mode and rate: ``estimate`` of the candidate
(``checkpoint`` at the config's interval, ``parity-restart k1 r1 N1``, ``parity-in-process k1 r1 N1 S1``) with
the costs the planner would use: the step time of the fault-free run, the state from the config, and the recovery
times "from the events of earlier runs": each drill's clean recoveries (a kill to the next ``resumed`` event, no
other kill between) calibrate the *other* drills (leave-one-out: a torchrun restart from the other torchrun mode's
drill, an in-process takeover from other in-process drills, else ``MEASURED_HERE``) and, under ``launch``, the
spare's start at idle priority (the fault-free run's ``spares_started`` to ``spare_ready``) and once promoted (the
drills' ``replacement_planned`` to ``spare_ready``), as ``G(rate) / G(0)``, at the kill rate the drills realised
(kills landed over their wall time, every drill pooled: one the job outran counts with the kills it got) and at the
nominal one, with the load average beside. Within 15% is the target.

    PYTHONPATH=. python bench/bench_planner.py --rates 4 --kills 3 --steps 600 --seeds 1 2   # ~30 min on 2 cores

It needs ``chaos --kills`` with ``--kill-rate`` and ``--json`` (issue #23's drills); ``--chaos-path`` runs the
chaos command of another checkout (its ``PYTHONPATH``), the planner stays this one's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from lightning_dlrover.monitor.events import read_events
from lightning_dlrover.planner import MEASURED_HERE, Candidate, FailureModel, JobCosts, estimate
from lightning_dlrover.planner.job import OPTIMIZER_BYTES_PER_ROW

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "checkpoint": (Candidate("checkpoint"), ["--no-parity"]),
    "parity-restart": (Candidate("parity-restart", 1, 1, 1), []),
    "parity-in-process": (Candidate("parity-in-process", 1, 1, 1, 1), ["--in-process", "--spares", "1"]),
}
RANKS = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0], help="kills per minute (default: 4)")
    parser.add_argument("--kills", type=int, default=3, help="kills per drill (default: 3)")
    parser.add_argument("--steps", type=int, default=400, help="training steps of the job (default: 400)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1],
                        help="kill sequences per mode and rate; pooled (kills and walls summed) in the table")
    parser.add_argument("--config", type=Path, default=None, help="the chaos job's config (default: chaos's own)")
    parser.add_argument("--chaos-path", default=None, help="PYTHONPATH of the checkout whose chaos command runs")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench_planner"))
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--reuse", action="store_true", help="reuse the drills' JSON reports already in --workdir")
    return parser.parse_args()


def chaos_config(args: argparse.Namespace) -> dict:
    root = Path(args.chaos_path) if args.chaos_path else REPO
    path = args.config or root / "lightning_dlrover" / "cli" / "configs" / "chaos.yaml"
    return yaml.safe_load(path.read_text())


def drill(args: argparse.Namespace, mode: str, rate: float, seed: int) -> dict:
    """One ``chaos --kills`` drill (the fault-free run shared by the seeds of a mode and rate); its JSON facts, and
    its events kept beside them."""
    name = f"{mode}-{rate:g}" + (f"-seed{seed}" if seed != 1 else "")
    out = args.workdir / f"{name}.json"
    if args.reuse and out.is_file():
        return {**json.loads(out.read_text()), "bench_s": 0.0, "name": name}
    command = [sys.executable, "-m", "lightning_dlrover", "chaos", "--nodes", "1", "--nproc-per-node", str(RANKS),
               "--kills", str(args.kills), "--kill-rate", str(rate), "--seed", str(seed), "--json", str(out),
               "--reuse-reference",
               "--workdir", str(args.workdir / f"{mode}-{rate:g}"), "--timeout", str(args.timeout),
               *MODES[mode][1], f"--trainer.max_steps={args.steps}"]
    env = dict(os.environ)
    if args.chaos_path:
        env["PYTHONPATH"] = args.chaos_path
    start, load = time.perf_counter(), os.getloadavg()[0]
    # python -m puts the working directory first on sys.path: run from the chaos checkout
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3 * args.timeout,
                          cwd=args.chaos_path or REPO)
    if not out.is_file():
        sys.stderr.write(done.stdout[-6000:] + done.stderr[-6000:])
        raise RuntimeError(f"drill {mode} at {rate}/min wrote no report (exit {done.returncode}); its output is above")
    facts = json.loads(out.read_text())
    facts["bench_s"], facts["name"] = time.perf_counter() - start, name
    facts["load"] = [load, os.getloadavg()[0]]  # 1-minute load average (uptime) at the drill's start and end
    faulted = args.workdir / f"{mode}-{rate:g}" / "faulted" / "events.jsonl"
    (args.workdir / f"{name}.events.jsonl").write_bytes(faulted.read_bytes())  # the next seed's drill replaces it
    reference = args.workdir / f"{mode}-{rate:g}" / "reference" / "events.jsonl"
    if reference.is_file():
        (args.workdir / f"{name}.reference.events.jsonl").write_bytes(reference.read_bytes())
    out.write_text(json.dumps(facts))
    return facts


def recovery_times(args: argparse.Namespace, name: str) -> list[tuple[str, float]]:
    """``(kind, seconds)`` from each kill of a drill to the next ``resumed`` event, for the kills no other kill
    followed first: ``in_process_s`` when a rank recovered in process in between, else a restart of every worker
    (``launch_restart_s`` under ``launch``, ``restart_s`` under ``torchrun``). None without the drill's events."""
    events = read_events([args.workdir / f"{name}.events.jsonl"])
    kills = [e.time for e in events if e.kind == "fault_injected"]
    resumed = [e.time for e in events if e.kind == "resumed"]
    in_process = [e.time for e in events if e.kind == "recovered_in_process"]
    out = []
    for i, kill in enumerate(kills):
        back = next((t for t in resumed if t > kill), None)
        if back is not None and (i + 1 == len(kills) or kills[i + 1] > back):
            restart = "launch_restart_s" if name.startswith("parity-in-process") else "restart_s"
            kind = restart
            if any(kill < t <= back for t in in_process):  # a spare still starting at the kill: it waited for it
                kind = "in_process_s" if spare_ready_at(events, kill) else "in_process_wait_s"
            out.append((kind, back - kill))
    return out


def spare_ready_at(events: list, moment: float) -> bool:
    """Whether a hot spare had finished starting at ``moment``: a ``spare_ready`` after the newest ``spares_started``."""
    started = max((e.time for e in events if e.kind == "spares_started" and e.time < moment), default=None)
    return started is not None and any(started < e.time < moment for e in events if e.kind == "spare_ready")


def spare_starts(args: argparse.Namespace, name: str) -> tuple[list[float], list[float]]:
    """A spare's start: at idle priority (``spares_started`` to ``spare_ready`` in the drill's fault-free run; the run's
    wall, ``inf``, when the spare never became ready in it) and at normal priority (in the drill, ``replacement_planned``
    to ``spare_ready`` where the launcher promoted a spare still starting)."""
    idle, promoted = [], []
    path = args.workdir / f"{name}.reference.events.jsonl"
    if path.is_file():
        events = read_events([path])
        ready = [e.time for e in events if e.kind == "spare_ready"]
        for start in (e.time for e in events if e.kind == "spares_started"):
            up = next((t for t in ready if t > start), None)
            idle.append(up - start if up is not None else float("inf"))
    path = args.workdir / f"{name}.events.jsonl"
    if path.is_file():
        events = read_events([path])
        ready = [e.time for e in events if e.kind == "spare_ready"]
        for plan in (e.time for e in events if e.kind == "replacement_planned"):
            if not spare_ready_at(events, plan):
                up = next((t for t in ready if t > plan), None)
                restarted = any(plan < e.time < (up or plan) for e in events if e.kind == "restarting_all")
                if up is not None and not restarted:
                    promoted.append(up - plan)
    return idle, promoted


def downtime(args: argparse.Namespace, name: str) -> float:
    """Seconds a drill did not train: the union of the windows from each kill to the next ``resumed`` event."""
    events = read_events([args.workdir / f"{name}.events.jsonl"])
    resumed = [e.time for e in events if e.kind == "resumed"]
    total, until = 0.0, -1.0
    for kill in sorted(e.time for e in events if e.kind == "fault_injected"):
        back = next((t for t in resumed if t > kill), events[-1].time)
        start = max(kill, until)
        total += max(back - start, 0.0)
        until = max(until, back)
    return total


def events_goodput(args: argparse.Namespace, facts: dict) -> float | None:
    """The drill's goodput from its own events, immune to a load that changed since its fault-free run: wall time
    less the time it did not train and the steps it trained again (at its own step time), over wall time. None when
    its events were not kept."""
    if not (args.workdir / f"{facts['name']}.events.jsonl").is_file():
        return None
    down = downtime(args, facts["name"])
    lost = facts["steps_lost"] or 0
    step = (facts["wall_s"] - down) / (args.steps + lost)
    return (facts["wall_s"] - down - lost * step) / facts["wall_s"]


def calibrated(mode: str, rate: float, times: dict[tuple[str, float], list[tuple[str, float]]],
               spares: dict[tuple[str, float], tuple[list[float], list[float]]]) -> tuple[dict[str, float], str]:
    """The recovery costs the planner uses for a drill: a restart of every worker (``restart_s``) and an in-process
    takeover (``in_process_s``), each the median of the *other* drills' clean recoveries of that kind, else the
    default measured here; and where each came from."""
    out, notes = {}, []
    restarts = ("launch_restart_s", "restart_s") if mode == "parity-in-process" else ("restart_s", "launch_restart_s")
    for key, kinds in (("restart_s", restarts), ("in_process_s", ("in_process_s",))):
        for kind in kinds:
            others = [t for drill_key, found in times.items() if drill_key != (mode, rate) for k, t in found if k == kind]
            if others:
                out[key] = statistics.median(others)
                notes.append(f"{key} {out[key]:.1f} s ({len(others)} {kind[:-2]} recoveries of other drills)")
                break
        else:
            out[key] = MEASURED_HERE[key]
            notes.append(f"{key} {out[key]:.1f} s (default)")
    if mode == "parity-in-process":  # launch re-spawns a used spare at once: it is up after its start
        idle = [t for drill_key, (found, _) in spares.items() if drill_key[0] == mode for t in found]
        promoted = [t for drill_key, (_, found) in spares.items() if drill_key[0] == mode for t in found]
        out["spare_start_s"] = statistics.median(promoted) if promoted else 15.0
        out["spare_idle_start_s"] = statistics.median(idle) if idle else None
        notes.append(f"spare_start_s {out['spare_start_s']:.1f} s ("
                     + (f"{len(promoted)} promoted spare start(s) in the drills)" if promoted else "assumed)")
                     + ", spare_idle_start_s " + ("as spare_start_s" if not idle else f"{out['spare_idle_start_s']:.1f} s"
                     + f" ({len(idle)} idle start(s) of the fault-free runs: "
                     + "/".join(f"{t:.1f}" if t != float("inf") else "never ready" for t in idle) + ")"))
    return out, ", ".join(notes)


def predict(mode: str, rate_per_min: float, facts: dict, config: dict, args: argparse.Namespace,
            recovery: dict[str, float]) -> float:
    """The planner's goodput of ``mode`` at ``rate_per_min`` relative to the same job without failures."""
    model = config["model"]
    state = sum(r * (model["embedding_dim"] * 4 + OPTIMIZER_BYTES_PER_ROW) for r in model["num_embeddings_per_feature"])
    step_s = facts["fault_free_wall_s"] / args.steps  # an upper bound: the fault-free wall includes the start-up
    # launch re-spawns a used spare at once (recovery["spare_start_s"]: a process start), not a machine replacement
    costs = JobCosts.estimate(step_s, state, RANKS, RANKS, launch_overhead=0.0, **recovery)
    candidate = MODES[mode][0]
    callbacks = config["trainer"].get("callbacks") or []  # the config's checkpoints: every mode's fallback
    steps = next((c["init_args"].get("every_n_train_steps") for c in callbacks
                  if c["class_path"].endswith("ModelCheckpoint")), None)
    every = steps * step_s if steps else None

    def goodput(rate: float) -> float:
        failures = FailureModel.from_job_mtbf(1.0 / (60.0 * rate), RANKS, RANKS, machine_share=0.0) if rate else \
            FailureModel(rank_mtbf_hours=1e12, ranks_per_machine=RANKS)
        return estimate(candidate, costs, failures, RANKS, checkpoint_every_s=every).goodput

    return goodput(rate_per_min) / goodput(0.0)


def main() -> None:
    args = parse_args()
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    config = chaos_config(args)
    drills: dict[tuple[str, float], list[dict]] = {}
    for mode in args.modes:
        for rate in args.rates:
            for seed in args.seeds:
                facts = drill(args, mode, rate, seed)
                drills.setdefault((mode, rate), []).append(facts)
                print(f"{mode} at {rate:g}/min, seed {seed}: {facts['kills_landed']} kills landed, goodput "
                      f"{facts['goodput']:.3f} ({facts['bench_s']:.0f} s)", file=sys.stderr, flush=True)
    times = {key: [t for f in runs for t in recovery_times(args, f["name"])] for key, runs in drills.items()}
    spares = {key: tuple([t for f in runs for t in spare_starts(args, f["name"])[i]] for i in (0, 1))
              for key, runs in drills.items()}
    rows = []
    for (mode, rate), every in drills.items():
        # every drill counts: one the job outran (it ended before its last kills) observed its wall with fewer kills,
        # which the realised rate (kills landed / wall, pooled) says; left out it would bias the rate up
        runs = every
        if not any(f["kills_landed"] for f in runs):
            print(f"  {mode} at {rate:g}/min: no drill had a kill land; give more --steps", file=sys.stderr)
            continue
        landed, wall = sum(f["kills_landed"] for f in runs), sum(f["wall_s"] for f in runs)
        ref = sum(f["fault_free_wall_s"] for f in runs)
        realised = 60.0 * landed / wall if wall else 0.0
        recovery, source = calibrated(mode, rate, times, spares)
        pooled = {"fault_free_wall_s": ref / len(runs)}
        kept = [(events_goodput(args, f), f["wall_s"]) for f in runs]
        kept = [(g, w) for g, w in kept if g is not None]
        by_events = sum(g * w for g, w in kept) / sum(w for _, w in kept) if kept else float("nan")
        loads = [x for f in runs for x in f.get("load", [])]
        rows.append((mode, rate, landed, wall, ref, ref / wall, by_events, statistics.mean(loads) if loads else float("nan"),
                     predict(mode, realised, pooled, config, args, recovery),
                     predict(mode, rate, pooled, config, args, recovery),
                     f"{len(runs)} drill(s), kills landed each " + "/".join(
                         f"{f['kills_landed']} of {args.kills}" for f in runs)
                     + f" ({len(kept)} with events), load " + "/".join(
                         "{:.1f}-{:.1f}".format(*f["load"]) for f in runs if "load" in f)
                     + ", ref/wall each " + "/".join(f"{f['goodput']:.3f}" for f in runs)
                     + f"; {source}; own clean recoveries " + "/".join(f"{k[:-2]} {t:.1f}" for k, t in times[mode, rate])))
    header = (f"{'mode':<19}{'rate/min':>9}{'kills':>6}{'wall s':>8}{'ref s':>7}{'ref/wall':>9}{'events':>8}"
              f"{'predicted':>10}{'error':>7}{'at nominal':>11}{'load':>6}  within 15%")
    print(header)
    print("-" * len(header))
    for mode, rate, landed, wall, ref, by_ref, measured, load, predicted, nominal, note in rows:
        error = predicted / measured - 1 if measured else float("nan")
        print(f"{mode:<19}{rate:>9g}{landed:>6}{wall:>8.1f}{ref:>7.1f}{by_ref:>9.3f}{measured:>8.3f}{predicted:>10.3f}"
              f"{error:>+7.1%}{nominal:>11.3f}{load:>6.1f}  {'yes' if abs(error) <= 0.15 else 'NO'}")
    for mode, rate, *_, note in rows:
        print(f"  {mode} at {rate:g}/min: {note}")
    print("ref/wall: fault-free wall of the same mode / the drill's wall (chaos --kills --json; off when the load "
          "changed between the two runs); events: the drill's own (wall - time from each kill to the next resumed - "
          "steps trained again) / wall; error: predicted against events. predicted: the "
          "planner's G(rate) / G(0) for the mode's candidate at the realised rate (kills landed / wall), recovery "
          "times from the other drills' events (leave-one-out), the step from the fault-free run; at nominal: at "
          "--rates. load: the 1-minute load average (uptime) at the drills' starts and ends, averaged (2 cores).")


if __name__ == "__main__":
    main()
