"""Criteo-format data: synthetic and TSV sources, a resumable loader and a Lightning data module. Exports are
imported when first used (``gen-criteo`` needs only numpy)."""

from typing import TYPE_CHECKING

from lightning_dlrover._lazy import exports

if TYPE_CHECKING:
    from lightning_dlrover.data.datamodule import DLRMDataModule
    from lightning_dlrover.data.eval_loader import EvalLoader, IndexedBatch
    from lightning_dlrover.data.loader import ResumableLoader
    from lightning_dlrover.data.sources import CriteoTSV, SampleSource, SyntheticCriteo, make_batch

__getattr__, __dir__ = exports(__name__, {
    "DLRMDataModule": "lightning_dlrover.data.datamodule",
    "EvalLoader": "lightning_dlrover.data.eval_loader",
    "IndexedBatch": "lightning_dlrover.data.eval_loader",
    "ResumableLoader": "lightning_dlrover.data.loader",
    "CriteoTSV": "lightning_dlrover.data.sources",
    "SampleSource": "lightning_dlrover.data.sources",
    "SyntheticCriteo": "lightning_dlrover.data.sources",
    "make_batch": "lightning_dlrover.data.sources",
})  # fmt: skip
__all__ = ["CriteoTSV", "DLRMDataModule", "EvalLoader", "IndexedBatch", "ResumableLoader", "SampleSource",
           "SyntheticCriteo", "make_batch"]
