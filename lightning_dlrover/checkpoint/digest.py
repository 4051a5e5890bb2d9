"""A SHA-256 digest of a sharded training state that does not depend on how it is sharded.

Every tensor leaf is hashed in a canonical order: leaves sorted by name, and within a leaf, rows in
order of their global row offset, each row complete across column shards. A ``ShardedTensor`` is
assembled on rank 0 one block of rows at a time, so no rank ever holds a whole table.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from lightning_dlrover.checkpoint.sharded import flatten

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
            dist.reduce(block.view(torch.uint8), dst=0, op=dist.ReduceOp.SUM)
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
        dist.all_gather_object(described, {name: _describe(leaf) for name, leaf in leaves.items()})
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
            dist.broadcast_object_list(payload, src=owner)
            tensor = payload[0]
        else:
            tensor = leaves.get(name)
        if rank == 0:
            digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
            digest.update(_tensor_bytes(tensor))
    result = [digest.hexdigest()]
    if distributed:
        dist.broadcast_object_list(result, src=0)
    return result[0]
