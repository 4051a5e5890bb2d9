"""The pipeline tuners where many cores make the space large (issue #24): a pipeline model calibrated on this machine
(:mod:`lightning_dlrover.pipeline_tuner.model`), checked against a measured 2-core table, then the RL agent, the hill
climber, a tf.data-AUTOTUNE-style baseline, the default and a grid oracle on 8, 16, 32 and 64 cores with a trainer
consuming at a GPU's rate.

1. ``--calibrate FILE``: measures on this machine, through the real staged loader (batch ``--batch``), in CPU
   seconds (load-proof): each stage's CPU per batch inline, the main process's extra CPU per batch of a stage in
   worker processes, with assemble in worker processes (the chain) the main process's CPU per batch (plan and
   receive: the model's ``ipc_s["assemble"]``) and a hop between worker processes, the training process's CPU
   per batch under the default with assemble in threads and in processes, a worker process's memory, the demo
   DLRM's CPU per step (1 rank, all inline) and the noise of 2-second windows of its rate, and the same step's wall
   beside a process burning half a core (the model's ``barrier``: step seconds lost per CPU-second of other work);
   the trainer's wall step is its CPU over ``--trainer-cores`` (or from a quiet measured all-inline rate,
   ``--reference``). Writes ``calibration.json``.
2. ``--measured results_x1.json`` (of ``bench/bench_pipeline_oracle.py --ranks 1``): the model's prediction for each
   fixed 2-core setting against the measured mean (the check: each row within 15%).
3. For each core count: every tuner runs on the model (its windows are the model's rate plus the measured window
   noise; each change costs the rebuild's seconds) for ``--minutes`` of pipeline time, ``--seeds`` times. Columns:
   the rate of the configuration in use at the end as a fraction of the grid oracle's (median over seeds), against
   the default ``r1 p1 t1 a1 q2``, and the pipeline time until the configuration in use first reached 0.95 of the
   oracle. ``--assemble-thread`` also evaluates the pipeline with assemble in the training process's threads
   (as it was before issue #24).

    PYTHONPATH=. python bench/bench_pipeline_scale.py --calibrate /tmp/s11/criteo/day_0.tsv
    PYTHONPATH=. python bench/bench_pipeline_scale.py --measured runs/bench_pipeline_oracle/results_x1.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_dlrover.data.staged import STAGES, PipelineConfig  # noqa: E402
from lightning_dlrover.pipeline_tuner import Budget, HillClimbTuner, RLTuner  # noqa: E402
from lightning_dlrover.pipeline_tuner.baselines import AutotuneTuner, FixedTuner  # noqa: E402
from lightning_dlrover.pipeline_tuner.model import Calibration, PipelineModel  # noqa: E402
from lightning_dlrover.pipeline_tuner.observe import process_workers  # noqa: E402
from lightning_dlrover.pipeline_tuner.report import table  # noqa: E402

SIZES = [1000, 500, 2000, 1000, 300, 100, 1000, 200, 50, 1000, 1000, 1000, 500, 100, 1000, 2000, 1000, 50, 1000,
         500, 100, 2000, 100, 300, 1000, 500]
DEFAULT = PipelineConfig(1, 1, 1, 1, 2)
#: Issue #24's measured 2-core table (1 rank, global batch 2048, load 1-3.6, 4 interleaved rounds of 35 s).
ISSUE_24 = [{"variant": "r0 p0 t0 a0 q0", "samples_per_s": 61_500},
            {"variant": "r1 p0 t0 a0 q2", "samples_per_s": 56_600},
            {"variant": "r1 p1 t1 a1 q2", "samples_per_s": 52_400},
            {"variant": "r1 p2 t2 a1 q2", "samples_per_s": 42_800}]


def _loader_run(path: Path, config: PipelineConfig, batch: int, batches: int, methods: dict | None = None) -> dict:
    import psutil

    from lightning_dlrover.data import CriteoTSV
    from lightning_dlrover.data.staged import PipelinedLoader

    loader = PipelinedLoader(CriteoTSV([str(path)], SIZES), 0, 1, batch, config, methods=methods)
    me = psutil.Process()
    it = iter(loader)
    for _ in range(4):
        next(it)
    workers = [psutil.Process(p) for p in loader.worker_pids()]

    def worker_cpu() -> float:
        return sum(sum(w.cpu_times()[:2]) for w in workers)

    s0, cpu0, wcpu0, t0 = loader.stats.copy(), sum(me.cpu_times()[:2]), worker_cpu(), time.perf_counter()
    uss = []
    for i in range(batches):
        next(it)
        if i == batches // 2:
            uss = [w.memory_full_info().uss for w in workers]
    seconds, cpu, wcpu = time.perf_counter() - t0, sum(me.cpu_times()[:2]) - cpu0, worker_cpu() - wcpu0
    s1 = loader.stats
    loader.close()
    n = s1.batches - s0.batches
    return {"busy": {s: (s1.busy[s] - s0.busy[s]) / n for s in STAGES}, "main_cpu": cpu / n, "rate": n / seconds,
            "uss": uss, "batch_bytes": s1.batch_bytes, "worker_cpu": wcpu / n}


_BURNER = """
import sys, time
duty, slice_s = float(sys.argv[1]), 0.002
while True:
    end = time.perf_counter() + slice_s
    while time.perf_counter() < end:
        pass
    time.sleep(slice_s * (1 - duty) / duty)
"""


def _trainer_run(path: Path, batch: int, seconds: float, pipeline: dict | None = None, burn: float = 0.0) -> dict:
    """The demo DLRM at 1 rank on all-inline batches (or ``pipeline``): wall and CPU per step, and the rate of
    2-second windows. ``burn``: beside it, a process busy that fraction of each 2 ms slice (its CPU per step in
    ``burner_cpu_per_step``)."""
    import subprocess
    import warnings

    import lightning.pytorch as pl
    import psutil

    from lightning_dlrover import DLRoverStrategy
    from lightning_dlrover.data import DLRMDataModule
    from lightning_dlrover.models import DLRMModule

    warnings.filterwarnings("ignore")
    out: dict = {"windows": []}
    burner = subprocess.Popen([sys.executable, "-c", _BURNER, str(burn)]) if burn > 0 else None
    burner_cpu = (lambda: sum(psutil.Process(burner.pid).cpu_times()[:2])) if burner else (lambda: 0.0)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.steps, self.t0 = 0, None

        def on_train_batch_end(self, trainer, *args) -> None:
            self.steps += 1
            now = time.perf_counter()
            if self.steps == 20:
                self.t0, self.cpu0, self.s0, self.w0, self.ws = now, sum(psutil.Process().cpu_times()[:2]), 20, now, 20
                self.burner0 = burner_cpu()
            elif self.t0 is not None:
                if now - self.w0 >= 2.0:
                    out["windows"].append((self.steps - self.ws) * batch / (now - self.w0))
                    self.w0, self.ws = now, self.steps
                if now - self.t0 >= seconds:
                    n = self.steps - self.s0
                    out["wall_per_step"] = (now - self.t0) / n
                    out["cpu_per_step"] = (sum(psutil.Process().cpu_times()[:2]) - self.cpu0) / n
                    out["burner_cpu_per_step"] = (burner_cpu() - self.burner0) / n
                    trainer.should_stop = True

    data = DLRMDataModule(SIZES, global_batch_size=batch, val_batches=0, criteo_paths=[str(path)],
                          pipeline=pipeline or {"read": 0, "parse": 0, "transform": 0, "assemble": 0, "prefetch": 0})
    model = DLRMModule(SIZES, embedding_dim=16, dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[64, 32, 1])
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=10**6, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         default_root_dir=str(REPO / "runs" / "bench_pipeline_scale"), callbacks=[Clock()],
                         strategy=DLRoverStrategy(sharding_types=["table_wise"], print_digest=False))
    try:
        trainer.fit(model, data)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    return out


def calibrate(path: Path, batch: int, out: Path, reference: float | None, trainer_cores: float) -> Calibration:
    """Measures this machine in CPU seconds (a shared machine's load stretches wall times, not CPU seconds); the
    trainer's wall step is the one thing taken from a quiet measurement: the all-inline row ``reference`` (samples/s
    of ``r0 p0 t0 a0 q0``, issue #24's 61.5k by default), whose serial chain is the step plus every stage."""
    inline = _loader_run(path, PipelineConfig(0, 0, 0, 0, 0), batch, 30)
    parse = _loader_run(path, PipelineConfig(0, 1, 0, 0, 0), batch, 30)
    both = _loader_run(path, PipelineConfig(0, 1, 1, 0, 0), batch, 30)
    busy = sum(inline["busy"].values())
    service = {s: inline["main_cpu"] * inline["busy"][s] / busy for s in STAGES}  # CPU seconds, split as busy
    ipc_parse = max(1e-4, parse["main_cpu"] - service["read"] - service["transform"] - service["assemble"])
    ipc_transform = max(1e-4, both["main_cpu"] - service["read"] - service["assemble"] - ipc_parse)
    # The chain (assemble in processes): the training process only plans and receives; a hop between two worker
    # processes is the second chain's extra worker CPU (a send and a receive of a transformed batch).
    chain1 = _loader_run(path, PipelineConfig(0, 0, 0, 1, 0), batch, 150)  # CPU clocks tick in 10 ms: many batches
    chain2 = _loader_run(path, PipelineConfig(0, 1, 0, 1, 0), batch, 150)
    receive = max(1e-4, chain1["main_cpu"])
    hop = max(1e-4, chain2["worker_cpu"] - chain1["worker_cpu"])
    # The training process's CPU per batch under the default, assemble in its threads vs in worker processes
    # (interleaved, 2 rounds; CPU seconds, so the machine's load stretches them little).
    main_cpu: dict[str, list[float]] = {"thread": [], "process": []}
    for order in (("thread", "process"), ("process", "thread")):
        for method in order:
            main_cpu[method].append(_loader_run(path, PipelineConfig(), batch, 150, {"assemble": method})["main_cpu"])
    print("the training process's CPU per batch, default r1 p1 t1 a1 q2: " + ", ".join(
        f"assemble in {m}s {statistics.mean(v) * 1e3:.2f} ms ({' / '.join(f'{x * 1e3:.2f}' for x in v)})"
        for m, v in main_cpu.items()), flush=True)
    trainer = _trainer_run(path, batch, 24.0)
    # The contention a step that fills its cores suffers: its wall beside a process burning half a core, per
    # CPU-second that process took (all inline, so every stage runs in the step's thread; the 2-core rows of #24
    # where a prefetch or worker processes were slower than all inline are this).
    beside = _trainer_run(path, batch, 24.0, burn=0.5)
    barrier = max(0.0, (beside["wall_per_step"] - trainer["wall_per_step"]) / max(beside["burner_cpu_per_step"], 1e-6))
    print(f"the step beside a process burning {beside['burner_cpu_per_step'] * 1e3:.1f} ms of CPU per step: "
          f"{trainer['wall_per_step'] * 1e3:.1f} -> {beside['wall_per_step'] * 1e3:.1f} ms (barrier {barrier:.2f} s "
          "per CPU-second)", flush=True)
    pipeline_s = sum(service.values())
    trainer_cpu = max(1e-3, trainer["cpu_per_step"] - pipeline_s)
    step_s = max(1e-3, batch / reference - pipeline_s) if reference else trainer_cpu / trainer_cores
    w = trainer["windows"]
    noise = statistics.pstdev(w) / statistics.mean(w) if len(w) >= 2 else 0.03
    cal = Calibration(service_s=service, ipc_s={"parse": ipc_parse, "transform": ipc_transform, "assemble": receive,
                                                "hop": hop}, step_s=step_s,
                      step_cores=min(2.0, trainer_cpu / step_s), worker_bytes=max(both["uss"] or [96 << 20]),
                      batch_bytes=inline["batch_bytes"], batch_size=batch, noise=min(0.1, noise),
                      barrier=round(barrier, 3))
    out.write_text(json.dumps({**cal.__dict__, "measured_at_load": os.getloadavg()[0], "trainer_cpu_s": trainer_cpu,
                               "trainer_wall_s_here": trainer["wall_per_step"], "inline_wall": inline["busy"],
                               "chain_worker_cpu": [chain1["worker_cpu"], chain2["worker_cpu"]],
                               "default_main_cpu_s": main_cpu, "trainer_wall_s_beside_burner": beside["wall_per_step"],
                               "burner_cpu_s_per_step": beside["burner_cpu_per_step"]}, indent=1))
    return cal


def load(path: Path) -> Calibration:
    raw = json.loads(path.read_text())
    return Calibration(**{k: v for k, v in raw.items() if k in Calibration.__dataclass_fields__})


def check(cal: Calibration, measured: Path | None) -> str:
    """The model's 2-core rows against a measured table (bench_pipeline_oracle's results; ``None``: issue #24's)."""
    results = json.loads(measured.read_text()) if measured else ISSUE_24
    by: dict[str, list[float]] = {}
    for r in results:
        if re.fullmatch(r"r\d+ p\d+ t\d+ a\d+ q\d+", r["variant"]):  # fixed settings, not the tuners (rl)
            by.setdefault(r["variant"], []).append(r["samples_per_s"])
    model = PipelineModel(cal, cores=2)
    rows, worst = [], 0.0
    for name, rates in sorted(by.items(), key=lambda kv: -statistics.mean(kv[1])):
        c = PipelineConfig(*(int(tok[1:]) for tok in name.split()))
        mean, predicted = statistics.mean(rates), model.samples_per_s(c)
        err = predicted / mean - 1
        worst = max(worst, abs(err))
        rows.append([name, f"{mean:.0f}", f"{predicted:.0f}", f"{err:+.0%}"])
    loads = [r["load"] for r in results if "load" in r] or [1.0, 3.6]  # issue #24: load 1-3.6
    return (f"\nthe model on 2 cores against {measured or 'issue #24'} (load {min(loads):.1f}-{max(loads):.1f}); worst row "
            f"{worst:.0%}\n" + table(["setting", "measured/s", "model/s", "error"], rows))


def oracle(model: PipelineModel, budget: Budget) -> tuple[PipelineConfig, float]:
    c = budget.cpus
    small = range(0, min(c, 4) + 1)
    best, best_rate = DEFAULT, 0.0
    # assemble beyond 4 workers only where it runs every stage (p = t = 0: in the chain, one stage fused)
    for r, p, t, a, q in itertools.product(small, range(0, c + 1), range(0, c + 1), range(0, c + 1), (0, 1, 2)):
        if r + p + t + a > c or (a > 4 and (p or t)):
            continue
        config = PipelineConfig(r, p, t, a, q)
        if model.memory(config) > budget.memory_bytes:
            continue
        rate = model.rate(config)
        if rate > best_rate:
            best, best_rate = config, rate
    return best, best_rate


def simulate(model: PipelineModel, tuner, seconds: float, window_s: float = 2.0) -> list[tuple[float, PipelineConfig]]:
    """The configurations a tuner runs over ``seconds`` of pipeline time: (time it took effect, configuration)."""
    t, config = 0.0, tuner.first()
    timeline = [(0.0, config)]
    while t < seconds:
        w = window_s * (3 if getattr(tuner, "done", False) else 1)
        obs = model.observe(config, w)
        t += w
        workers = [model.cal.worker_bytes] * process_workers(config, model.cal.methods)
        decision = tuner.step(obs, workers)
        if decision.config is not None and decision.config != config:
            config = decision.config
            t += model.reset_s(config)
            timeline.append((t, config))
    return timeline


def evaluate(cal: Calibration, cores: int, minutes: float, seeds: int, memory_gb: float) -> list[list[str]]:
    budget = Budget(cpus=max(1, cores - 1), memory_bytes=int(memory_gb * 2**30))
    model = PipelineModel(cal, cores)
    best, best_rate = oracle(model, budget)
    default_rate = model.rate(DEFAULT)
    makers = {"rl": lambda s: RLTuner(budget, start=DEFAULT, seed=s),
              "hill_climb": lambda s: HillClimbTuner(budget, start=DEFAULT, ram_bytes=budget.memory_bytes),
              "autotune": lambda s: AutotuneTuner(budget, start=DEFAULT, ram_bytes=budget.memory_bytes),
              "default": lambda s: FixedTuner(DEFAULT, "default")}
    rows = [[f"{cores}", "grid oracle", best.short(), "1.00", f"{best_rate / default_rate:.2f}", "-"]]
    for name, make in makers.items():
        fractions, reach, finals = [], [], []
        for seed in range(seeds):
            model.rng.seed(seed)
            timeline = simulate(model, make(seed), minutes * 60)
            at_end = [c for t, c in timeline if t <= minutes * 60][-1]
            fractions.append(model.rate(at_end) / best_rate)
            finals.append(at_end.short())
            reach.append(next((t for t, c in timeline if model.rate(c) >= 0.95 * best_rate), None))
        frac = statistics.median(fractions)
        reached = [r for r in reach if r is not None]
        when = (f"{statistics.median(reached):.0f} s ({len(reached)}/{seeds})" if reached else "never")
        final = max(set(finals), key=finals.count)
        rows.append([f"{cores}", name, final, f"{frac:.2f}", f"{frac * best_rate / default_rate:.2f}", when])
    return rows


def train_default(args) -> None:
    """The 2-core question of assemble in processes: the default pipeline feeding the demo DLRM, assemble in worker
    processes (4 processes) against in the training process's threads (2 processes, 2 threads)."""
    import subprocess

    if args.one:  # one fit, in a process of its own
        from lightning_dlrover.data.staged import config

        config.DEFAULT_METHODS["assemble"] = args.one
        out = _trainer_run(args.train_default, args.batch, 20.0, {"read": 1, "parse": 1, "transform": 1,
                                                                    "assemble": 1, "prefetch": 2})
        print("RESULT", json.dumps({"samples_per_s": args.batch / out["wall_per_step"],
                                    "cpu_per_step": out["cpu_per_step"]}), flush=True)
        return
    got: dict[str, list[float]] = {"process": [], "thread": []}
    for r in range(args.rounds):
        for method in ("process", "thread") if r % 2 == 0 else ("thread", "process"):
            cmd = [sys.executable, __file__, "--train-default", str(args.train_default), "--one", method,
                   "--batch", str(args.batch)]
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"the {method} fit failed:\n{proc.stderr[-3000:]}")
            got[method].append(json.loads(line[7:])["samples_per_s"])
            where = "worker processes" if method == "process" else "threads"
            print(f"round {r} assemble in {where}: {got[method][-1]:.0f} samples/s (load {os.getloadavg()[0]:.1f})",
                  flush=True)
    print(table(["assemble in", "mean samples/s", "each round"], [
        [m, f"{statistics.mean(v):.0f}", " / ".join(f"{x:.0f}" for x in v)] for m, v in got.items()]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibrate", type=Path, help="a Criteo TSV file: measure this machine first")
    p.add_argument("--calibration", type=Path, default=REPO / "runs" / "bench_pipeline_scale" / "calibration.json")
    p.add_argument("--measured", type=Path, help="bench_pipeline_oracle's results_x1.json, to check the model")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--reference", type=float, default=None,
                   help="samples/s of r0 p0 t0 a0 q0 measured on a quiet machine (calibrates the trainer's wall step)")
    p.add_argument("--cores", default="8,16,32,64")
    p.add_argument("--gpu-samples-per-s", type=float, default=400_000.0,
                   help="the trainer's own rate (a GPU's): its step takes batch / this seconds and keeps one core busy")
    p.add_argument("--minutes", type=float, default=2.0, help="pipeline time each tuner gets")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--assemble-thread", action="store_true",
                   help="also evaluate the pipeline with assemble in threads of the training process (before #24)")
    p.add_argument("--trainer-cores", type=float, default=1.5,
                   help="cores the demo DLRM's step keeps busy on 2 cores (its wall step: its CPU / this)")
    p.add_argument("--noise", type=float, help="window-to-window noise of the rate (default: the calibrated one)")
    p.add_argument("--memory-gb", type=float, default=16.0, help="the pipeline's memory budget")
    p.add_argument("--reset-s", type=float, help="seconds of a rebuild, on top of 0.05 s per worker (default: "
                   "the calibration's 0.3; assemble in processes measured ~1 s in all on 2 loaded cores)")
    p.add_argument("--train-default", type=Path, metavar="TSV",
                   help="only train the demo DLRM at 1 rank under the default pipeline, assemble in worker processes "
                        "and in threads, interleaved (--rounds), and print samples/s")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--one", choices=["process", "thread"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.train_default:
        train_default(args)
        return
    args.calibration.parent.mkdir(parents=True, exist_ok=True)
    if args.calibrate:
        cal = calibrate(args.calibrate, args.batch, args.calibration, args.reference, args.trainer_cores)
        print(f"calibrated (load {os.getloadavg()[0]:.1f}): {json.dumps(cal.__dict__)}")
    cal = load(args.calibration)
    if args.noise is not None:  # e.g. a quiet machine's window noise instead of the one measured
        cal = Calibration(**{**cal.__dict__, "noise": args.noise})
    if args.reset_s is not None:
        cal = Calibration(**{**cal.__dict__, "reset_s": args.reset_s})
    if "assemble" not in cal.ipc_s:
        sys.exit(f"{args.calibration} predates assemble in processes (no ipc_s.assemble): re-run --calibrate.")
    print("stage seconds per batch: " + ", ".join(f"{s} {cal.service_s[s] * 1e3:.1f} ms" for s in STAGES)
          + f"; process IPC {', '.join(f'{s} {v * 1e3:.1f} ms' for s, v in cal.ipc_s.items())}; trainer step "
          f"{cal.step_s * 1e3:.0f} ms on {cal.step_cores:.2f} cores, barrier {cal.barrier:.2f}; worker {cal.worker_bytes / 2**20:.0f} MiB; "
          f"window noise {cal.noise:.1%}")
    print(check(cal, None))
    if args.measured:
        print(check(cal, args.measured))
    gpu = cal.with_trainer(args.batch / args.gpu_samples_per_s, 1.0)
    variants = [(f"the staged pipeline with assemble in {gpu.methods['assemble']}es (as calibrated; 'process': the "
                 "chain, the training process receives assembled batches only)", gpu)]
    if args.assemble_thread:
        variants.append(("assemble in threads of the training process (the pipeline before #24)", Calibration(**{
            **gpu.__dict__, "methods": {**gpu.methods, "assemble": "thread"}})))
    for title, variant in variants:
        rows = []
        for cores in [int(c) for c in args.cores.split(",") if c]:
            rows += evaluate(variant, cores, args.minutes, args.seeds, args.memory_gb)
        print(f"\n{title}: a trainer at {args.gpu_samples_per_s:,.0f} samples/s (step {gpu.step_s * 1e3:.1f} ms, one "
              f"core), the pipeline's budget: cores - 1 workers, {args.memory_gb:.0f} GiB; {args.minutes:g} min of "
              f"pipeline time, median of {args.seeds} seeds\n" + table(
                  ["cores", "tuner", "config at the end", "x oracle", "x default", "reached 0.95 oracle"], rows),
              flush=True)


if __name__ == "__main__":
    main()
