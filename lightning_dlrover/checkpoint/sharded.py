"""Helpers for nested state dicts holding ``ShardedTensor``s."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

from lightning_dlrover import control_plane


def flatten(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yields ``(path, leaf)`` for every leaf of nested dicts and lists, paths joined with ``/``."""
    if isinstance(state, Mapping):
        for key, value in state.items():
            yield from flatten(value, f"{prefix}{key}/")
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from flatten(value, f"{prefix}{index}/")
    else:
        yield prefix.rstrip("/"), state


def complete_sharded_state(state: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Gives every rank every ``ShardedTensor`` of a two-level dict (a collective).

    TorchRec's fused optimizer lists only the state of tables with a shard on the calling rank, while
    checkpoint backends expect the same keys on every rank. Missing entries are added as
    ``ShardedTensor``s with the global metadata and no local shard; present ones are returned as is.
    """
    local = {
        (outer, inner): value.metadata()
        for outer, entries in state.items()
        for inner, value in entries.items()
        if isinstance(value, ShardedTensor)
    }
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, local, group=control_plane.group())
    complete = {outer: dict(entries) for outer, entries in state.items()}
    for metadata_by_key in gathered:
        for (outer, inner), metadata in metadata_by_key.items():
            if inner not in complete.setdefault(outer, {}):
                complete[outer][inner] = ShardedTensor._init_from_local_shards_and_global_metadata([], metadata)
    return complete


@dataclass
class Later:
    """What :func:`copy_state` leaves to its caller to copy: the paths, and the ``(live, staging)`` pairs it found."""

    paths: set[str]
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def copy_state(state: Any, reuse: Any = None, later: Later | None = None, path: str = "") -> tuple[Any, int]:
    """A copy of nested dicts, lists and tuples whose tensors (and ``ShardedTensor`` local shards) are copied into
    memory the training steps never touch, and the bytes those copies hold. A tensor of ``reuse`` (an earlier copy
    of the same state that nothing reads any more) of the same place, shape and dtype is copied into instead of new
    memory (no page faults on a fresh allocation). Other leaves are shared (training does not change them in place).
    The copy of a ``ShardedTensor`` keeps its global metadata (no collective). With ``later``, the local shards of
    the ``ShardedTensor``s at the paths (``flatten``'s) in ``later.paths`` are not copied: their staging memory is
    allocated (or reused) and each ``(live shard, staging)`` pair appended to ``later.pairs``, for the caller to
    fill (a pre-copy)."""
    if isinstance(state, ShardedTensor):
        old = reuse.local_shards() if isinstance(reuse, ShardedTensor) else []
        if len(old) != len(state.local_shards()):
            old = [None] * len(state.local_shards())
        defer = later is not None and path.rstrip("/") in later.paths
        shards = [Shard((_empty_like if defer else _copy_tensor)(shard.tensor, getattr(previous, "tensor", None)),
                        shard.metadata) for shard, previous in zip(state.local_shards(), old, strict=True)]
        if defer:
            later.pairs += [(live.tensor, staged.tensor) for live, staged in zip(state.local_shards(), shards)]
        size = sum(shard.tensor.numel() * shard.tensor.element_size() for shard in shards)
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, state.metadata()), size
    if isinstance(state, torch.Tensor):
        return _copy_tensor(state, reuse), state.numel() * state.element_size()
    if isinstance(state, Mapping):
        copied, total = copy.copy(state), 0
        for key, value in state.items():
            copied[key], size = copy_state(value, reuse.get(key) if isinstance(reuse, Mapping) else None, later,
                                           f"{path}{key}/")
            total += size
        return copied, total
    if type(state) in (list, tuple):
        old = reuse if type(reuse) is type(state) and len(reuse) == len(state) else [None] * len(state)
        pairs = [copy_state(value, previous, later, f"{path}{i}/")
                 for i, (value, previous) in enumerate(zip(state, old, strict=True))]
        return type(state)(value for value, _ in pairs), sum(size for _, size in pairs)
    return state, 0


def _fits(tensor: torch.Tensor, into: Any) -> bool:
    return (isinstance(into, torch.Tensor) and into.shape == tensor.shape and into.dtype == tensor.dtype
            and into.device == tensor.device and into.is_contiguous() and into.stride() == tensor.stride())


def _copy_tensor(tensor: torch.Tensor, into: Any) -> torch.Tensor:
    source = tensor.detach()
    return into.copy_(source) if _fits(source, into) else source.clone()


def _empty_like(tensor: torch.Tensor, into: Any) -> torch.Tensor:
    return into if _fits(tensor, into) else torch.empty_like(tensor.detach(), memory_format=torch.contiguous_format)
