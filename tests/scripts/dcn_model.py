"""TorchRec's own ``DLRM_DCN`` under DLRoverStrategy with a plain ``IterableDataset`` (no ``state_dict``), as issue #29
drilled it: ``lightning-dlrover chaos --in-process --script tests/scripts/dcn_model.py --kill-rank 1 --at-step N``.

The model is ``torchrec.models.dlrm.DLRM_DCN`` as TorchRec ships it (meta-device tables, row-wise Adagrad fused into
the backward); the data a stream that cannot say where it is. Recovery restores the model exactly; the stream starts
again, which the strategy says once before training and the drill's report names when the final states differ.
``--unseeded`` leaves out ``seed_everything`` (the drill then says its runs cannot be compared).
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM_DCN
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from lightning_dlrover import DLRoverStrategy, ParityConfig, elastic_trainer_args

TABLES, ROWS, DIM, DENSE, LOCAL_BATCH = 4, 200, 8, 5, 16


class ClickStream(IterableDataset):
    """This rank's batches, generated from (rank, batch index): a stream with no ``state_dict``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self):
        for index in range(10**6):
            g = torch.Generator().manual_seed(1000 * index + self.rank)
            dense = torch.rand(LOCAL_BATCH, DENSE, generator=g)
            ids = torch.randint(0, ROWS, (TABLES * LOCAL_BATCH,), generator=g)
            kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{t}" for t in range(TABLES)], values=ids,
                                                      lengths=torch.ones(ids.numel(), dtype=torch.int32))
            yield dense, kjt, (dense[:, 0] > 0.5).float()


class DCN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t{t}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{t}"])
                    for t in range(TABLES)],
            device=torch.device("meta"),
        )
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.05})
        self.model = DLRM_DCN(embedding_bag_collection=ebc, dense_in_features=DENSE, dense_arch_layer_sizes=[16, DIM],
                              over_arch_layer_sizes=[16, 1], dcn_num_layers=2, dcn_low_rank_dim=4)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        dense, kjt, label = batch
        logits = self.model(dense_features=dense, sparse_features=kjt).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, label)

    def configure_optimizers(self):
        return torch.optim.Adam(dict(in_backward_optimizer_filter(self.named_parameters())).values(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(ClickStream(self.trainer.global_rank), batch_size=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--devices", type=int, default=2, help="ignored under a launcher")
    parser.add_argument("--unseeded", action="store_true", help="no seed_everything")
    args = parser.parse_args()
    if not args.unseeded:
        pl.seed_everything(5)
    trainer = pl.Trainer(
        accelerator="cpu", **(elastic_trainer_args() or {"devices": args.devices}),
        strategy=DLRoverStrategy(sharding_types=["table_wise"], parity=ParityConfig(1, 1), timeout=timedelta(seconds=20)),
        max_steps=args.steps, use_distributed_sampler=False, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(DCN())


if __name__ == "__main__":
    main()
