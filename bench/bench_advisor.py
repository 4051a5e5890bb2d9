"""The resource advisor on this machine: its model and recommendation against a measured grid, its runtime detectors,
and job completion time against a deliberately poor configuration.

Every number comes from real multi-process jobs of ``tests/scripts/advisor_job.py`` (the benchmark DLRM: 26
tables of ``--rows`` x 16 under ``DLRoverStrategy``, table-wise, gloo on CPU, Lightning's launcher):

1. **Grid.** One job per world size (ranks ``1..3``) sweeps every ``(threads per rank, data workers per rank,
   batch per rank)`` of the grid that does not put more threads than cores on the node (plus the poor
   configuration, which does) live, ``--repeats`` times in a different shuffled order per repeat (so slow
   drifts of the shared machine hit every configuration alike); each visit drops ``--settle`` steps and
   measures ``--measure`` steps (median and mean step time, max over ranks). The data workers are the
   ``DataLoader`` worker processes of the job's loader (0: batches are made in the training process).
2. **Noise floor and model error.** The floor is the mean absolute percentage difference between one visit of
   a configuration and the median of its other visits. The model (``PerformanceModel``) is fitted on the grid
   with a quarter of the configurations held out (4 folds) and its throughput error on the held-out visits is
   reported beside the floor, fitted on per-visit medians (the advisor's way) and on per-visit means.
3. **Recommendation.** A history gets one earlier advisor job per other world size (a typical configuration,
   its profiling window). Then a job starts at the poor configuration (3 ranks of 1 thread on 2 cores, 1 data
   worker each, batch 64: more processes than cores and a small batch), warm-starts from the history, profiles, and recommends; the recommendation's
   grid throughput is compared with the grid's best and with the poor configuration's.
4. **JCT.** ``--samples`` samples trained: (a) at the poor configuration without the advisor; (b) at the poor
   configuration with the advisor (``apply=True``, ``restart="stop"``): it applies live knobs and stops for a
   restart when the world size must change, and the benchmark restarts the job at the recommended
   configuration for the remaining samples (as an operator or a scheduler would); (c) at the grid's best
   configuration (the oracle). Wall time of every process tree, start-up included.
5. **Straggler delay.** 2 ranks; from step 15 rank 1 burns 40 ms of CPU per step; checks every 5 steps.
6. **OOM lead time.** 2 ranks keep 4 MiB more per step from step 5; the node's limit is its memory then plus
   320 MiB; steps and seconds between the first forecast and the step that crosses the limit.

    PYTHONPATH=. python bench/bench_advisor.py            # about 12 minutes on 2 shared cores
    PYTHONPATH=. python bench/bench_advisor.py --quick    # about 5 minutes: smaller grid, 2 repeats
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "scripts" / "advisor_job.py"
POOR = {"devices": 3, "threads": 1, "workers": 1, "batch": 64}


def launch(args: list[str], cwd: Path, timeout: int = 600) -> tuple[str, float]:
    """Runs one job (its own process group, killed on return); returns its output and wall seconds."""
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for key in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(JOB), *map(str, args)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    wall = time.perf_counter() - start
    name = Path(str(args[args.index("--root") + 1])).name if "--root" in args else "job"
    (cwd / f"{name}.log").write_text(f"$ {' '.join(map(str, args))}\nwall {wall:.2f} s\n{out}")
    if proc.returncode != 0:
        raise RuntimeError(f"job {args} exited {proc.returncode}:\n{out[-4000:]}")
    return out, wall


def events(root: Path) -> list[dict]:
    path = root / "dlrover_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in [header, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- grid
def run_grid(out: Path, ranks: list[int], threads: list[int], workers: list[int], batches: list[int], repeats: int,
             settle: int, measure: int, rows: int) -> list[dict]:
    visits = []
    cores = os.cpu_count() or 1
    for g in ranks:
        # more threads than cores make OpenMP spin (10-40x slower on this shared machine): left out
        configs = [(t, d, b) for t, d, b in itertools.product(threads, workers, batches) if t == 1 or g * t <= cores]
        if g == POOR["devices"]:
            configs.append((POOR["threads"], POOR["workers"], POOR["batch"]))
        configs = list(dict.fromkeys(configs))
        order = []
        for r in range(repeats):
            shuffled = configs[:]
            random.Random(1000 * g + r).shuffle(shuffled)
            order += shuffled
        path = out / f"grid_{g}.jsonl"
        path.unlink(missing_ok=True)
        sweep = ",".join(f"{t}:{d}:{b}" for t, d, b in order)
        _, wall = launch(["--devices", g, "--rows", rows, "--sweep", sweep, "--settle", settle, "--measure", measure,
                          "--out", path, "--root", out / f"grid_{g}"], out)
        found = [json.loads(line) for line in path.read_text().splitlines()]
        print(f"grid: {g} rank(s), {len(found)} visits in {wall:.0f} s", flush=True)
        visits += found
    return visits


def key(v: dict) -> tuple[int, int, int, int]:
    return v["nodes"] * v["ranks_per_node"], v["threads_per_rank"], v["data_workers"], v["batch_per_rank"]


def throughput(v: dict, stat: str = "median") -> float:
    step = v["step_s_median"] if stat == "median" else v["step_s"]
    return v["nodes"] * v["ranks_per_node"] * v["batch_per_rank"] / step


def by_config(visits: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for v in visits:
        out.setdefault(key(v), []).append(v)
    return out


def noise_floor(groups: dict[tuple, list[dict]]) -> tuple[float, float]:
    """Mean and median of |visit - median of the other visits| / visit, in percent (throughput, per-visit
    medians): the error of the best prediction that does not know the visit's own noise."""
    errors = []
    for vs in groups.values():
        for i, v in enumerate(vs):
            others = [throughput(o) for j, o in enumerate(vs) if j != i]
            if others:
                ref = statistics.median(others)
                errors.append(abs(throughput(v) - ref) / throughput(v))
    return 100 * statistics.mean(errors), 100 * statistics.median(errors)


def observations(visits: list[dict], shape, stat: str, cores: float, cores_mode: str = "measured"):
    from lightning_dlrover.advisor import Observation, ResourceConfig

    out = []
    for v in visits:
        config = ResourceConfig(v["nodes"], v["ranks_per_node"], v["threads_per_rank"], v["data_workers"],
                                v["batch_per_rank"])
        step = v["step_s_median"] if stat == "median" else v["step_s"]
        wait = v["data_wait_s_median"] if stat == "median" else v["data_wait_s"]
        available = v.get("cores_available", cores) if cores_mode == "measured" else cores
        out.append(Observation(config, shape, available, step, wait, v["rss_bytes"]))
    return out


def held_out_mape(groups: dict[tuple, list[dict]], shape, stat: str, cores: float, cores_mode: str,
                  folds: int = 4) -> tuple[float, float]:
    """Fit on 3/4 of the configurations, predict every visit of the others (4 folds); MAPE in percent against
    the per-visit median throughput. ``cores_mode``: ``measured`` gives the model the cores other programs left
    to each visit (as the advisor measures them while probing), ``machine`` the machine's cores. Returns the mean
    and the median absolute percentage error."""
    from lightning_dlrover.advisor import PerformanceModel

    configs = sorted(groups)
    random.Random(7).shuffle(configs)
    errors = []
    for f in range(folds):
        test = set(configs[f::folds])
        train = [v for c in configs if c not in test for v in groups[c]]
        model = PerformanceModel().fit(observations(train, shape, stat, cores, cores_mode))
        for c in test:
            for o, v in zip(observations(groups[c], shape, stat, cores, cores_mode), groups[c]):
                predicted = model.predict(o.config, shape, o.cores).samples_per_sec
                errors.append(abs(predicted - throughput(v)) / throughput(v))
    return 100 * statistics.mean(errors), 100 * statistics.median(errors)


def job_shape(rows: int, world_sizes: list[int]):
    from lightning_dlrover.advisor.resources import Machine
    from lightning_dlrover.advisor.signature import signature_of
    from lightning_dlrover.data.sources import NUM_SPARSE
    from lightning_dlrover.models import DLRMModule

    module = DLRMModule([rows] * NUM_SPARSE, embedding_dim=16, dense_arch_layer_sizes=[64, 16])
    return signature_of(module, 1, ("table_wise",), Machine.detect()).shape()


# ----------------------------------------------------------------------------------------------------- jobs
def advisor_args(history: Path, search: dict, profile: int, probe: int) -> list:
    return ["--advisor", "--history", history, "--profile-steps", profile, "--probe-steps", probe,
            "--search", json.dumps(search)]


def poor_args() -> list:
    return ["--devices", POOR["devices"], "--threads", POOR["threads"], "--workers", POOR["workers"],
            "--batch", POOR["batch"]]


def samples_done(out: str) -> tuple[int, float]:
    m = re.search(r"JOB_SAMPLES (\d+) seconds ([\d.]+)", out)
    return (int(m.group(1)), float(m.group(2))) if m else (0, 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="runs/bench_advisor")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--samples", type=int, default=None, help="samples per job of the JCT comparison")
    args = p.parse_args()
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)  # events files append: start from nothing
    out.mkdir(parents=True)
    ranks = [1, 2, 3]
    threads, workers = [1, 2], [0, 1]
    batches = [64, 512] if args.quick else [64, 256, 1024]
    repeats, settle, measure = (2, 2, 5) if args.quick else (3, 2, 6)
    samples = args.samples or (60_000 if args.quick else 200_000)
    search = {"threads_per_rank": threads, "data_workers": workers, "batch_per_rank": batches}
    began = time.perf_counter()

    # 1-2: grid, noise floor, held-out model error
    visits = run_grid(out, ranks, threads, workers, batches, repeats, settle, measure, args.rows)
    groups = by_config(visits)
    medians = {c: statistics.median(throughput(v) for v in vs) for c, vs in groups.items()}
    best = max(medians, key=medians.get)
    poor = (POOR["devices"], POOR["threads"], POOR["workers"], POOR["batch"])
    shape = job_shape(args.rows, ranks)
    cores = float(os.cpu_count() or 1)
    floor = noise_floor(groups)
    mape = {f"{stat}, {mode} cores": held_out_mape(groups, shape, stat, cores, mode)
            for stat in ("median", "mean") for mode in ("measured", "machine")}
    free = [v["cores_available"] for v in visits if "cores_available" in v]
    print("\nGrid (samples/s, median of visits; each visit the median of its steps)")
    rows = [[f"{c[0]}", f"{c[1]}", f"{c[2]}", f"{c[3]}", f"{medians[c]:.0f}",
             " ".join(f"{throughput(v):.0f}" for v in groups[c])] for c in sorted(groups)]
    print(table(["ranks", "threads", "workers", "batch", "samples/s", "visits"], rows))

    # 3: history from earlier jobs at the other world sizes; then the poor job with the advisor, cold (no history:
    # stage 2 only) and warm (stage 1 from the history, then stage 2), each finishing --samples samples (4b)
    history = out / "history.sqlite"
    history.unlink(missing_ok=True)
    profile, probe = (20, 5) if args.quick else (30, 6)
    for g in [r for r in ranks if r != POOR["devices"]]:
        launch(["--devices", g, "--batch", 256, "--steps", profile + 5, "--rows", args.rows,
                "--root", out / f"history_{g}", *advisor_args(history, search, profile, probe)], out)
    advised = {}
    for variant in ("cold", "warm"):
        root = out / f"advised_{variant}"
        db = history if variant == "warm" else out / "history_cold.sqlite"
        db.unlink(missing_ok=True) if variant == "cold" else None
        text, wall = launch([*poor_args(), "--rows", args.rows, "--root", root, "--samples", samples, "--apply",
                             "--restart", "stop", *advisor_args(db, search, profile, probe)], out)
        advice = [e for e in events(root) if e["kind"] == "advice"]
        restart = [e for e in events(root) if e["kind"] == "restart"]
        rec = advice[-1]["recommended"] if advice else None
        rec_key = poor if rec is None else (rec["nodes"] * rec["ranks_per_node"], rec["threads_per_rank"],
                                            rec["data_workers"], rec["batch_per_rank"])
        done, train_s = samples_done(text)
        restart_wall = 0.0
        if restart and restart[-1]["checkpoint"] and done < samples:  # relaunch at the recommendation, resumed
            text, restart_wall = launch(["--devices", rec["ranks_per_node"], "--threads", rec["threads_per_rank"],
                                      "--workers", rec["data_workers"], "--batch", rec["batch_per_rank"],
                                      "--rows", args.rows, "--root", out / f"advised_{variant}_restart",
                                      "--samples", samples - done, "--ckpt_path", restart[-1]["checkpoint"]], out)
            train_s += samples_done(text)[1]
        advised[variant] = {"rec": rec_key, "wall": wall + restart_wall, "train_s": train_s, "done": done, "restarted": restart_wall > 0,
                            "step": advice[-1]["step"] if advice else None,
                            "elapsed": advice[-1]["elapsed_s"] if advice else None,
                            "stage": advice[-1]["stage"] if advice else "kept", "gain": advice[-1]["predicted_gain"]
                            if advice else None}
        print(f"advisor ({variant}): {advised[variant]}", flush=True)

    # 4a, 4c: the poor configuration without the advisor, the grid's best
    text, manual_wall = launch([*poor_args(), "--rows", args.rows, "--root", out / "manual", "--samples", samples], out)
    manual_train = samples_done(text)[1]
    text, oracle_wall = launch(["--devices", best[0], "--threads", best[1], "--workers", best[2], "--batch", best[3],
                             "--rows", args.rows, "--root", out / "oracle", "--samples", samples], out)
    oracle_train = samples_done(text)[1]

    # 5: straggler
    root = out / "straggler"
    slow_out, _ = launch(["--devices", 2, "--advisor", "--profile-steps", 0, "--check-every", 5, "--steps", 40,
                          "--slow-rank", 1, "--slow-from", 15, "--slow-ms", 40, "--root", root], out)
    named = [e for e in events(root) if e["kind"] == "straggler"]
    slow_start = float(re.search(r"SLOW_START step=\d+ time=([\d.]+)", slow_out).group(1))
    # 6: OOM forecast
    root = out / "oom"
    leak_out, _ = launch(["--devices", 2, "--advisor", "--profile-steps", 0, "--check-every", 5, "--steps", 200,
                          "--leak-mb", 4, "--leak-from", 5, "--headroom-mb", 320, "--root", root], out)
    crossed = re.search(r"LEAK_CROSSED_LIMIT step=(\d+) time=([\d.]+)", leak_out)
    forecasts = [e for e in events(root) if e["kind"] == "oom_forecast"]

    grid_of = lambda c: medians.get(c, float("nan"))  # noqa: E731
    print(f"\nResource advisor on {cores:.0f} cores (load average {os.getloadavg()[0]:.1f}); "
          f"{len(groups)} configurations x {repeats} visits, {samples} samples per JCT job")
    rows = [
        ["grid best (oracle)", f"{best}", f"{medians[best]:.0f} samples/s", "1.00"],
        ["poor configuration", f"{poor}", f"{grid_of(poor):.0f} samples/s", f"{grid_of(poor) / medians[best]:.2f}"],
    ]
    same = max((c for c in medians if c[0] == poor[0]), key=medians.get)  # best at the job's own world size
    rows.append([f"grid best at {poor[0]} ranks", f"{same}", f"{medians[same]:.0f} samples/s",
                 f"{medians[same] / medians[best]:.2f}"])
    for variant, a in advised.items():
        value = grid_of(a["rec"])
        rows.append([f"advisor ({variant}) recommends", f"{a['rec']}", f"{value:.0f} samples/s",
                     f"{value / medians[best]:.2f} of best (target 0.95), {value / medians[same]:.2f} of best at "
                     f"{poor[0]} ranks; {value / grid_of(poor):.2f}x poor"])
        gain = f"predicted gain {a['gain']:.2f}x" if a["gain"] else ""
        rows.append([f"advisor ({variant}) decided", f"stage {a['stage']}, step {a['step']}",
                     f"{a['elapsed']:.1f} s after the first step" if a["elapsed"] is not None else "-", gain])
    rows += [
        ["noise floor (visit vs its other visits)", "mean / median APE", f"{floor[0]:.0f}% / {floor[1]:.0f}%",
         "model target: MAPE 15%"],
        *[[f"model, held-out ({name})", f"{len(groups) // 4} configs/fold", f"{value[0]:.0f}% / {value[1]:.0f}%",
           f"{value[0] / floor[0]:.2f}x / {value[1] / floor[1]:.2f}x the floor"] for name, value in mape.items()],
        ["cores left to the job (measured)", f"{len(free)} visits", f"median {statistics.median(free):.2f}"
         if free else "-", f"min {min(free):.2f}, max {max(free):.2f}" if free else ""],
        ["JCT manual (poor)", f"training {manual_train:.1f} s", f"{manual_wall:.1f} s", "1.00"],
        ["JCT oracle (grid best)", f"training {oracle_train:.1f} s", f"{oracle_wall:.1f} s",
         f"{oracle_wall / manual_wall - 1:+.0%} vs manual"],
    ]
    for variant, a in advised.items():
        how = f"{a['done']} samples, then restarted from its checkpoint" if a["restarted"] else "live changes only"
        rows.append([f"JCT advisor ({variant})", f"{how}; training {a['train_s']:.1f} s", f"{a['wall']:.1f} s",
                     f"{a['wall'] / manual_wall - 1:+.0%} vs manual (DLRover-RM: -31%); training "
                     f"{a['train_s'] / manual_train - 1:+.0%}"])
    if named:
        first = named[0]
        rows.append(["straggler named", f"rank {first['straggler_rank']} ({first['cause']})",
                     f"{first['step'] - 15} steps, {first['time'] - slow_start:.1f} s after the slow-down",
                     f"ratio {first['ratio']:.2f}"])
    else:
        rows.append(["straggler named", "no", "-", "-"])
    if forecasts and crossed:
        lead_steps = int(crossed.group(1)) - forecasts[0]["step"]
        lead_s = float(crossed.group(2)) - forecasts[0]["time"]
        rows.append(["OOM forecast lead", f"first at step {forecasts[0]['step']}",
                     f"{lead_steps} steps, {lead_s:.1f} s before the limit",
                     f"forecast {forecasts[0]['steps_to_oom']:.0f} steps to OOM"])
    else:
        rows.append(["OOM forecast lead", "no forecast" if not forecasts else "limit not reached", "-", "-"])
    print(table(["measure", "configuration (ranks, threads, workers, batch)", "value", "ratio / note"], rows))
    result = {"grid": {str(c): medians[c] for c in sorted(groups)}, "best": best, "poor": poor,
              "advised": advised, "floor_pct": floor, "mape_pct": mape,
              "jct_s": {"manual": manual_wall, "oracle": oracle_wall},
              "train_s": {"manual": manual_train, "oracle": oracle_train},
              "straggler": named[:1], "oom": forecasts[:1], "seconds": time.perf_counter() - began}
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"\nbenchmark took {time.perf_counter() - began:.0f} s; details in {out / 'result.json'}")


if __name__ == "__main__":
    main()
