"""Train a DLRM with DLRoverStrategy from Python (no YAML).

    python examples/train_dlrm.py                      # 2 CPU processes, synthetic data
    python examples/train_dlrm.py --criteo day_0.tsv   # real Criteo TSV files
"""

import argparse

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dlrover import DLRoverStrategy, ThroughputMonitor
from lightning_dlrover.data import DLRMDataModule
from lightning_dlrover.models import DLRMModule

TABLE_SIZES = [10_000] * 26


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--criteo", nargs="*", default=None, help="Criteo TSV day files (default: synthetic data)")
    args = parser.parse_args()

    pl.seed_everything(0)
    model = DLRMModule(TABLE_SIZES, embedding_dim=32, dense_arch_layer_sizes=[128, 32])
    data = DLRMDataModule(TABLE_SIZES, global_batch_size=1024, val_batches=4, criteo_paths=args.criteo)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=DLRoverStrategy(sharding_types=["table_wise", "column_wise"], checkpoint_backend="dcp"),
        max_steps=args.steps,
        val_check_interval=100,
        default_root_dir="runs/example",
        callbacks=[ThroughputMonitor(log_every_n_steps=50), ModelCheckpoint(every_n_train_steps=100, save_last=True)],
    )
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
