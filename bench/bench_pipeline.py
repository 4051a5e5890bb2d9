"""Criteo TSV ingestion: today's in-process loader, fixed heuristics, a tf.data-AUTOTUNE-like hill climber, the
RL PipelineTuner and an offline grid search (the oracle), side by side in one harness.

Data: generated Criteo-format day files (``lightning_dlrover.data.generate``; ``--size-mb`` per file, made once
under ``--data``). Every variant reads the same files from the same position; batches are identical across
variants (tested in tests/data/test_staged.py), so only speed and memory differ.

1. **Ingestion only** (one process, nothing consumes the batches): each variant runs ``--seconds`` under the
   same harness (windows of ``--window`` s; tuners change the pipeline between windows):
   - ``in_process``: today's loader: ``ResumableLoader`` over ``CriteoTSV`` (the vectorised block parse since issue #24 (per-field Python parse before), in the
     consumer's thread, nothing prefetched);
   - ``inline_fast``: the pipeline with every stage inline (the vectorised parse alone, no workers);
   - ``workers_eq_cores``: read 1, parse = transform = cores, assemble 1, prefetch 2 (the usual
     ``num_workers = cores`` rule, per process stage);
   - ``hill_climb``: tf.data-AUTOTUNE-like, +1 to the knob that helps most, until nothing helps or the CPU
     budget (or half the RAM) is spent;
   - ``rl``: the PipelineTuner agent under the CPU and memory budgets;
   - ``grid_oracle``: every configuration of a grid (total workers within the budget) measured for one window,
     offline; its best is then run like a fixed configuration for ``--seconds`` (the oracle row; the oracle
     value is the larger of that run's steady rate and the best grid window).
   Columns: samples/s over the whole run (tuning and resets included), steady samples/s of the final
   configuration (last 3 windows), ratios to ``in_process`` and to the oracle, time for a window to reach 95%
   of the oracle, the final configuration, peak pipeline memory (worker USS + buffered batches) and whether it
   stayed within the memory budget.
2. **Feeding training** (``--train-devices``, e.g. ``1,2``): ``lightning-dlrover``-style fits of the demo DLRM
   (DLRoverStrategy, gloo, CPU) on the same files, ``--train-steps`` steps, with the in-process loader, the
   heuristic, the hill climber and the RL tuner; samples/s and data-wait share from ``ThroughputMonitor``
   (rank 0 prints a ``BENCH_RESULT {json}`` line the orchestrator reads).

    PYTHONPATH=. python bench/bench_pipeline.py                 # ~300 MB of data, ~20 minutes on 2 cores
    PYTHONPATH=. python bench/bench_pipeline.py --quick         # 40 MB, short runs, 1 training rank
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = [1000, 500, 2000, 1000, 300, 100, 1000, 200, 50, 1000, 1000, 1000, 500, 100, 1000, 2000, 1000, 50, 1000,
         500, 100, 2000, 100, 300, 1000, 500]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small data, short runs, one training rank")
    p.add_argument("--data", type=Path, default=REPO / "runs" / "bench_pipeline" / "data")
    p.add_argument("--size-mb", type=float, default=None, help="MB per day file (default 300; quick 40)")
    p.add_argument("--files", type=int, default=1)
    p.add_argument("--seconds", type=float, default=None, help="per ingestion variant (default 45; quick 15)")
    p.add_argument("--window", type=float, default=None, help="tuner window seconds (default 2; quick 1)")
    p.add_argument("--batch", type=int, default=4096, help="global batch size (ingestion)")
    p.add_argument("--train-batch", type=int, default=2048, help="global batch size (training)")
    p.add_argument("--cpus", type=int, default=None, help="pipeline CPU budget (default: all cores, ingestion)")
    p.add_argument("--memory-mb", type=int, default=1024, help="pipeline memory budget")
    p.add_argument("--train-devices", default=None, help="training ranks to try, e.g. 1,2 (default 1,2; quick 1)")
    p.add_argument("--train-steps", type=int, default=None, help="training steps per fit (default 60; quick 30)")
    p.add_argument("--rounds", type=int, default=None, help="training rounds, variants in ABBA order (default 2; quick 1)")
    p.add_argument("--skip-ingestion", action="store_true")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench_pipeline")
    # internal: one training fit (re-run by Lightning's launcher for every rank)
    p.add_argument("--train-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.size_mb = args.size_mb or (40 if args.quick else 300)
    args.seconds = args.seconds or (15 if args.quick else 45)
    args.window = args.window or (1.0 if args.quick else 2.0)
    args.train_devices = [int(d) for d in (args.train_devices or ("1" if args.quick else "1,2")).split(",") if d]
    args.train_steps = args.train_steps or (30 if args.quick else 60)
    args.rounds = args.rounds or (1 if args.quick else 2)
    return args


def data_files(args) -> list[Path]:
    from lightning_dlrover.data.generate import GeneratorConfig, generate_days

    rows = int(args.size_mb * 1e6 / 243)  # ~243 bytes per generated line
    marker = args.data / f"made_{args.files}x{rows}.json"
    paths = [args.data / f"day_{i}.tsv" for i in range(args.files)]
    if not marker.is_file():
        t0 = time.perf_counter()
        generate_days(args.data, args.files, rows, GeneratorConfig(seed=0))
        marker.write_text(json.dumps({"rows": rows, "files": args.files}))
        print(f"generated {args.files} x {rows} lines ({sum(p.stat().st_size for p in paths) / 1e6:.0f} MB) "
              f"in {time.perf_counter() - t0:.0f} s", flush=True)
    return paths


# ---------------------------------------------------------------------------------------------- ingestion
def run_reference(source, args) -> dict:
    """Today's loader: ResumableLoader over CriteoTSV, iterated for ``--seconds``."""
    from lightning_dlrover.data import ResumableLoader

    loader = ResumableLoader(source, 0, 1, args.batch)
    samples, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        for batch in loader:
            samples += len(batch.labels)
            if time.perf_counter() - t0 >= args.seconds:
                break
        else:
            loader.load_state_dict({"next_sample": 0})
    seconds = time.perf_counter() - t0
    nbytes = batch.dense_features.nbytes + batch.sparse_features.values().nbytes + batch.labels.nbytes
    return {"name": "in_process", "overall": samples / seconds, "steady": samples / seconds, "final": "in-process parse",
            "peak": nbytes * 3, "time_to_95": None, "resets": 0}


def parse_speed(path: Path, lines: int = 50_000) -> None:
    """Lines/s of the per-field reference parse and of the vectorised block parse (+ transform), same lines."""
    import torch

    from lightning_dlrover.data.tsv_parse import parse_block, parse_lines_reference, transform

    with open(path, "rb") as f:
        block = b"".join(f.readline() for _ in range(lines))
    split = block.splitlines(keepends=True)
    t0 = time.perf_counter()
    want = parse_lines_reference(split, SIZES)
    ref = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = transform(parse_block(block), SIZES)
    vec = time.perf_counter() - t0
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    print(f"parse of {lines} lines: per-field {lines / ref:.0f} lines/s, vectorised {lines / vec:.0f} lines/s "
          f"({ref / vec:.1f}x), identical output: {same}", flush=True)


def run_variant(source, tuner, args, seconds=None) -> tuple[dict, object]:
    from lightning_dlrover.data.staged import PipelinedLoader
    from lightning_dlrover.pipeline_tuner import run_ingestion

    loader = PipelinedLoader(source, 0, 1, args.batch)
    trace = run_ingestion(loader, tuner, seconds or args.seconds, window_s=args.window)
    return {"name": tuner.name, "overall": trace.overall_samples_per_s, "steady": trace.final_samples_per_s(),
            "final": trace.final.short(), "peak": trace.peak_memory, "trace": trace, "resets": trace.resets}, trace


def ingestion(args, paths) -> list[dict]:
    from lightning_dlrover.data import CriteoTSV
    from lightning_dlrover.data.staged import PipelinedLoader
    from lightning_dlrover.pipeline_tuner import (
        Budget,
        FixedTuner,
        GridSearchTuner,
        HillClimbTuner,
        RLTuner,
        default_grid,
        run_ingestion,
    )
    from lightning_dlrover.machine import available_cores
    from lightning_dlrover.pipeline_tuner.report import plot, table

    source = CriteoTSV(paths, SIZES)
    len(source)  # build the line index once, outside the timings
    parse_speed(paths[0])
    cores = args.cpus or available_cores()
    budget = Budget(cpus=cores, memory_bytes=args.memory_mb << 20)
    print(f"ingestion only: {len(source)} samples, batch {args.batch}, {args.seconds:.0f} s per variant, "
          f"budget {budget.cpus} workers / {args.memory_mb} MiB", flush=True)
    rows = [run_reference(source, args)]
    print(f"  in_process: {rows[0]['overall']:.0f} samples/s", flush=True)
    for tuner in (FixedTuner.inline(), FixedTuner.cores(cores), HillClimbTuner(budget), RLTuner(budget)):
        row, _ = run_variant(source, tuner, args)
        rows.append(row)
        print(f"  {row['name']}: {row['overall']:.0f} samples/s overall, final {row['final']}", flush=True)
    grid = default_grid(budget, parse=sorted({0, 1, 2, max(1, cores // 2), max(1, cores - 2), cores}),
                        transform=sorted({0, 1, 2, max(1, cores // 4)}))
    search = GridSearchTuner(grid)
    t0 = time.perf_counter()
    loader = PipelinedLoader(source, 0, 1, args.batch)
    run_ingestion(loader, search, 100 * len(grid) * args.window, window_s=args.window, stop_when_done=True)
    grid_seconds = time.perf_counter() - t0
    best = search.best
    oracle_row, _ = run_variant(source, FixedTuner(best, "grid_oracle"), args)
    oracle_row["grid"] = f"{len(grid)} configs, {grid_seconds:.0f} s offline"
    rows.append(oracle_row)
    oracle = max(oracle_row["steady"], max(search.means.values()))
    for row in rows:
        trace = row.get("trace")
        row["time_to_95"] = trace.time_to(0.95 * oracle) if trace is not None else None
    base = rows[0]["overall"]
    header = ["variant", "overall/s", "steady/s", "x in_process", "x oracle", "t95 oracle s", "final config",
              "peak MiB", "<= budget", "resets"]
    body = [[r["name"], f"{r['overall']:.0f}", f"{r['steady']:.0f}", f"{r['overall'] / base:.2f}",
             f"{r['steady'] / oracle:.2f}", "-" if r["time_to_95"] is None else f"{r['time_to_95']:.0f}",
             r["final"], f"{r['peak'] / 2**20:.0f}", "yes" if r["peak"] <= budget.memory_bytes else "NO",
             str(r["resets"])] for r in rows]
    print(f"\nIngestion only ({cores} worker budget, {args.memory_mb} MiB; oracle = best of grid: {best.short()}, "
          f"{oracle:.0f} samples/s; {oracle_row['grid']})")
    print(table(header, body), flush=True)
    png = plot(args.out / "ingestion.png", [r["trace"] for name in ("rl", "hill_climb") for r in rows
                                            if r["name"] == name and "trace" in r],
               budget.memory_bytes, "ingestion only: rl vs hill_climb")
    print(f"plot: {png}")
    return rows


# ----------------------------------------------------------------------------------------------- training
VARIANTS = ("in_process", "workers_eq_cores", "hill_climb", "rl")


def train_worker(args) -> None:
    """One fit; rank 0 prints ``BENCH_RESULT {json}``."""
    import warnings

    import lightning.pytorch as pl

    from lightning_dlrover import DLRoverStrategy, PipelineTuner, ThroughputMonitor
    from lightning_dlrover.data import DLRMDataModule
    from lightning_dlrover.models import DLRMModule
    from lightning_dlrover.machine import available_cores

    warnings.filterwarnings("ignore")
    variant, devices = args.train_worker, args.devices
    paths = [str(p) for p in sorted(args.data.glob("day_*.tsv"))[: args.files]]
    cores = args.cpus or max(1, (available_cores() - devices) // devices)
    callbacks = [ThroughputMonitor(log_every_n_steps=10**9, warmup_steps=5, summary=False)]
    pipeline = None
    if variant != "in_process":
        pipeline = {"read": 1, "parse": 1, "transform": 1, "assemble": 1, "prefetch": 2}
        if variant == "workers_eq_cores":
            tuner = PipelineTuner("fixed", cpus=cores, memory_mb=args.memory_mb, window_s=args.window,
                                  start={"read": 1, "parse": cores, "transform": cores, "assemble": 1, "prefetch": 2})
        else:
            tuner = PipelineTuner(variant, cpus=cores, memory_mb=args.memory_mb, window_s=args.window)
        callbacks.append(tuner)
    data = DLRMDataModule(SIZES, global_batch_size=args.train_batch, val_batches=0, criteo_paths=paths, pipeline=pipeline)
    model = DLRMModule(SIZES, embedding_dim=16, dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[64, 32, 1])
    root = args.out / "train" / f"{variant}_{devices}"
    trainer = pl.Trainer(accelerator="cpu", devices=devices, max_steps=args.train_steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=str(root), callbacks=callbacks,
                         strategy=DLRoverStrategy(sharding_types=["table_wise"], print_digest=False))
    trainer.fit(model, data)
    stats = callbacks[0].summary_stats
    if trainer.is_global_zero and stats is not None:
        tuned = callbacks[1].trace if len(callbacks) > 1 else None
        wait = [r.section_share("data_wait") or 0.0 for r in stats.ranks]
        print("BENCH_RESULT " + json.dumps({
            "variant": variant, "devices": devices, "samples_per_sec": stats.samples_per_sec,
            "data_wait_share": sum(wait) / len(wait), "peak_rss_bytes": max(r.peak_rss_bytes for r in stats.ranks),
            "final": tuned.final.short() if tuned else "in-process parse",
            "pipeline_peak_bytes": tuned.peak_memory if tuned else 0, "budget_cpus": cores}), flush=True)


def training(args) -> list[dict]:
    import statistics

    from lightning_dlrover.pipeline_tuner.report import table

    results = []
    for devices in args.train_devices:
        for round_ in range(args.rounds):
            for variant in (VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]):  # ABBA: drift cancels out
                cmd = [sys.executable, __file__, "--train-worker", variant, "--devices", str(devices), "--data",
                       str(args.data), "--files", str(args.files), "--train-batch", str(args.train_batch),
                       "--train-steps", str(args.train_steps), "--window", str(args.window), "--memory-mb",
                       str(args.memory_mb), "--out", str(args.out)] + (["--cpus", str(args.cpus)] if args.cpus else [])
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
                line = next((l for l in proc.stdout.splitlines() if l.startswith("BENCH_RESULT ")), None)
                if line is None:
                    print(f"  {variant} x{devices}: FAILED (exit {proc.returncode})\n{proc.stdout[-2000:]}"
                          f"{proc.stderr[-3000:]}")
                    continue
                result = json.loads(line[len("BENCH_RESULT "):])
                results.append(result)
                print(f"  round {round_} {variant} x{devices}: {result['samples_per_sec']:.0f} samples/s, data wait "
                      f"{result['data_wait_share']:.0%}, final {result['final']} ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
    header = ["ranks", "variant", "samples/s (median)", "each run", "x in_process", "data wait", "final config",
              "pipeline peak MiB", "rank peak RSS MiB"]
    body = []
    for devices in args.train_devices:
        runs = {v: [r for r in results if r["devices"] == devices and r["variant"] == v] for v in VARIANTS}
        base = statistics.median([r["samples_per_sec"] for r in runs["in_process"]]) if runs["in_process"] else None
        for variant, rs in runs.items():
            if not rs:
                continue
            med = statistics.median([r["samples_per_sec"] for r in rs])
            body.append([str(devices), variant, f"{med:.0f}", "/".join(f"{r['samples_per_sec']:.0f}" for r in rs),
                         f"{med / base:.2f}" if base else "-",
                         f"{statistics.median([r['data_wait_share'] for r in rs]):.0%}", rs[-1]["final"],
                         f"{max(r['pipeline_peak_bytes'] for r in rs) / 2**20:.0f}",
                         f"{max(r['peak_rss_bytes'] for r in rs) / 2**20:.0f}"])
    print(f"\nFeeding training ({args.train_steps} steps, global batch {args.train_batch}, demo DLRM, gloo on CPU, "
          f"{args.rounds} rounds in ABBA order; pipeline budget per rank: cores left after the ranks, "
          f"{args.memory_mb} MiB)")
    print(table(header, body), flush=True)
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.train_worker:
        train_worker(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    paths = data_files(args)
    print(f"machine: {os.cpu_count()} cores visible, load average {os.getloadavg()[0]:.1f}", flush=True)
    if not args.skip_ingestion:
        ingestion(args, paths)
    if args.train_devices:
        training(args)


if __name__ == "__main__":
    main()
