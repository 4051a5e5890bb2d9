"""A 2-rank CPU fit (Lightning DDP, gloo) whose ranks' pipelines differ: rank 1's has a slow user transform, so rank 1
waits for data and rank 0 does not (it waits for rank 1 inside the step's all-reduce). Per-rank agents would judge
different bottlenecks and change their pipelines apart; one decision for all ranks keeps them on one sequence.

    python tuner_ranks.py DATA_FILE ROOT TUNER STEPS
"""

import functools
import sys
import time

import lightning.pytorch as pl
import torch

from lightning_dlrover import PipelineTuner
from lightning_dlrover.data import CriteoTSV
from lightning_dlrover.data.staged import PipelineConfig, PipelinedLoader
from lightning_dlrover.monitor import events

SIZES = [1000] * 26


def slow_on(rank_slowed, rank, dense, ids, labels):
    if rank == rank_slowed:
        time.sleep(0.03)
    return dense, ids, labels


class Tiny(pl.LightningModule):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path, self.layer = path, torch.nn.Linear(13, 1)

    def train_dataloader(self):
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return PipelinedLoader(CriteoTSV([self.path], SIZES), rank, world, 64, PipelineConfig(0, 0, 0, 0, 0),
                               user_transforms=[functools.partial(slow_on, 1, rank)])

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.binary_cross_entropy_with_logits(self.layer(batch.dense_features).squeeze(1),
                                                                    batch.labels.float())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    path, root, tuner, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    events.configure(f"{root}/dlrover_events.jsonl")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root, callbacks=[PipelineTuner(tuner, cpus=2, memory_mb=512, window_s=0.3,
                                                                         min_batches=2)])
    trainer.fit(Tiny(path))
    print(f"FINAL_STEP {trainer.global_step} rank {trainer.global_rank}", flush=True)
