"""What click-through-rate teams report on a test set, as torchmetrics metrics: their states are sums (float64) that
torchmetrics adds up over all ranks at ``compute``, so each number is over the whole test set at any world size
(not a mean of per-rank means).

- log loss: mean binary cross-entropy of the predicted probabilities;
- normalized entropy (NE): log loss divided by the entropy of the observed CTR (< 1: better than predicting the
  average CTR for every sample);
- calibration: mean predicted CTR / observed CTR (1: calibrated; > 1: over-predicts);
- AUC: torchmetrics' ``BinaryAUROC`` (exact: keeps every prediction).
"""

from __future__ import annotations

import torch
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import BinaryAUROC


class _ClickSums(Metric):
    """Sums of the log loss, predicted probability and label, and the sample count, from logits and 0/1 labels."""

    full_state_update = False
    higher_is_better: bool | None = None

    def __init__(self) -> None:
        super().__init__()
        for name in ("loss_sum", "prob_sum", "label_sum", "count"):
            self.add_state(name, default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = logits.double(), labels.double()
        self.loss_sum += torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        self.prob_sum += torch.sigmoid(logits).sum()
        self.label_sum += labels.sum()
        self.count += labels.numel()


class LogLoss(_ClickSums):
    """Mean binary cross-entropy over every sample seen."""

    higher_is_better = False

    def compute(self) -> torch.Tensor:
        return (self.loss_sum / self.count).float()


class NormalizedEntropy(_ClickSums):
    """Log loss / entropy of the observed click-through rate."""

    higher_is_better = False

    def compute(self) -> torch.Tensor:
        ctr = (self.label_sum / self.count).clamp(1e-12, 1 - 1e-12)
        entropy = -(ctr * ctr.log() + (1 - ctr) * (1 - ctr).log())
        return (self.loss_sum / self.count / entropy).float()


class Calibration(_ClickSums):
    """Mean predicted probability / observed click-through rate."""

    def compute(self) -> torch.Tensor:
        return (self.prob_sum / self.label_sum).float()


class _AUC(BinaryAUROC):
    """``BinaryAUROC`` fed logits and float labels like the others."""

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:  # type: ignore[override]
        super().update(torch.sigmoid(logits), labels.long())


def ctr_metrics(prefix: str) -> MetricCollection:
    """``{prefix}loss`` (log loss), ``{prefix}auc``, ``{prefix}calibration`` and ``{prefix}ne``; ``update(logits,
    labels)``."""
    return MetricCollection(
        {"loss": LogLoss(), "auc": _AUC(), "calibration": Calibration(), "ne": NormalizedEntropy()}, prefix=prefix,
        compute_groups=False,
    )
