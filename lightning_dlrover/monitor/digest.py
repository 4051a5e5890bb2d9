"""State digests: a SHA-256 of the training state that does not depend on how it is sharded, and the
``StateDigest`` callback that prints it.

Every tensor leaf is hashed in a canonical order: leaves sorted by name, and within a leaf, rows in
order of their global row offset, each row complete across column shards. A ``ShardedTensor`` is
assembled on rank 0 one block of rows at a time, so no rank ever holds a whole table.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from lightning_dlrover import control_plane
from lightning_dlrover.checkpoint.sharded import flatten
from lightning_dlrover.log import get_logger, rank_zero_report
from lightning_dlrover.monitor.events import emit

log = get_logger(__name__)

BLOCK_BYTES = 16 << 20


def _describe(leaf: Any) -> tuple[Any, ...]:
    if isinstance(leaf, ShardedTensor):
        meta = leaf.metadata()
        return ("sharded", tuple(meta.size), meta.tensor_properties.dtype)
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype)
    return ("object",)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _sharded_blocks(
    leaf: ShardedTensor | None, shape: tuple[int, ...], dtype: torch.dtype, distributed: bool
) -> Iterator[torch.Tensor]:
    """Blocks of whole rows of a sharded tensor, in row order, complete on rank 0 (collective)."""
    rows, inner = shape[0], shape[1:]
    row_bytes = max(1, math.prod(inner) * torch.empty((), dtype=dtype).element_size())
    block_rows = max(1, BLOCK_BYTES // row_bytes)
    shards = leaf.local_shards() if leaf is not None else []
    for start in range(0, rows, block_rows):
        stop = min(rows, start + block_rows)
        block = torch.zeros((stop - start, *inner), dtype=dtype)
        for shard in shards:
            offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            lo, hi = max(start, offsets[0]), min(stop, offsets[0] + sizes[0])
            if lo >= hi:
                continue
            target = (slice(lo - start, hi - start), *(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:])))
            block[target] = shard.tensor[lo - offsets[0] : hi - offsets[0]].to("cpu")
        # Shards do not overlap: each byte has one non-zero contributor, so a byte-wise sum is exact.
        if distributed:
            dist.reduce(block.view(torch.uint8), dst=0, op=dist.ReduceOp.SUM, group=control_plane.group())
        yield block


def state_digest(state: Mapping[str, Any]) -> str:
    """SHA-256 hex digest of every tensor in ``state``; a collective when torch.distributed is initialised.

    Tensors that are not sharded are taken from the lowest rank that has them (they are replicated);
    non-tensor leaves (hyper-parameters, counters) are not hashed. Returned on every rank.
    """
    leaves = {name: leaf for name, leaf in flatten(state) if isinstance(leaf, torch.Tensor)}
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not distributed:
        described = [{name: _describe(leaf) for name, leaf in leaves.items()}]
    else:
        described = [None] * dist.get_world_size()
        dist.all_gather_object(described, {name: _describe(leaf) for name, leaf in leaves.items()}, group=control_plane.group())
    rank = dist.get_rank() if distributed else 0
    digest = hashlib.sha256()
    for name in sorted(set().union(*described)):
        owners = [r for r, d in enumerate(described) if name in d]
        kind, *shape_dtype = described[owners[0]][name]
        if kind == "sharded":
            shape, dtype = shape_dtype
            digest.update(f"{name}|{tuple(shape)}|{dtype}".encode())
            for block in _sharded_blocks(leaves.get(name), shape, dtype, distributed):
                if rank == 0:
                    digest.update(_tensor_bytes(block))
            continue
        owner = owners[0]
        if distributed and owner != 0:
            payload = [leaves.get(name)]
            dist.broadcast_object_list(payload, src=owner, group=control_plane.group())
            tensor = payload[0]
        else:
            tensor = leaves.get(name)
        if rank == 0:
            digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
            digest.update(_tensor_bytes(tensor))
    result = [digest.hexdigest()]
    if distributed:
        dist.broadcast_object_list(result, src=0, group=control_plane.group())
    return result[0]


def training_state_digest(trainer: pl.Trainer) -> str:
    """Digest of the model and optimizer state under any strategy (a collective on every rank)."""
    if hasattr(trainer.strategy, "training_state"):  # sharded tables and their fused optimizer state
        return state_digest(trainer.strategy.training_state())
    state: dict[str, Any] = {
        "model": trainer.lightning_module.state_dict(),
        "optimizers": [optimizer.state_dict()["state"] for optimizer in trainer.optimizers],
    }
    return state_digest(state)


class StateDigest(pl.Callback):
    """Prints ``state digest at step N: <sha256>`` on rank 0 and keeps every digest in :attr:`digests`.

    Two runs with the same seed and world size print the same digests; a run resumed from a checkpoint
    prints, at its start, the digest of the state it resumed from.

    Args:
        at_start: also digest the state when training starts (after a checkpoint restore).
        every_n_steps: also digest every ``n`` optimizer steps; ``None`` only at the end of training.
    """

    def __init__(self, at_start: bool = False, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"StateDigest(every_n_steps={every_n_steps}) must be a positive number of steps.")
        self.at_start = at_start
        self.every_n_steps = every_n_steps
        self.digests: dict[int, str] = {}

    def _record(self, trainer: pl.Trainer) -> None:
        digest = training_state_digest(trainer)
        self.digests[trainer.global_step] = digest
        if trainer.is_global_zero:
            rank_zero_report(log, f"state digest at step {trainer.global_step}: {digest}")
            emit("digest", step=trainer.global_step, digest=digest, final=False)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_start:
            self._record(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self._record(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step not in self.digests:
            self._record(trainer)
