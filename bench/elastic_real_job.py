"""One segment of the real-jobs elastic benchmark (``bench/bench_elastic_real.py`` runs it at 4, 2 and 4 ranks).

Trains the small DLRM under DLRoverStrategy (gloo, CPU) from ``--resume`` (if given) until the data position
reaches ``--stop-at`` samples or the validation loss reaches ``--target``, then saves ``--save``. Every
``--eval-every`` samples it measures the validation loss on held-out samples (every rank its share, summed
with an all-reduce) and rank 0 appends ``{"samples", "train_s", "loss", "world_size", "global_batch"}`` to
``--log``; ``train_s`` is this segment's training time so far, evaluation excluded.
"""

from __future__ import annotations

import argparse
import json
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_dlrover import DLRoverStrategy, ElasticBatchScaler
from lightning_dlrover.data import DLRMDataModule
from lightning_dlrover.data.sources import SyntheticCriteo, make_batch, rank_slice
from lightning_dlrover.models import DLRMModule

SIZES = [300 + 37 * i for i in range(26)]
VAL_SAMPLES = 8192


class EvalAndStop(pl.Callback):
    """Validation loss every ``eval_every`` samples; stops at ``stop_at`` samples or at ``target``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.train_s = 0.0
        self._since: float | None = None
        self.next_eval = 0
        self.val: list = []

    def _position(self, trainer: pl.Trainer) -> int:
        return int(trainer.datamodule.train_dataloader().state_dict()["next_sample"])

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        source = SyntheticCriteo(SIZES, VAL_SAMPLES, seed=self.args.seed + 1, label_seed=self.args.seed)
        rows = rank_slice(VAL_SAMPLES, trainer.global_rank, trainer.world_size)
        self.val = [make_batch(*source.rows(s, min(s + 1024, rows.stop))) for s in range(rows.start, rows.stop, 1024)]
        position = self._position(trainer)
        self.next_eval = (position // self.args.eval_every + 1) * self.args.eval_every
        self._since = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        position = self._position(trainer)
        if position < self.next_eval and position < self.args.stop_at:
            return
        self.train_s += time.perf_counter() - self._since
        loss = self._val_loss(trainer, pl_module)
        self.next_eval = (position // self.args.eval_every + 1) * self.args.eval_every
        if trainer.is_global_zero:
            with open(self.args.log, "a") as out:
                out.write(json.dumps({"samples": position, "train_s": self.train_s, "loss": loss,
                                      "world_size": trainer.world_size,
                                      "global_batch": trainer.datamodule.train_dataloader().global_batch_size}) + "\n")
        if loss <= self.args.target or position >= self.args.stop_at:
            trainer.should_stop = True
            if position >= self.args.stop_at and loss > self.args.target and self.args.save:
                trainer.save_checkpoint(self.args.save)
        self._since = time.perf_counter()

    def _val_loss(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float:
        model = trainer.strategy.model
        model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for batch in self.val:
                logits = model(batch)
                total[0] += float(torch.nn.functional.binary_cross_entropy_with_logits(
                    logits, batch.labels, reduction="sum"))
                total[1] += batch.labels.numel()
        model.train()
        dist.all_reduce(total)
        return float(total[0] / total[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--policy", default="fixed", help="fixed (no scaler) or an ElasticBatchScaler policy")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--range", type=int, nargs=2, default=[64, 1024])
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--stop-at", type=int, required=True, help="data position (samples) to stop and save at")
    parser.add_argument("--target", type=float, required=True)
    parser.add_argument("--eval-every", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save", default=None)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(args.seed)
    callbacks: list[pl.Callback] = [EvalAndStop(args)]
    if args.policy != "fixed":
        callbacks.insert(0, ElasticBatchScaler(*args.range, policy=args.policy, lr_rule="sqrt",
                                               check_every_n_steps=20))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=DLRoverStrategy(), max_steps=100_000,
                         limit_val_batches=0, logger=False, enable_checkpointing=False, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False)
    model = DLRMModule(SIZES, embedding_dim=16, embedding_lr=args.lr, dense_lr=args.lr)
    data = DLRMDataModule(SIZES, global_batch_size=args.batch, train_batches=1000, val_batches=0, seed=args.seed)
    trainer.fit(model, data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
