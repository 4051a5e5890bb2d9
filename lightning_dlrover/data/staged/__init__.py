"""The staged, parallel, resumable Criteo TSV data loader (:class:`PipelinedLoader`) on ``torchdata.nodes``: its
configuration (:mod:`.config`), node graph (:mod:`.graph`) and the loader over it (:mod:`.loader`). Its online
tuner is :mod:`lightning_dlrover.pipeline_tuner`. Exports are imported when first used."""

from typing import TYPE_CHECKING

from lightning_dlrover._lazy import exports

if TYPE_CHECKING:
    from lightning_dlrover.data.staged.config import (DEFAULT_METHODS, FEW_CORES, INLINE, STAGES, Method,
                                                      PipelineConfig, for_machine)
    from lightning_dlrover.data.staged.graph import Delivered, build_graph, shutdown_nodes
    from lightning_dlrover.data.staged.loader import PipelinedLoader, PipelineStats, pipelined_loader

__getattr__, __dir__ = exports(__name__, {
    "DEFAULT_METHODS": "lightning_dlrover.data.staged.config",
    "FEW_CORES": "lightning_dlrover.data.staged.config",
    "INLINE": "lightning_dlrover.data.staged.config",
    "for_machine": "lightning_dlrover.data.staged.config",
    "STAGES": "lightning_dlrover.data.staged.config",
    "Method": "lightning_dlrover.data.staged.config",
    "PipelineConfig": "lightning_dlrover.data.staged.config",
    "Delivered": "lightning_dlrover.data.staged.graph",
    "build_graph": "lightning_dlrover.data.staged.graph",
    "shutdown_nodes": "lightning_dlrover.data.staged.graph",
    "PipelineStats": "lightning_dlrover.data.staged.loader",
    "PipelinedLoader": "lightning_dlrover.data.staged.loader",
    "pipelined_loader": "lightning_dlrover.data.staged.loader",
})  # fmt: skip
__all__ = ["DEFAULT_METHODS", "FEW_CORES", "INLINE", "STAGES", "Delivered", "Method", "PipelineConfig", "PipelineStats",
           "PipelinedLoader", "build_graph", "for_machine", "pipelined_loader", "shutdown_nodes"]
