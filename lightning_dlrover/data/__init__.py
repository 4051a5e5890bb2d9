"""Criteo-format data: synthetic and TSV sources, a resumable loader and a Lightning data module."""

from lightning_dlrover.data.datamodule import DLRMDataModule, ResumableLoader
from lightning_dlrover.data.sources import CriteoTSV, SampleSource, SyntheticCriteo, make_batch

__all__ = ["CriteoTSV", "DLRMDataModule", "ResumableLoader", "SampleSource", "SyntheticCriteo", "make_batch"]
