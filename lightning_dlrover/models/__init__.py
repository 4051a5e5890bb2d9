"""Recommendation models trained by the strategy, and the writer of their predictions."""

from lightning_dlrover.models.dlrm import DLRMModule
from lightning_dlrover.models.predictions import PredictionWriter

__all__ = ["DLRMModule", "PredictionWriter"]
