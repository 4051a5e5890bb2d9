"""A small DLRM job under DLRoverStrategy, which installs a FaultInjector from ``LIGHTNING_DLROVER_FAULT``.

Launched by tests/fault/test_injector.py with the variable set; Lightning's launcher re-runs this
script for every rank with the same environment. Prints ``state digest: <hex>`` (rank 0) if training finishes.
A short process-group timeout bounds how long the surviving ranks wait in a collective for a killed one.
"""

import argparse
from datetime import timedelta

import lightning.pytorch as pl

from lightning_dlrover import DLRoverStrategy, ParityConfig
from lightning_dlrover.data import DLRMDataModule
from lightning_dlrover.models import DLRMModule

SIZES = [100 + 13 * i for i in range(26)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--parity", default=None, help="k,r")
    args = parser.parse_args()

    pl.seed_everything(0)
    strategy = DLRoverStrategy(
        sharding_types=["table_wise"],
        parity=ParityConfig(*map(int, args.parity.split(","))) if args.parity else None,
        timeout=timedelta(seconds=20),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DLRMModule(SIZES, embedding_dim=8)
    data = DLRMDataModule(SIZES, global_batch_size=48, train_batches=100, val_batches=0, seed=0)
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
