"""Recommendation models trained by the strategy."""

from lightning_dlrover.models.dlrm import DLRMModule

__all__ = ["DLRMModule"]
