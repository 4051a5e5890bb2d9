"""Predict throughput of DLRoverStrategy against training throughput of the same model, in the same run.

One job per world size (``--ranks``, default 1 and 2; gloo on CPU, tables ``table_wise``): ``DLRMModule`` (26 tables of
``--rows`` x ``--dim``) on synthetic data trains ``--warmup + --steps`` steps, then ``trainer.predict`` runs over
``--predict-batches`` global batches of the held-out set with ``PredictionWriter`` writing CSV. Rank 0 measures:

- train: samples/s between the ends of step ``warmup`` and of the last step;
- predict: samples/s between the ends of the first and of the last predict batch (forward + writing the rank's part);
- predict+merge: every predicted sample over the time from the start of predict to the merged file (includes the
  first batch, the barrier and rank 0's merge into one ordered CSV).

Each job prints ``BENCH_RESULT {json}``; without ``--worker`` the script runs the jobs and prints the table.

    PYTHONPATH=. python bench/bench_predict.py            # a few minutes on 2 cores
    PYTHONPATH=. python bench/bench_predict.py --quick    # tiny model, a few steps
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl


class Clock(pl.Callback):
    """Rank 0's timestamps at the ends of training and predict batches, and of predict (after the writer's merge)."""

    def __init__(self) -> None:
        self.train: list[float] = []
        self.predict: list[float] = []
        self.predict_start = self.predict_end = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train.append(time.perf_counter())

    def on_predict_start(self, trainer, pl_module) -> None:
        self.predict_start = time.perf_counter()

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.predict.append(time.perf_counter())

    def on_predict_end(self, trainer, pl_module) -> None:
        self.predict_end = time.perf_counter()


def worker(args: argparse.Namespace) -> None:
    from lightning_dlrover import DLRoverStrategy
    from lightning_dlrover.data import DLRMDataModule
    from lightning_dlrover.models import DLRMModule, PredictionWriter

    pl.seed_everything(0)
    clock = Clock()
    out = Path(args.out)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.ranks, max_steps=args.warmup + args.steps, limit_val_batches=0, logger=False,
        strategy=DLRoverStrategy(sharding_types=["table_wise"], print_digest=False),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[PredictionWriter(str(out)), clock],  # the clock's on_predict_end runs after the writer's merge
    )
    sizes = [args.rows] * 26
    model = DLRMModule(sizes, embedding_dim=args.dim, dense_arch_layer_sizes=[128, args.dim],
                       over_arch_layer_sizes=[128, 64, 1])
    data = DLRMDataModule(sizes, global_batch_size=args.batch, train_batches=10_000, val_batches=0,
                          test_batches=args.predict_batches)
    trainer.fit(model, data)
    trainer.predict(model, data, return_predictions=False)
    if trainer.is_global_zero:
        train = args.steps * args.batch / (clock.train[-1] - clock.train[args.warmup - 1])
        predict = (len(clock.predict) - 1) * args.batch / (clock.predict[-1] - clock.predict[0])
        merged = args.predict_batches * args.batch / (clock.predict_end - clock.predict_start)
        rows = sum(1 for _ in open(out)) - 1
        print("BENCH_RESULT " + json.dumps({"ranks": args.ranks, "train": train, "predict": predict,
                                            "predict_merge": merged, "rows": rows}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--predict-batches", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="1,000-row tables, 8 steps, 8 predict batches")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.batch, args.warmup, args.steps, args.predict_batches = 1000, 512, 2, 8, 8
    if args.worker:
        args.ranks = args.ranks[0]
        worker(args)
        return
    results = []
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            command = [sys.executable, __file__, "--worker", "--ranks", str(ranks), "--out", f"{tmp}/predictions.csv",
                       "--rows", str(args.rows), "--dim", str(args.dim), "--batch", str(args.batch),
                       "--warmup", str(args.warmup), "--steps", str(args.steps),
                       "--predict-batches", str(args.predict_batches)]
            done = subprocess.run(command, capture_output=True, text=True, cwd=tmp,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                                                    os.environ.get("PYTHONPATH", "")])})
        line = next((x for x in done.stdout.splitlines() if x.startswith("BENCH_RESULT ")), None)
        if line is None:
            sys.exit(f"ranks={ranks} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        results.append(json.loads(line.split(" ", 1)[1]))
    print(f"DLRM 26 x {args.rows} x {args.dim}, global batch {args.batch}, gloo on CPU ({os.cpu_count()} cores)")
    print(f"{'ranks':>5} {'train samples/s':>16} {'predict samples/s':>18} {'predict/train':>14} "
          f"{'predict+merge samples/s':>24} {'rows written':>13}")
    for r in results:
        print(f"{r['ranks']:>5} {r['train']:>16,.0f} {r['predict']:>18,.0f} {r['predict'] / r['train']:>14.2f} "
              f"{r['predict_merge']:>24,.0f} {r['rows']:>13,}")


if __name__ == "__main__":
    main()
