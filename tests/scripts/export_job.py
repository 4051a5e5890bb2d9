"""A short fit under DLRoverStrategy that saves a checkpoint and writes the sharded model's predictions of fixed
samples, rank by rank (``<preds>/rank<r>.pt``: the inputs as plain tensors and the logits), for the export tests.

``--model dlrm`` (our DLRM) or ``shared`` (tests/scripts/export_models.py); ``--init-from DIR`` starts from an export
(``DLRoverStrategy(init_from=DIR)``); ``--steps 0`` only sets up (shards and loads), then predicts.
"""

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch

from lightning_dlrover import DLRoverStrategy
from lightning_dlrover.data.sources import NUM_DENSE, SPARSE_NAMES
from lightning_dlrover.models import DLRMModule
from tests.scripts.export_models import DENSE, FEATURES, SharedTableModel

SIZES = [40 + 7 * i for i in range(26)]


def inputs(seed: int, features: list[str], rows: list[int], dense: int, batch: int = 6):
    """Seeded plain inputs: dense [batch, dense], 1-3 ids per feature and sample (feature-major), labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (len(features) * batch,), generator=g, dtype=torch.int32)
    values = torch.cat([torch.randint(0, rows[i], (int(lengths[i * batch:(i + 1) * batch].sum()),), generator=g)
                        for i in range(len(features))])
    return torch.randn(batch, dense, generator=g), values, lengths, (torch.rand(batch, generator=g) > 0.5).float()


class Samples(IterableDataset):
    def __init__(self, rank: int, model: str) -> None:
        self.rank, self.model = rank, model

    def __iter__(self):
        for step in range(10_000):
            dense, values, lengths, labels = spec(self.model, 1000 * step + self.rank)
            kjt = KeyedJaggedTensor(keys=features(self.model), values=values, lengths=lengths)
            yield Batch(dense, kjt, labels) if self.model == "dlrm" else (dense, kjt, labels)


def features(model: str) -> list[str]:
    return list(SPARSE_NAMES) if model == "dlrm" else FEATURES


def spec(model: str, seed: int):
    if model == "dlrm":
        return inputs(seed, features(model), SIZES, NUM_DENSE)
    return inputs(seed, FEATURES, [200, 200, 150], DENSE)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", choices=["dlrm", "shared"], default="dlrm")
    parser.add_argument("--sharding-types", nargs="+", default=["table_wise"])
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--preds", required=True)
    parser.add_argument("--init-from", default=None)
    args = parser.parse_args()
    pl.seed_everything(3)
    model = DLRMModule(SIZES, embedding_dim=8, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1]) \
        if args.model == "dlrm" else SharedTableModel()
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.steps, logger=False, enable_checkpointing=False,
        strategy=DLRoverStrategy(sharding_types=args.sharding_types, init_from=args.init_from, print_digest=False),
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False,
    )
    rank = int(os.environ.get("LOCAL_RANK", 0))
    loader = DataLoader(Samples(rank, args.model), batch_size=None)
    trainer.fit(model, train_dataloaders=loader)
    if args.ckpt:
        trainer.save_checkpoint(args.ckpt)
    rank = trainer.global_rank
    dense, values, lengths, _ = spec(args.model, 777 + rank)
    kjt = KeyedJaggedTensor(keys=features(args.model), values=values, lengths=lengths)
    trainer.strategy.model.eval()
    with torch.no_grad():
        sharded = trainer.strategy.model
        logits = sharded(Batch(dense, kjt, torch.zeros(dense.shape[0]))) if args.model == "dlrm" else sharded(dense, kjt)
    Path(args.preds).mkdir(parents=True, exist_ok=True)
    torch.save({"dense": dense, "values": values, "lengths": lengths, "logits": logits,
                "threads": torch.get_num_threads()},
               Path(args.preds) / f"rank{rank}.pt")
    trainer.strategy.barrier("predicted")  # a rank that exits at once could cut its peers' receives short


if __name__ == "__main__":
    main()
