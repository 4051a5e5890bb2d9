"""``test`` and ``predict`` of a DLRM under DLRoverStrategy, launched by the tests as a real multi-process job.

With ``--fit-steps N`` it first trains N steps and saves a checkpoint at ``--ckpt``, then tests and predicts the
model in memory; without, it tests and predicts from ``--ckpt``. Rank 0 prints ``test metrics: {json}``;
predictions go to ``--out`` (PredictionWriter). Lightning's launcher re-runs this script for every rank.
"""

import argparse
import json

import lightning.pytorch as pl

from lightning_dlrover import DLRoverStrategy
from lightning_dlrover.data import DLRMDataModule
from lightning_dlrover.models import DLRMModule, PredictionWriter

SIZES = [40 + 7 * i for i in range(26)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--fit-steps", type=int, default=0)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--tsv", required=True, help="the held-out day file to test and predict")
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=24)
    args = parser.parse_args()
    pl.seed_everything(3)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=DLRoverStrategy(sharding_types=["table_wise"]),
        max_steps=args.fit_steps, limit_val_batches=0, logger=False, enable_checkpointing=False,
        callbacks=[PredictionWriter(args.out)], enable_progress_bar=False, enable_model_summary=False,
    )
    model = DLRMModule(SIZES, embedding_dim=8, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    data = DLRMDataModule(SIZES, global_batch_size=args.batch, train_batches=100, val_batches=0, seed=3,
                          test_criteo_paths=[args.tsv])
    ckpt = None
    if args.fit_steps:
        trainer.fit(model, data)
        trainer.save_checkpoint(args.ckpt)
    else:
        ckpt = args.ckpt
    metrics = trainer.test(model, data, ckpt_path=ckpt, verbose=False)[0]
    trainer.predict(model, data, ckpt_path=ckpt, return_predictions=False)
    if trainer.is_global_zero:
        print(f"test metrics: {json.dumps(metrics)}", flush=True)


if __name__ == "__main__":
    main()
