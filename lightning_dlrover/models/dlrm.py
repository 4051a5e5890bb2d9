"""DLRM as a LightningModule: TorchRec's DLRM, BCE loss, AUC, a fused embedding optimizer and a dense one; test metrics
(:mod:`.metrics`) and click probabilities from ``predict``."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torchmetrics.classification import BinaryAUROC
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from lightning_dlrover.data.eval_loader import IndexedBatch
from lightning_dlrover.data.sources import NUM_DENSE, SPARSE_NAMES
from lightning_dlrover.models.metrics import ctr_metrics

EMBEDDING_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "row_wise_adagrad": RowWiseAdagrad,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
}
DENSE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
}


def table_name(feature: str) -> str:
    """Name of the embedding table that serves ``feature`` (``cat_3`` -> ``t_cat_3``)."""
    return f"t_{feature}"


class DLRMModule(pl.LightningModule):
    """DLRM (bottom MLP, one embedding bag per categorical feature, pairwise dot interaction, top MLP)
    trained with binary cross-entropy and evaluated by AUC; ``test`` reports log loss, AUC, calibration and
    normalized entropy over the whole test set (``test/loss``, ``test/auc``, ``test/calibration``, ``test/ne``), and
    ``predict`` returns ``{"index", "probability", "label"}`` per batch (see
    :class:`~lightning_dlrover.models.PredictionWriter`).

    Embedding tables are created on the meta device and materialised, already sharded, by
    :class:`~lightning_dlrover.DLRoverStrategy`; they are updated inside the backward pass by a fused
    TorchRec optimizer (``embedding_optimizer``), while Lightning steps the dense optimizer.

    Args:
        num_embeddings_per_feature: rows of table ``t_cat_i`` for each of the 26 features ``cat_i``.
        embedding_dim: columns of every table; equals the bottom MLP's output size.
        dense_arch_layer_sizes: bottom MLP layer sizes; the last must equal ``embedding_dim``.
        over_arch_layer_sizes: top MLP layer sizes; the last must be 1.
        embedding_optimizer: fused optimizer of the tables.
        embedding_lr: its learning rate.
        dense_optimizer: optimizer of the MLPs.
        dense_lr: its learning rate.
    """

    #: TorchRec's DLRM reads the pooled embeddings by feature name (``KeyedTensor.to_dict()``), not by position: a new
    #: sharding plan cannot permute its features (see ``DLRoverStrategy``'s ``feature_order_changed``).
    pooled_embeddings_by_key = True

    def __init__(
        self,
        num_embeddings_per_feature: list[int],
        embedding_dim: int = 16,
        dense_arch_layer_sizes: list[int] | None = None,
        over_arch_layer_sizes: list[int] | None = None,
        embedding_optimizer: Literal["row_wise_adagrad", "adagrad", "sgd", "adam"] = "row_wise_adagrad",
        embedding_lr: float = 0.05,
        dense_optimizer: Literal["adagrad", "sgd", "adam"] = "adagrad",
        dense_lr: float = 0.05,
    ) -> None:
        super().__init__()
        dense_arch_layer_sizes = dense_arch_layer_sizes or [64, embedding_dim]
        over_arch_layer_sizes = over_arch_layer_sizes or [64, 32, 1]
        if dense_arch_layer_sizes[-1] != embedding_dim:
            raise ValueError(
                f"model.dense_arch_layer_sizes must end with embedding_dim={embedding_dim} "
                f"(the interaction takes dot products), got {dense_arch_layer_sizes}."
            )
        if over_arch_layer_sizes[-1] != 1:
            raise ValueError(f"model.over_arch_layer_sizes must end with 1 (one logit), got {over_arch_layer_sizes}.")
        if embedding_optimizer not in EMBEDDING_OPTIMIZERS:
            raise ValueError(
                f"model.embedding_optimizer={embedding_optimizer!r} is not one of {sorted(EMBEDDING_OPTIMIZERS)}."
            )
        if dense_optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(f"model.dense_optimizer={dense_optimizer!r} is not one of {sorted(DENSE_OPTIMIZERS)}.")
        self.save_hyperparameters()
        tables = [
            EmbeddingBagConfig(
                name=table_name(feature), embedding_dim=embedding_dim, num_embeddings=rows, feature_names=[feature]
            )
            for feature, rows in zip(SPARSE_NAMES, num_embeddings_per_feature, strict=True)
        ]
        self.dlrm = DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            dense_in_features=NUM_DENSE,
            dense_arch_layer_sizes=dense_arch_layer_sizes,
            over_arch_layer_sizes=over_arch_layer_sizes,
        )
        apply_optimizer_in_backward(
            EMBEDDING_OPTIMIZERS[embedding_optimizer],
            self.dlrm.sparse_arch.parameters(),
            {"lr": embedding_lr},
        )
        self.loss_fn = torch.nn.BCEWithLogitsLoss()
        self.val_auc = BinaryAUROC()
        self.test_metrics = ctr_metrics("test/")

    #: Dense features per sample: the input of the program ``lightning-dlrover export`` writes.
    export_dense_features = NUM_DENSE

    def forward(self, batch: Batch) -> torch.Tensor:
        """Click logits, float32 [B]."""
        return self.export_forward(batch.dense_features, batch.sparse_features)

    def export_forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """Click logits, float32 [B], of plain inputs (what the exported serving program runs)."""
        return self.dlrm(dense_features, sparse_features).squeeze(-1)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self.loss_fn(self(batch), batch.labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.labels.numel())
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        logits = self(batch)
        self.log("val/loss", self.loss_fn(logits, batch.labels), sync_dist=True, batch_size=batch.labels.numel())
        self.val_auc.update(torch.sigmoid(logits), batch.labels.long())

    def on_validation_epoch_end(self) -> None:
        self.log("val/auc", self.val_auc.compute(), prog_bar=True, sync_dist=True)
        self.val_auc.reset()

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        logits, labels = self(batch), batch.labels
        if isinstance(batch, IndexedBatch):  # padding rows of the last batches are no samples
            logits, labels = logits[batch.valid], labels[batch.valid]
        self.test_metrics.update(logits, labels)
        self.log_dict(self.test_metrics, on_step=False, on_epoch=True)

    def predict_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        """``index`` (int64, the sample's position in the input; only with an :class:`IndexedBatch`), ``probability``
        (float32, of a click) and ``label`` of each sample of the batch, padding left out."""
        probability = torch.sigmoid(self(batch))
        if not isinstance(batch, IndexedBatch):
            return {"probability": probability, "label": batch.labels}
        valid = batch.valid
        return {"index": batch.index[valid], "probability": probability[valid], "label": batch.labels[valid]}

    def configure_optimizers(self) -> Any:
        """The dense optimizer over every parameter that has no fused in-backward optimizer."""
        dense = [p for _, p in in_backward_optimizer_filter(self.named_parameters())]
        return DENSE_OPTIMIZERS[self.hparams.dense_optimizer](dense, lr=self.hparams.dense_lr)
