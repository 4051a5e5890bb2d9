"""Which saves of ``DLRoverStrategy(incremental_checkpoint_every=N)`` are full and which are deltas, and the rows a
delta holds (the format: :mod:`lightning_dlrover.checkpoint.incremental`).

A chain is a full checkpoint and at most ``N - 1`` deltas after it; the next save after the ``N``-th link, after a
load, after a failed full save, after the model was sharded anew, or when any rank has no committed base (a
replacement rank) is full again: the ranks vote. A delta holds the fused embedding tables' rows changed since the
previous *committed* link: a delta whose write failed gives its rows back to the next one.

**Where the changed rows come from.** A forward pre-hook on every fused embedding kernel marks the rows among the
ids it is about to look up (its input ids per table: the rows a training step's fused optimizer updates, and only
those: ``FBGEMM``'s in-backward optimizers, row-wise Adagrad's momentum included, update the looked-up rows), in a
boolean mask per table shard. The parity path's undo log (``fault/coding``) records the same rows, but it exists
only with ``parity`` on and forgets them at every commit (each step), so it cannot give the union over a save
interval; comparing with the previous save's copy would read the whole state (twice) while training is blocked, the
cost incremental saves are there to avoid. Marking costs one ``index_fill_`` per table per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from lightning_dlrover import control_plane
from lightning_dlrover.checkpoint import incremental
from lightning_dlrover.checkpoint.sharded import flatten
from lightning_dlrover.torchrec_glue import fused_embedding_kernels, kernel_input_ids


class RowTracker:
    """The rows of every fused embedding table shard on this rank looked up in training since the last :meth:`take`.

    Args:
        module: the sharded model (after ``DistributedModelParallel``).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.kernels = fused_embedding_kernels(module)
        self.masks: list[Tensor] = []
        #: The mask of each table segment (weights, optimizer states), by the segment's data pointer.
        self.by_address: dict[int, int] = {}
        self._hooks = []
        for kernel in self.kernels:
            states = kernel.emb_module.split_optimizer_states() or []
            first = len(self.masks)
            for i, weight in enumerate(kernel.split_embedding_weights()):
                self.masks.append(torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device))
                for segment in [weight, *(states[i] if i < len(states) else [])]:
                    if segment.numel():
                        self.by_address[segment.data_ptr()] = len(self.masks) - 1
            self._hooks.append(kernel.register_forward_pre_hook(self._hook(kernel, first)))

    def _hook(self, kernel: nn.Module, first: int):
        def hook(module: nn.Module, args: tuple) -> None:
            if not torch.is_grad_enabled() or not module.training:
                return
            for t, ids in enumerate(kernel_input_ids(kernel, args[0])):
                self.masks[first + t].index_fill_(0, ids.to(torch.int64), True)

        return hook

    def tracked_paths(self, state: dict[str, Any]) -> set[str]:
        """The paths of ``state``'s ``ShardedTensor``s whose every local shard is a tracked segment, agreed by every
        rank (a collective): an entry is tracked when it is on every rank that holds a shard of it."""
        mine, other = set(), set()
        for path, value in flatten(state):
            if not isinstance(value, ShardedTensor):
                continue
            for shard in value.local_shards():
                mask = self.by_address.get(shard.tensor.data_ptr())
                ok = mask is not None and shard.tensor.numel() and shard.tensor.shape[0] == self.masks[mask].shape[0]
                (mine if ok else other).add(path)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, other), group=control_plane.group())
        return set().union(*(m for m, _ in gathered)) - set().union(*(o for _, o in gathered))

    def take(self) -> list[Tensor]:
        """The rows marked in each mask (int64, increasing), and clears the masks."""
        rows = [mask.nonzero().squeeze(1) for mask in self.masks]
        for mask in self.masks:
            mask.zero_()
        return rows

    def give_back(self, rows: list[Tensor]) -> None:
        """Marks ``rows`` (of :meth:`take`) again: the delta that held them was not committed."""
        for mask, taken in zip(self.masks, rows, strict=True):
            mask[taken] = True

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


class ChainPolicy:
    """Full or delta for each save of one rank, and the chain's bookkeeping (see the module docs).

    Args:
        every: a full checkpoint every ``every`` saves (``1``: every save full).
    """

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"incremental_checkpoint_every={every} must be >= 1 (or None: every save is full).")
        self.every = every
        self.tracker: RowTracker | None = None
        self.tracked: set[str] = set()
        self.chain: str | None = None  # the live chain (rank 0 names it)
        self.links = 0  # committed links of the live chain (0: no committed base)
        self._pending: tuple[str, list[Tensor] | None] | None = None  # ("full" | "delta", rows taken)
        self._next_chain: str | None = None
        #: Rows in the last delta on this rank (``None`` after a full save).
        self.last_rows: int | None = None

    def plan(self, model: nn.Module, state: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], Any]:
        """``(link, delta)`` for :func:`~lightning_dlrover.checkpoint.job.prepare` of the next save (a collective:
        the ranks vote for a delta; ``state``, a collective too, gives the saved state's structure when the tracker is
        (re)built). Call :meth:`settle` with the outcome of the previous save first."""
        current = self.tracker is not None and self.tracker.module is model and \
            self.tracker.kernels == fused_embedding_kernels(model)
        if not control_plane.all_true(current):  # the first save, or the model was sharded anew on some rank
            if self.tracker is not None:
                self.tracker.close()
            self.tracker, self.links = RowTracker(model), 0
            self.tracked = self.tracker.tracked_paths(state())
        delta = control_plane.all_true(0 < self.links < self.every)
        if not delta:
            self.tracker.take()
            self._next_chain = incremental.new_chain_id()
            self._pending, self.last_rows = ("full", None), None
            return {"chain": self._next_chain, "link": 0}, None
        rows = self.tracker.take()
        self._pending = ("delta", rows)
        self.last_rows = int(sum(r.numel() for r in rows))
        changed = {address: rows[mask] for address, mask in self.tracker.by_address.items()}
        link = {"chain": self.chain, "link": self.links, "tracked": sorted(self.tracked)}
        return link, (self.tracked, changed)

    def settle(self, committed: bool) -> None:
        """Records the outcome of the save :meth:`plan` planned last (every rank agrees on it)."""
        if self._pending is None:
            return
        kind, rows = self._pending
        self._pending = None
        if kind == "full":
            self.chain, self.links = (self._next_chain, 1) if committed else (None, 0)
        elif committed:
            self.links += 1
        elif rows is not None and self.tracker is not None:
            self.tracker.give_back(rows)

    def reset(self) -> None:
        """The state was loaded or rebuilt: the next save is full."""
        self._pending, self.links = None, 0
