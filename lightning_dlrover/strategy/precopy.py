"""The pre-copy of a full asynchronous save (``DLRoverStrategy(async_checkpoint="precopy")``): the fused embedding
tables' local shards and their optimizer rows are copied into staging memory by the background writer while training
goes on, and the checkpoint still holds the state of the step that asked for it, bit for bit.

**Copy before write.** From the moment the save returns, a forward pre-hook on every fused embedding kernel (the
:class:`~lightning_dlrover.strategy.incremental.RowTracker`'s) copies the rows the step is about to look up into the
staging memory, unless they are copied already, and marks them copied. ``FBGEMM``'s in-backward optimizers write
only the rows looked up in that step's forward (their optimizer rows included), so a row is in the staging memory
with its value of the saved step before any step writes it. The background copy goes through each table a chunk of
rows at a time and copies only the rows not marked; hook and chunk copy take the same lock, so neither reads a row
the other is half way through, and a row a step writes is never read by the background copy (it was marked before).
When the copy is over the hooks stop and the staged image is the state of the saved step; the write and the commit
are an ordinary asynchronous save's (:mod:`~lightning_dlrover.strategy.checkpointing`).

Training is blocked at the save for the copy of the dense, optimizer and trainer state (and the tables that are not
fused: data-parallel ones) and, during the copy, inside the steps for the rows they look up first (``blocked_s`` of
``checkpoint_saved`` counts both; ``precopy_rows`` how many rows the steps copied).

**Why not the other orders.** Copying the tables after the saved step and re-copying at a later step boundary the rows
looked up meanwhile (a live migration's pre-copy) also bounds the block by the rows touched, but the checkpoint then
holds a later step than the one Lightning asked for (``ModelCheckpoint`` names the file by its step,
``Trainer.save_checkpoint`` saves "now"), and the trainer's dict (loops, callbacks) would have to be dumped again at
that later step. DCP's stagers (``DefaultStager(StagingOptions(use_async_staging=True))``, torch 2.13) copy in a
thread too, but their contract is that the state is not modified until ``synchronize_staging()`` returns: an
in-backward optimizer modifies it in the very next step, so training would wait for the whole copy. DLRover's flash
checkpoint blocks training for its whole copy into shared memory and persists it from another process afterwards;
that is this package's plain asynchronous save.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dlrover import control_plane
from lightning_dlrover.strategy.incremental import RowTracker
from lightning_dlrover.torchrec_glue import fused_embedding_kernels, kernel_input_ids

#: Bytes of table rows (over a table's segments: weights and optimizer states) the background copy takes per chunk.
CHUNK_BYTES = 8 << 20


class PreCopy(RowTracker):
    """Copies a full save's fused table shards in the background, each row before training writes it (see the module
    docs). Its masks mark the rows copied (into the staging memory of the save armed last).

    Args:
        module: the sharded model (after ``DistributedModelParallel``).
    """

    def __init__(self, module: nn.Module) -> None:
        self.lock = threading.Lock()
        self.active = False
        self.segments: dict[int, list[tuple[Tensor, Tensor]]] = {}
        #: Rows the steps copied during the last copy, and the seconds their hooks took (lock waits included).
        self.hook_rows, self.hook_s = 0, 0.0
        super().__init__(module)
        self.paths: set[str] = set()

    def _hook(self, kernel: nn.Module, first: int):
        def hook(module: nn.Module, args: tuple) -> None:
            if not self.active:
                return
            start = time.perf_counter()
            with self.lock:
                if not self.active:
                    return
                for t, ids in enumerate(kernel_input_ids(kernel, args[0])):
                    segments = self.segments.get(first + t)
                    if not segments or not ids.numel():
                        continue
                    mask = self.masks[first + t]
                    ids = ids.to(device=mask.device, dtype=torch.int64)
                    new = ids[~mask[ids]].unique()
                    if new.numel():
                        for live, staged in segments:
                            staged.index_copy_(0, new, live.index_select(0, new))
                        mask[new] = True
                        self.hook_rows += int(new.numel())
            self.hook_s += time.perf_counter() - start

        return hook

    def current(self, model: nn.Module) -> bool:
        """Whether the hooks are on ``model``'s fused kernels as they are now (no collective)."""
        return self.module is model and self.kernels == fused_embedding_kernels(model)

    def arm(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        """Starts copying before write into the staging tensors of ``pairs`` (``(live local shard, staging)``, from
        :func:`~lightning_dlrover.checkpoint.job.prepare`'s ``later``); a pair of no fused table segment is copied
        now."""
        self.segments = {}
        for live, staged in pairs:
            index = self.by_address.get(live.data_ptr())
            if index is None or not live.numel() or live.shape[0] != self.masks[index].shape[0]:
                staged.copy_(live)
                continue
            self.segments.setdefault(index, []).append((live, staged))
        for mask in self.masks:
            mask.zero_()
        self.hook_rows, self.hook_s = 0, 0.0
        self.active = True

    def copy(self, chunk_bytes: int = CHUNK_BYTES, pause: Callable[[], None] | None = None) -> None:
        """Copies every row no step has copied yet (the background writer; ``pause`` runs after each chunk), then
        stops the hooks: the staging memory holds the state of the armed save's step."""
        try:
            for index, segments in self.segments.items():
                mask = self.masks[index]
                row_bytes = sum(live[:1].numel() * live.element_size() for live, _ in segments)
                step = max(1, chunk_bytes // max(1, row_bytes))
                for lo in range(0, mask.shape[0], step):
                    hi = min(lo + step, mask.shape[0])
                    with self.lock:
                        done = mask[lo:hi]
                        if not bool(done.any()):
                            for live, staged in segments:
                                staged[lo:hi].copy_(live[lo:hi])
                        else:
                            todo = (~done).nonzero().squeeze(1) + lo
                            for live, staged in segments:
                                staged.index_copy_(0, todo, live.index_select(0, todo))
                        done.fill_(True)
                    if pause is not None:
                        pause()
        finally:
            with self.lock:
                self.active, self.segments = False, {}


def ensure(pre: PreCopy | None, model: nn.Module, state: Callable[[], dict[str, Any]]) -> PreCopy:
    """``pre`` when its hooks are on ``model`` on every rank, else a new :class:`PreCopy` (a collective: the ranks
    vote; ``state``, a collective too, gives the saved state's structure, whose tracked paths are pre-copied)."""
    if control_plane.all_true(pre is not None and pre.current(model)):
        return pre
    if pre is not None:
        pre.close()
    pre = PreCopy(model)
    pre.paths = pre.tracked_paths(state())
    return pre
