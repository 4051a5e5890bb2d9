"""Elastic batch scaling on real jobs: time to a target validation loss across a shrink 4 -> 2 ranks and a grow back.

Each policy trains the small DLRM (``bench/elastic_real_job.py``: DLRoverStrategy, gloo on CPU, global batch
256 at 4 ranks) in three real multi-process segments, each resumed from the previous one's checkpoint (the
restart path a shrink or grow takes): 4 ranks until ``--shrink-at`` samples, 2 ranks until ``--grow-at``
samples, then 4 ranks until the validation loss (8192 held-out samples, every ``--eval-every`` samples)
reaches ``--target`` or ``--cap`` samples. Policies:

* ``fixed``: no scaler, the global batch stays 256 (each of 2 ranks takes 128): today's behaviour;
* ``keep_per_rank``: ``ElasticBatchScaler(policy="keep_per_rank", lr_rule="sqrt")``: the global batch follows
  the world size (128 on 2 ranks), learning rates x sqrt(1/2), and back on the grow;
* ``4 ranks throughout`` (the floor): the fixed job without a shrink, one segment.

Reported: training seconds to the target (evaluation and process start-up excluded), samples to the target,
wall seconds to the target with start-ups and checkpoint loads, final loss, and ratios to ``fixed``.

    PYTHONPATH=. python bench/bench_elastic_real.py [--target 0.55] [--shrink-at 4096] [--grow-at 12288]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

JOB = Path(__file__).with_name("elastic_real_job.py")


@dataclass
class Result:
    policy: str
    reached: bool
    samples: int
    train_s: float
    wall_s: float
    final_loss: float
    batches: str
    curve: list[tuple[int, float]]
    segments: list[tuple[int, int, float, float]]  # ranks, samples trained, training s, wall s (start-up included)


def _segment(args: argparse.Namespace, workdir: Path, policy: str, devices: int, stop_at: int,
             resume: Path | None, save: Path, log: Path) -> float:
    command = [sys.executable, str(JOB), "--devices", str(devices), "--policy", policy, "--stop-at", str(stop_at),
               "--target", str(args.target), "--eval-every", str(args.eval_every), "--seed", str(args.seed),
               "--save", str(save), "--log", str(log), *(["--resume", str(resume)] if resume else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(JOB.parents[1]), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"segment {policy} at {devices} ranks failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    return time.perf_counter() - start


def run_policy(args: argparse.Namespace, workdir: Path, policy: str, plan: list[tuple[int, int]], label: str) -> Result:
    train_offset, wall_offset, resume = 0.0, 0.0, None
    records: list[dict] = []
    segments: list[tuple[int, int, float, float]] = []
    for index, (devices, stop_at) in enumerate(plan):
        log, save = workdir / f"{label}.{index}.jsonl", workdir / f"{label}.{index}.ckpt"
        wall = _segment(args, workdir, policy, devices, stop_at, resume, save, log)
        segment = [json.loads(line) for line in log.read_text().splitlines()]
        start = records[-1]["samples"] if records else 0
        segments.append((devices, segment[-1]["samples"] - start, segment[-1]["train_s"], wall))
        for r in segment:
            records.append({**r, "train_s": r["train_s"] + train_offset})
        hit = next((r for r in segment if r["loss"] <= args.target), None)
        if hit is not None:
            wall_to_hit = wall_offset + wall  # the segment ends at the target
            r = records[-1]
            return Result(label, True, r["samples"], r["train_s"], wall_to_hit, r["loss"],
                          "/".join(sorted({str(x["global_batch"]) for x in records}, key=int)),
                          [(x["samples"], x["loss"]) for x in records], segments)
        train_offset, wall_offset, resume = records[-1]["train_s"], wall_offset + wall, save
    r = records[-1]
    return Result(label, False, r["samples"], r["train_s"], wall_offset, r["loss"],
                  "/".join(sorted({str(x["global_batch"]) for x in records}, key=int)),
                  [(x["samples"], x["loss"]) for x in records], segments)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=float, default=0.55, help="validation loss to reach")
    parser.add_argument("--shrink-at", type=int, default=4096, help="samples trained on 4 ranks before the shrink")
    parser.add_argument("--grow-at", type=int, default=12288, help="samples trained when the job grows back to 4")
    parser.add_argument("--cap", type=int, default=131072, help="give up at this many samples")
    parser.add_argument("--eval-every", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=600, help="seconds one segment may take")
    args = parser.parse_args(argv)
    elastic = [(4, args.shrink_at), (2, args.grow_at), (4, args.cap)]
    runs = [("fixed", elastic, "fixed"), ("keep_per_rank", elastic, "keep_per_rank"),
            ("fixed", [(4, args.cap)], "4 ranks throughout")]
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_policy(args, Path(tmp), policy, plan, label) for policy, plan, label in runs]
    print(f"target validation loss {args.target}; shrink 4 -> 2 ranks at {args.shrink_at} samples, grow back at "
          f"{args.grow_at}; seed {args.seed}")
    base = results[0]
    print(f"{'policy':<20} {'batches':>9} {'reached':>7} {'samples':>8} {'vs fixed':>8} {'train s':>8} {'vs fixed':>8} "
          f"{'wall s':>7} {'vs fixed':>8} {'final loss':>10}")
    for r in results:
        print(f"{r.policy:<20} {r.batches:>9} {'yes' if r.reached else 'no':>7} {r.samples:>8} "
              f"{r.samples / base.samples:>7.2f}x {r.train_s:>8.1f} {r.train_s / base.train_s:>7.2f}x "
              f"{r.wall_s:>7.1f} {r.wall_s / base.wall_s:>7.2f}x {r.final_loss:>10.4f}")
    print("\nsegments (ranks: samples trained, training s, samples/s, wall s with start-up):")
    for r in results:
        print(f"{r.policy:<20} " + "; ".join(f"{n}: {k} in {t:.1f} s = {k / t:.0f}/s, wall {w:.0f} s"
                                              for n, k, t, w in r.segments))
    print("\nvalidation loss by samples trained (every 8192):")
    for r in results:
        print(f"{r.policy:<20} " + " ".join(f"{loss:.3f}" for seen, loss in r.curve if seen % 8192 == 0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
