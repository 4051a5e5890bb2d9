"""The user's own model of ``user_model.py`` (an ``EmbeddingCollection``, ``BatchNorm1d`` and ``Dropout``, its own
``DataLoader``) predicting under DLRoverStrategy with ``PredictionWriter``: with ``--fit-steps N`` it trains N steps,
saves a checkpoint at ``<root>/ckpt``; then it predicts from that checkpoint.

Its ``predict_dataloader`` gives each rank a contiguous slice (``eval_slice``) in the same number of equally sized
batches, padded by repeating the slice's last sample: the writer keeps each index once.
"""

import argparse

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from user_model import ClickDataset, UserModel, collate

from lightning_dlrover import DLRoverStrategy
from lightning_dlrover.data.eval_loader import eval_batch_count, eval_slice
from lightning_dlrover.models import PredictionWriter

SAMPLES, GLOBAL_BATCH = 101, 12


class Indexed(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        return index, *ClickDataset()[index]


def collate_indexed(samples: list):
    return (torch.tensor([s[0] for s in samples]), *collate([s[1:] for s in samples]))


class Batches(torch.utils.data.Sampler):
    """A batch sampler over fixed lists of indices (Lightning wraps batch samplers to record indices)."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class PredictingUserModel(UserModel):
    def predict_step(self, batch, batch_idx: int):
        index, dense, kjt, label = batch
        return {"index": index, "probability": torch.sigmoid(self(dense, kjt)), "label": label}

    def predict_dataloader(self) -> DataLoader:
        rank, world = self.trainer.global_rank, self.trainer.world_size
        start, stop = eval_slice(SAMPLES, rank, world)
        size = GLOBAL_BATCH // world
        batches = []
        for number in range(eval_batch_count(SAMPLES, world, size)):
            rows = list(range(start + number * size, min(start + (number + 1) * size, stop)))
            batches.append(rows + [rows[-1] if rows else max(stop - 1, 0)] * (size - len(rows)))
        return DataLoader(Indexed(), batch_sampler=Batches(batches), collate_fn=collate_indexed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--fit-steps", type=int, default=0)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pl.seed_everything(11)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=DLRoverStrategy(sharding_types=["table_wise"]),
        max_steps=args.fit_steps, default_root_dir=args.root, use_distributed_sampler=False, limit_val_batches=0,
        logger=False, enable_checkpointing=False, callbacks=[PredictionWriter(args.out)], enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = PredictingUserModel(collection=True, global_batch=GLOBAL_BATCH)
    ckpt = f"{args.root}/ckpt"
    if args.fit_steps:
        trainer.fit(model)
        trainer.save_checkpoint(ckpt)
    trainer.predict(model, ckpt_path=ckpt, return_predictions=False)


if __name__ == "__main__":
    main()
