"""Incremental checkpoints: chains of a full checkpoint and deltas holding only the embedding rows changed since the
previous link (Check-N-Run style), in the directory format of :mod:`~lightning_dlrover.checkpoint.directory`.

A link is a checkpoint directory whose ``dlrover.json`` has ``"incremental": {"chain": ID, "link": i}``; link 0 is a
full checkpoint. A delta (link ``i > 0``) holds in ``sharded/`` (the backend's) everything but the *tracked* entries
(the shards of the fused embedding tables and their optimizer states), in full, and in ``rows/rank-R.pt`` (one file
per rank that wrote it) the rows of the tracked entries changed since link ``i - 1``, **by global index**: for each
entry, each of the rank's local shards as ``(rows, column offset, values)``, ``rows`` the indices into the entry's
global tensor. A rank restoring a delta reads every rank's file and copies the rows and columns its own shards hold,
so a chain restores onto any sharding and world size as a full checkpoint does.

A delta names its ancestors by ``(chain, link)``, not by path: they are found among the directories beside it. A link
that Lightning removes or overwrites (``ModelCheckpoint``'s top-k, ``last.ckpt``) is moved aside under a hidden name
(:func:`retire`) while a checkpoint that may need it exists, and deleted by :func:`collect` once the newest chain
starts after it (its full link committed) and no visible checkpoint of its chain follows it.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from lightning_dlrover.checkpoint import directory
from lightning_dlrover.checkpoint.sharded import flatten

ROWS_DIR = "rows"
#: The prefix of a link moved aside (:func:`retire`).
HIDDEN_PREFIX = ".dlrover-link-"


def new_chain_id() -> str:
    """A fresh chain id."""
    return uuid.uuid4().hex[:16]


def link_info(path: Path) -> dict[str, Any] | None:
    """``{"chain": ID, "link": i}`` of the checkpoint at ``path``, ``None`` for a checkpoint of no chain or no
    checkpoint."""
    try:
        info = json.loads((path / directory.INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info.get("incremental")


def split(state: dict[str, Any], tracked: set[str]) -> dict[str, Any]:
    """``state`` (nested dicts) without the entries whose ``flatten`` path is in ``tracked`` (a shallow copy)."""
    if not isinstance(state, dict):
        return state
    out: dict[str, Any] = {}
    for path, _ in flatten(state):
        if path in tracked:
            continue
        keys = path.split("/")
        node, src = out, state
        for key in keys[:-1]:
            src = src[key]
            node = node.setdefault(key, {})
        node[keys[-1]] = src[keys[-1]]
    return out


@dataclass
class RowShard:
    """Rows of one local shard of a tracked entry: ``rows`` (int64 ``[m]``) index the entry's global tensor in
    dimension 0, ``values[i]`` is row ``rows[i]`` of columns ``[col, col + values.shape[1])`` (2-D entries)."""

    rows: torch.Tensor
    col: int
    values: torch.Tensor


@dataclass
class Rows:
    """A rank's part of a delta: the changed rows of each tracked entry it holds a shard of."""

    entries: dict[str, list[RowShard]] = field(default_factory=dict)

    @property
    def count(self) -> int:
        """Distinct rows summed over entries and shards."""
        return sum(int(s.rows.numel()) for shards in self.entries.values() for s in shards)

    @property
    def nbytes(self) -> int:
        return sum(s.rows.numel() * 8 + s.values.numel() * s.values.element_size()
                   for shards in self.entries.values() for s in shards)


def take_rows(state: dict[str, Any], tracked: set[str], changed: dict[int, torch.Tensor]) -> Rows:
    """Copies of the rows ``changed[data_ptr]`` (local row indices, int64) of every local shard of the tracked
    ``ShardedTensor``s of ``state``, by global index (see the module docs)."""
    out = Rows()
    for path, value in flatten(state):
        if path not in tracked or not isinstance(value, ShardedTensor):
            continue
        shards = []
        for shard in value.local_shards():
            local = changed[shard.tensor.data_ptr()]
            offsets = shard.metadata.shard_offsets
            values = shard.tensor.index_select(0, local.to(shard.tensor.device)).cpu()
            shards.append(RowShard(local.cpu() + offsets[0], offsets[1] if len(offsets) > 1 else 0, values))
        out.entries[path] = shards
    return out


def rows_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / ROWS_DIR / f"rank-{rank:05d}.pt"


def write_rows(checkpoint: Path, rank: int, rows: Rows) -> None:
    """Writes this rank's rows of a delta under ``checkpoint`` (its temporary directory)."""
    target = rows_file(checkpoint, rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save({path: [(s.rows, s.col, s.values) for s in shards] for path, shards in rows.entries.items()}, target)


def apply_rows(checkpoint: Path, state: dict[str, Any], plain: dict[str, torch.Tensor] | None = None) -> int:
    """Copies the delta's rows (every rank's file) into the local shards of ``state``'s live ``ShardedTensor``s that
    hold them (in place), or, for the paths in ``plain``, into those whole 1-D tensors of the saved layout
    (:mod:`~lightning_dlrover.checkpoint.layout`); returns the rows copied."""
    targets = {path: value for path, value in flatten(state) if isinstance(value, ShardedTensor)}
    plain = plain or {}
    copied = 0
    for part in sorted((checkpoint / ROWS_DIR).glob("rank-*.pt")):
        for path, shards in torch.load(part, map_location="cpu", weights_only=True).items():
            if path in plain:
                for rows, _, values in shards:
                    plain[path].index_copy_(0, rows, values.to(plain[path]))
                    copied += int(rows.numel())
                continue
            if path not in targets:
                raise KeyError(f"{part} holds rows of {path!r}, which the model being restored has no entry for: "
                               "restore into the model that wrote the checkpoint.")
            for rows, col, values in shards:
                copied += _copy_into(targets[path], rows, col, values)
    return copied


def _copy_into(target: ShardedTensor, rows: torch.Tensor, col: int, values: torch.Tensor) -> int:
    copied = 0
    for shard in target.local_shards():
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        inside = (rows >= offsets[0]) & (rows < offsets[0] + sizes[0])
        if not bool(inside.any()):
            continue
        local = rows[inside] - offsets[0]
        picked = values[inside]
        if len(sizes) > 1:
            lo, hi = max(col, offsets[1]), min(col + values.shape[1], offsets[1] + sizes[1])
            if lo >= hi:
                continue
            picked = picked[:, lo - col: hi - col]
            index = local.to(shard.tensor.device)
            shard.tensor[:, lo - offsets[1]: hi - offsets[1]].index_copy_(0, index, picked.to(shard.tensor))
        else:
            shard.tensor.index_copy_(0, local.to(shard.tensor.device), picked.to(shard.tensor))
        copied += int(local.numel())
    return copied


@dataclass(frozen=True)
class Chain:
    """The links a checkpoint restores from, in order (``links[0]`` full), and what was missing."""

    links: list[Path]
    #: The link the checkpoint asked for (its index in the chain).
    wanted: int
    #: The first missing link's index (``None``: none missing).
    missing: int | None = None

    @property
    def complete(self) -> bool:
        return self.missing is None


def resolve(path: Path) -> Chain:
    """The chain of the checkpoint ``path``: itself for a full one; for a delta every link of its chain up to it,
    found beside it (visible or moved aside). With a link missing (or half-written) the chain stops before it
    (:attr:`Chain.missing`); raises ``FileNotFoundError`` when the full link itself is missing."""
    info = link_info(path)
    if info is None or int(info["link"]) == 0:
        return Chain([path], 0)
    chain, wanted = info["chain"], int(info["link"])
    found = {wanted: path}
    for candidate in path.parent.iterdir():
        if candidate.name.endswith(".partial") or not directory.is_checkpoint(candidate):
            continue
        other = link_info(candidate)
        if other is not None and other["chain"] == chain and int(other["link"]) < wanted:
            found.setdefault(int(other["link"]), candidate)
    if 0 not in found:
        raise FileNotFoundError(
            f"{path} is link {wanted} of an incremental checkpoint chain whose full checkpoint (link 0 of chain "
            f"{chain}) is not in {path.parent}: a delta cannot be restored without it. Resume from a full "
            "checkpoint (one whose dlrover.json has link 0 or no 'incremental' entry)."
        )
    links = []
    for i in range(wanted + 1):
        if i not in found:
            return Chain(links, wanted, missing=i)
        links.append(found[i])
    return Chain(links, wanted)


def _hidden_name(info: dict[str, Any]) -> str:
    return f"{HIDDEN_PREFIX}{info['chain']}-{int(info['link']):06d}"


def retire(path: Path) -> None:
    """Removes the checkpoint directory ``path`` (rank 0): a link of a chain is moved aside (hidden) instead, for the
    deltas that still need it; :func:`collect` deletes it once nothing can."""
    info = link_info(path)
    if info is None or not path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
        if path.exists() and not path.is_dir():
            path.unlink()
        return
    target = path.with_name(_hidden_name(info))
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)
    path.rename(target)


def collect(checkpoint_dir: Path, live_chain: str) -> list[Path]:
    """Deletes the links moved aside under ``checkpoint_dir`` (rank 0) that nothing needs any more: those of chains
    other than ``live_chain`` that no visible checkpoint of their chain follows. Returns the deleted paths."""
    hidden, needed = [], {}
    for candidate in checkpoint_dir.iterdir():
        info = link_info(candidate)
        if info is None:
            continue
        if candidate.name.startswith(HIDDEN_PREFIX):
            hidden.append((candidate, info))
        elif not candidate.name.endswith(".partial"):
            needed[info["chain"]] = max(needed.get(info["chain"], -1), int(info["link"]))
    deleted = []
    for candidate, info in hidden:
        if info["chain"] != live_chain and int(info["link"]) >= needed.get(info["chain"], -1):
            shutil.rmtree(candidate, ignore_errors=True)
            deleted.append(candidate)
    return deleted
