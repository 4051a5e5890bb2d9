"""A DLRM job under DLRoverStrategy with ElasticBatchScaler, launched by the tests as a real multi-process job.

Every rank appends the samples it trained on to ``<log>.rank<R>`` (one JSON line per batch: step, world size,
batch size, a hash of each sample's dense features); rank 0 prints ``scaler: {...}`` (world size, global batch,
learning rates of the dense and fused optimizers) at the end of fit.
"""

import argparse
import hashlib
import json
import os
import time

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dlrover import DLRoverStrategy, ElasticBatchScaler
from lightning_dlrover.data import DLRMDataModule
from lightning_dlrover.elastic.batch import learning_rates
from lightning_dlrover.models import DLRMModule

SIZES = [300 + 37 * i for i in range(26)]


def sample_hashes(dense) -> list[str]:
    return [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in dense]


class SampleLog(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as out:
            out.write(json.dumps({"step": trainer.global_step, "world_size": trainer.world_size,
                                  "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                                  "batch": int(batch.labels.numel()),
                                  "samples": sample_hashes(batch.dense_features)}) + "\n")

    def on_train_end(self, trainer, pl_module) -> None:
        scaler = next(c for c in trainer.callbacks if isinstance(c, ElasticBatchScaler))
        if trainer.is_global_zero:
            rates = learning_rates([*trainer.optimizers, trainer.strategy.fused_optimizer])
            print("scaler: " + json.dumps({"world_size": trainer.world_size,
                                           "global_batch": scaler.state_dict()["global_batch"],
                                           "lrs": sorted(set(round(r, 8) for r in rates)),
                                           "history": scaler.history}), flush=True)


class SlowWhileShort(pl.Callback):
    """Sleeps ``seconds`` after each step while the job runs on fewer than ``world_size`` ranks: a shrunk job keeps
    training long enough for a new process to set up and join it, however loaded the machine."""

    def __init__(self, seconds: float, world_size: int) -> None:
        self.seconds, self.world_size = seconds, world_size

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.world_size < self.world_size:
            time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--range", type=int, nargs=2, default=[32, 256])
    parser.add_argument("--policy", default="keep_per_rank")
    parser.add_argument("--rule", default="sqrt")
    parser.add_argument("--check-every", type=int, default=50)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--log", required=True)
    parser.add_argument("--inject", nargs="*", default=[], help="failures to inject (tests/scripts/inject.py)")
    args = parser.parse_args()
    if args.inject:
        from tests.scripts.inject import inject

        inject(args.inject)
    pl.seed_everything(7)
    callbacks = [ElasticBatchScaler(*args.range, policy=args.policy, lr_rule=args.rule,
                                    check_every_n_steps=args.check_every), SampleLog(args.log)]
    if args.ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every, save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=DLRoverStrategy(), max_steps=args.steps,
                         limit_val_batches=0, logger=False, enable_checkpointing=bool(args.ckpt_every),
                         callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False)
    model = DLRMModule(SIZES, embedding_dim=16)
    data = DLRMDataModule(SIZES, global_batch_size=args.batch, train_batches=100, val_batches=0, seed=7)
    trainer.fit(model, data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
