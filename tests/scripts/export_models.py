"""A model of our own for the export tests (importable, so ``lightning-dlrover export`` can build it from the class
path a checkpoint names): an ``EmbeddingCollection`` (unpooled lookups) with one table shared by two features."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from lightning_dlrover.models import DLRMModule

DENSE = 5
FEATURES = ["f0", "f1", "f2"]


class SharedTableModel(pl.LightningModule):
    """Table ``shared`` serves features ``f0`` and ``f1``, table ``own`` serves ``f2``; each feature's sequence of
    rows is summed per sample in the model (``index_add``), then an MLP over the dense and pooled parts."""

    export_dense_features = DENSE

    def __init__(self, shared_rows: int = 200, own_rows: int = 150, dim: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name="shared", embedding_dim=dim, num_embeddings=shared_rows, feature_names=["f0", "f1"]),
            EmbeddingConfig(name="own", embedding_dim=dim, num_embeddings=own_rows, feature_names=["f2"]),
        ], device=torch.device("meta"))
        apply_optimizer_in_backward(torch.optim.SGD, self.ec.parameters(), {"lr": lr})
        self.bottom = nn.Sequential(nn.Linear(DENSE, dim), nn.ReLU())
        self.top = nn.Linear(dim * (1 + len(FEATURES)), 1)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out = self.ec(kjt)
        batch = dense.shape[0]
        pooled = []
        for feature in FEATURES:
            jt = out[feature]
            rows = jt.values()
            sample = torch.repeat_interleave(torch.arange(batch), jt.lengths(), output_size=rows.shape[0])
            pooled.append(torch.zeros(batch, rows.shape[1]).index_add(0, sample, rows))
        return self.top(torch.cat([self.bottom(dense), *pooled], dim=1)).squeeze(1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        dense, kjt, label = batch
        return nn.functional.binary_cross_entropy_with_logits(self(dense, kjt), label)

    def configure_optimizers(self):
        return torch.optim.Adam([p for _, p in in_backward_optimizer_filter(self.named_parameters())], lr=0.01)


class WiderDLRM(DLRMModule):
    """Our DLRM with another config (table ``t_cat_3`` 100 rows longer), for the 'another model config' checks."""

    def __init__(self, num_embeddings_per_feature: list[int], **kwargs) -> None:
        sizes = list(num_embeddings_per_feature)
        sizes[3] += 100
        super().__init__(sizes, **kwargs)
