"""Export for serving: a strategy checkpoint as an unsharded artefact (``model.pt``, ``config.json``, ``model.pt2``)
that a plain Python process loads with ``torch`` alone (:func:`export_checkpoint`), optionally with row-wise int8
tables for TorchRec's inference path (``model_int8.pt``, :func:`load_quantized`). The other direction, a plain
state dict sharded on load, is ``DLRoverStrategy(init_from=...)``
(:func:`lightning_dlrover.checkpoint.plain.load_plain_into`).

Exports are imported when first used (``lightning-dlrover export --help`` loads no TorchRec)."""

from typing import TYPE_CHECKING

from lightning_dlrover._lazy import exports

if TYPE_CHECKING:
    from lightning_dlrover.checkpoint.plain import BadCheckpoint
    from lightning_dlrover.checkpoint.stream import CheckpointFileError
    from lightning_dlrover.export.artefact import export_checkpoint
    from lightning_dlrover.export.program import ServingModule
    from lightning_dlrover.export.quantized import load_quantized

__getattr__, __dir__ = exports(__name__, {
    "BadCheckpoint": "lightning_dlrover.checkpoint.plain",
    "CheckpointFileError": "lightning_dlrover.checkpoint.stream",
    "export_checkpoint": "lightning_dlrover.export.artefact",
    "ServingModule": "lightning_dlrover.export.program",
    "load_quantized": "lightning_dlrover.export.quantized",
})

__all__ = ["BadCheckpoint", "CheckpointFileError", "ServingModule", "export_checkpoint", "load_quantized"]
