"""The pipeline tuner against a grid oracle of fixed settings and the default, feeding real training (issue #24).

One training job per rank count (the demo DLRM, ``DLRoverStrategy``, gloo on CPU, on a generated Criteo TSV file
through the staged pipeline) runs every variant as a *segment* of the same fit, rounds interleaved forward and
reversed (so a drift of the shared machine's load falls on every variant alike):

- the grid: ``--grid`` fixed settings (12 by default, ``r1 p1 t1 a1 q2`` among them: ``PipelineConfig()``, the
  default before the machine's start), and the machine's start;
- the default: the pipeline a user gets who names no workers (``data.pipeline: {}``: the machine's start,
  ``lightning_dlrover.data.staged.for_machine``), timed as a grid setting;
- ``rl``: ``PipelineTuner(tuner="rl")`` started from the default, as a user gets it (its callback's budget: the
  cores left after the ranks), tuning for ``--tune`` seconds, then timed while it keeps running;
- ``hill_climb``: ``PipelineTuner(tuner="hill_climb")`` likewise (``--tuners`` picks them);
- ``fixed``: ``PipelineTuner(tuner="fixed")``, the start kept, timed after the same ``--tune`` seconds: the control
  for a tuner's segment, whose setting has had a minute since its last rebuild where a grid setting has had
  ``--settle`` seconds.

A fixed setting is applied (a pipeline rebuild), left to settle for ``--settle`` seconds, then timed for
``--seconds`` by a per-step clock (samples of the steps over their wall time, the trainer's own step time
included). A segment ends on the first step at which rank 0's clock says so (at 2 ranks a one-number all-reduce
per step keeps the ranks on the same step). The first 60 steps (the default) are a warm-up. The oracle is the
best grid setting's mean over rounds; ratios are of means.

    PYTHONPATH=. python bench/bench_pipeline_oracle.py --data /tmp/s11/criteo/day_0.tsv
    PYTHONPATH=. python bench/bench_pipeline_oracle.py --data FILE --ranks 1 --rounds 2 --seconds 15
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = [1000, 500, 2000, 1000, 300, 100, 1000, 200, 50, 1000, 1000, 1000, 500, 100, 1000, 2000, 1000, 50, 1000,
         500, 100, 2000, 100, 300, 1000, 500]
DEFAULT = (1, 1, 1, 1, 2)  # PipelineConfig(), the start of every job before the machine's start
GRID = [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 2), (1, 0, 0, 0, 2), (0, 0, 0, 1, 2), (0, 1, 0, 0, 1),
        (0, 1, 0, 0, 2), (1, 1, 0, 1, 2), (0, 1, 1, 0, 2), DEFAULT, (1, 2, 0, 1, 2), (1, 2, 2, 1, 2)]
TUNERS = ["rl", "hill_climb"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="a Criteo TSV file (lightning-dlrover gen-criteo)")
    p.add_argument("--ranks", default="1,2", help="training rank counts, e.g. 1,2")
    p.add_argument("--rounds", type=int, default=2, help="rounds; odd rounds run the variants in reverse")
    p.add_argument("--seconds", type=float, default=15.0, help="timed seconds per variant per round")
    p.add_argument("--settle", type=float, default=2.0, help="seconds after a fixed setting is applied, untimed")
    p.add_argument("--tune", type=float, default=45.0, help="seconds a tuner tunes before it is timed")
    p.add_argument("--batch", type=int, default=2048, help="global batch size")
    p.add_argument("--window", type=float, default=2.0, help="the tuners' window_s (PipelineTuner's default)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench_pipeline_oracle")
    p.add_argument("--grid", default=None, help="the fixed settings to run instead of the 12-point grid, comma-separated, "
                   "e.g. 'r0 p0 t0 a0 q0,r1 p1 t1 a1 q2' (the default is always among them)")
    p.add_argument("--tuners", default="rl,hill_climb", help="tuners to run, comma-separated: rl, hill_climb, fixed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    TUNERS[:] = [t for t in args.tuners.split(",") if t]
    if not set(TUNERS) <= {"rl", "hill_climb", "fixed"}:
        p.error(f"--tuners {args.tuners!r}: choose among rl, hill_climb, fixed")
    if args.grid:
        try:
            chosen = [tuple(int(tok[1:]) for tok in item.split()) for item in args.grid.split(",")]
        except ValueError:
            p.error(f"--grid {args.grid!r}: give settings as 'rN pN tN aN qN', comma-separated")
        if any(len(c) != 5 for c in chosen):
            p.error(f"--grid {args.grid!r}: each setting has five numbers (read parse transform assemble prefetch)")
        GRID[:] = list(dict.fromkeys([*chosen, DEFAULT]))
    return args


def short(c) -> str:
    return "r{} p{} t{} a{} q{}".format(*c)


def variants(round_: int) -> list:
    order = [*GRID, *TUNERS]
    return order if round_ % 2 == 0 else order[::-1]


class Schedule:
    """A callback driving the segments: applies each variant, times it by the step, reports on rank 0."""

    def __init__(self, args) -> None:
        self.args, self.results, self.segments = args, [], []
        self.phase, self.current, self.tuner, self.steps = "warm-up", None, None, 0
        self.until = float("inf")

    def _over(self, now: float, trainer) -> bool:
        """Whether the segment ends at this step, on every rank alike (rank 0's clock decides)."""
        import torch
        import torch.distributed as dist

        over = torch.tensor([1 if trainer.is_global_zero and now >= self.until else 0])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(over, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        return bool(over)

    def _plan(self, start) -> None:
        self.start = start
        if start not in GRID:
            GRID.append(start)
        for round_ in range(self.args.rounds):
            for v in variants(round_):
                self.segments.append((round_, v))

    def _start_segment(self, trainer, module) -> None:
        from lightning_dlrover import PipelineTuner
        from lightning_dlrover.data.staged import PipelineConfig
        from lightning_dlrover.pipeline_tuner.callback import find_pipelined_loader

        if not self.segments:
            trainer.should_stop = True
            self.phase = "done"
            return
        self.round, self.current = self.segments.pop(0)
        loader = find_pipelined_loader(trainer)
        if self.current in TUNERS:
            loader.reconfigure(PipelineConfig(*self.start))  # the tuner starts from the default, as a user gets it
            self.tuner = PipelineTuner(self.current, window_s=self.args.window, memory_mb=1024,
                                       report_dir=str(self.args.out / "tuner"))
            self.tuner.on_train_start(trainer, module)
            self.phase, self.until = "tune", time.perf_counter() + self.args.tune
        else:
            loader.reconfigure(PipelineConfig(*self.current))
            self.phase, self.until = "settle", time.perf_counter() + self.args.settle

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self.tuner is not None:
            self.tuner.on_train_batch_end(trainer, module, outputs, batch, batch_idx)
        self.steps += 1
        if self.phase == "done":
            return
        if self.phase == "warm-up":
            if self.steps == 60:
                import dataclasses

                from lightning_dlrover.pipeline_tuner.callback import find_pipelined_loader

                self._plan(tuple(dataclasses.astuple(find_pipelined_loader(trainer).config)))
                self._start_segment(trainer, module)
            return
        if not self._over(now, trainer):
            return
        if self.phase in ("settle", "tune"):
            self.phase, self.until, self.t0, self.steps0 = "measure", now + self.args.seconds, now, self.steps
            self.load0 = os.getloadavg()[0]
        elif self.phase == "measure":
            steps, seconds = self.steps - self.steps0, now - self.t0
            result = {"round": self.round, "variant": self.current if isinstance(self.current, str) else
                      short(self.current), "start": short(self.start),
                      "samples_per_s": steps * self.args.batch / seconds, "seconds": seconds,
                      "load": (self.load0 + os.getloadavg()[0]) / 2}
            if self.tuner is not None:
                driver = self.tuner.driver
                trace = driver.finish() if driver is not None else None
                result["final"] = trace.final.short() if trace else "?"
                result["done"] = bool(getattr(self.tuner.tuner, "done", False))
                result["kept_start"] = getattr(self.tuner.tuner, "kept_start", None)
                result["windows"] = len(trace.points) if trace else 0
                result["resets"] = trace.resets if trace else 0
                self.tuner.driver, self.tuner = None, None
            if trainer.is_global_zero:
                print("SEGMENT " + json.dumps(result), flush=True)
            self.results.append(result)
            self._start_segment(trainer, module)


def worker(args) -> None:
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch import Callback

    from lightning_dlrover import DLRoverStrategy
    from lightning_dlrover.data import DLRMDataModule
    from lightning_dlrover.models import DLRMModule

    warnings.filterwarnings("ignore")
    schedule = Schedule(args)

    class Hook(Callback):
        def on_train_batch_end(self, *a):
            schedule.on_train_batch_end(*a)

    data = DLRMDataModule(SIZES, global_batch_size=args.batch, val_batches=0, criteo_paths=[str(args.data)],
                          pipeline={})  # no workers named: the machine's start, as a user gets it
    model = DLRMModule(SIZES, embedding_dim=16, dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[64, 32, 1])
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, max_steps=10**8, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=str(args.out / f"x{args.devices}"), callbacks=[Hook()],
                         strategy=DLRoverStrategy(sharding_types=["table_wise"], print_digest=False))
    trainer.fit(model, data)


def table(devices: int, results: list[dict]) -> str:
    from lightning_dlrover.pipeline_tuner.report import table as text_table

    names = list(dict.fromkeys(r["variant"] for r in results))
    by = {n: [r for r in results if r["variant"] == n] for n in names}
    mean = {n: statistics.mean(r["samples_per_s"] for r in rs) for n, rs in by.items() if rs}
    grid_means = {n: m for n, m in mean.items() if n not in TUNERS}
    oracle_name = max(grid_means, key=grid_means.get)
    start, before = results[0]["start"], short(DEFAULT)
    oracle, default = grid_means[oracle_name], mean[start]
    rows = []
    for n in sorted(mean, key=lambda n: -mean[n]):
        rs = by[n]
        label = n + "".join(f" ({why})" for why, name in (("oracle", oracle_name), ("default: the machine's start",
                                                          start), ("PipelineConfig()", before)) if n == name)
        final = "; ".join(f"{r['final']}{'' if r['done'] else ' (tuning)'}" for r in rs) if n in TUNERS else ""
        rows.append([label, f"{mean[n]:.0f}", " / ".join(f"{r['samples_per_s']:.0f}" for r in rs),
                     f"{mean[n] / oracle:.2f}", f"{mean[n] / default:.2f}",
                     f"{mean[n] / mean[before]:.2f}" if before in mean else "", final])
    loads = [r["load"] for r in results]
    head = (f"\n{devices} training rank(s): mean samples/s over {len(by[oracle_name])} rounds "
            f"(load average {min(loads):.1f}-{max(loads):.1f})")
    return head + "\n" + text_table(["variant", "mean/s", "each round", "x oracle", "x default",
                                      f"x {before}", "tuner final"], rows)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; {len(GRID)} grid settings + "
          f"{', '.join(TUNERS)}; {args.rounds} rounds x {args.seconds:.0f} s timed (tuners after {args.tune:.0f} s)",
          flush=True)
    tables = []
    for devices in [int(d) for d in args.ranks.split(",") if d]:
        cmd = [sys.executable, __file__, "--worker", "--devices", str(devices), "--data", str(args.data), "--rounds",
               str(args.rounds), "--seconds", str(args.seconds), "--settle", str(args.settle), "--tune",
               str(args.tune), "--batch", str(args.batch), "--window", str(args.window), "--out", str(args.out),
               "--tuners", args.tuners,
               *(["--grid", args.grid] if args.grid else [])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        results, t0 = [], time.perf_counter()
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
            tail = []
            for line in proc.stdout:
                if line.startswith("SEGMENT "):
                    r = json.loads(line[len("SEGMENT "):])
                    results.append(r)
                    extra = f", final {r['final']}, done {r['done']}" if "final" in r else ""
                    print(f"  x{devices} round {r['round']} {r['variant']}: {r['samples_per_s']:.0f} samples/s "
                          f"(load {r['load']:.1f}{extra})", flush=True)
                else:
                    tail = (tail + [line])[-40:]
        if proc.returncode != 0 or not results:
            print(f"  x{devices}: FAILED (exit {proc.returncode})\n{''.join(tail)}")
            continue
        (args.out / f"results_x{devices}.json").write_text(json.dumps(results, indent=1))
        tables.append(table(devices, results))
        print(tables[-1] + f"\n({time.perf_counter() - t0:.0f} s)", flush=True)
    print("\n".join(tables))


if __name__ == "__main__":
    main()
