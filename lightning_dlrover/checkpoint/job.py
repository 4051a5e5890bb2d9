"""Saving and loading a sharded job's checkpoint directory (see :mod:`lightning_dlrover.checkpoint.directory`):
the model (sharded tables as ``ShardedTensor``s) and the fused embedding optimizer's state go to a backend, the
rest of Lightning's checkpoint dict to ``meta.pt``; a delta of an incremental chain
(:mod:`~lightning_dlrover.checkpoint.incremental`) writes its tables' changed rows apart. Every function here is a
collective: every rank calls it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dlrover.checkpoint import directory, incremental, layout
from lightning_dlrover.checkpoint.backends import CheckpointBackend, get_backend
from lightning_dlrover.checkpoint.sharded import Later, complete_sharded_state, copy_state

if TYPE_CHECKING:
    from torchrec.optim.keyed import KeyedOptimizer


def fused_optimizer_state(optimizer: KeyedOptimizer) -> dict[str, Any]:
    """The fused optimizer's state (not its hyper-parameters, which come from the model), keyed alike on every rank."""
    return complete_sharded_state(optimizer.state_dict()["state"])


@dataclass
class PendingSave:
    """A checkpoint whose state is gathered on every rank but not written yet (see :func:`prepare`)."""

    path: Path
    staging: Path
    backend: CheckpointBackend
    sharded: dict[str, Any]
    meta: dict[str, Any] | None  # rank 0 only
    info: dict[str, Any] | None  # rank 0 only
    #: The global step the checkpoint holds.
    step: int
    #: Bytes of the copy :func:`prepare` made (0 when it made none).
    staged_bytes: int = 0
    #: A delta's changed rows on this rank (``None``: a full checkpoint).
    rows: incremental.Rows | None = None
    #: What a delta left out of ``sharded`` (the tracked entries' paths).
    tracked: set[str] = field(default_factory=set)
    #: ``{"chain": ID, "link": i, ...}`` of a link of an incremental chain (``None``: no chain).
    link: dict[str, Any] | None = None
    #: ``(live, staging)`` local shards :func:`prepare` left to its caller to copy before the write (a pre-copy).
    later: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def write(self, group: Any = None, after_shards: Callable[[], None] | None = None) -> None:
        """Writes every rank's shards, then (after ``after_shards``) on rank 0 ``meta.pt`` and ``dlrover.json``,
        under the temporary name (a collective over ``group``). The checkpoint does not count until :meth:`commit`."""
        self.backend.save(self.sharded, self.staging / directory.SHARDED_DIR, group=group)
        if self.rows is not None:
            incremental.write_rows(self.staging, dist.get_rank(), self.rows)
        if after_shards is not None:
            after_shards()
        if self.meta is not None and self.info is not None:
            directory.write_meta(self.staging, self.meta, self.info)

    def commit(self) -> None:
        """Renames the written checkpoint to its final name (rank 0; call once every rank's :meth:`write` is done)."""
        if self.meta is not None:
            if self.path.exists():  # a link of an incremental chain is kept aside for the deltas that need it
                incremental.retire(self.path)
            directory.publish(self.staging, self.path)

    def discard(self) -> None:
        """Removes what a failed :meth:`write` left under the temporary name (rank 0)."""
        if self.meta is not None:
            shutil.rmtree(self.staging, ignore_errors=True)


def prepare(
    checkpoint: dict[str, Any],
    path: Path,
    backend: CheckpointBackend,
    fused_optimizer: KeyedOptimizer,
    *,
    world_size: int,
    is_global_zero: bool,
    barrier: Callable[[str], None],
    extra_meta: Callable[[], dict[str, Any]],
    copy: bool = False,
    reuse: PendingSave | None = None,
    link: dict[str, Any] | None = None,
    delta: tuple[set[str], dict[int, Any]] | None = None,
    later: set[str] | None = None,
) -> PendingSave:
    """Gathers what a checkpoint of ``checkpoint`` (Lightning's dict; its ``state_dict`` is taken out and saved
    sharded) at ``path`` holds (a collective). With ``copy``, every tensor is copied (see
    :func:`~lightning_dlrover.checkpoint.sharded.copy_state`), so training may go on while it is written, into the
    copy of ``reuse`` (an earlier save whose write is over) where the shapes agree.
    ``extra_meta`` (a collective, called on every rank) returns entries rank 0 adds to ``meta.pt``;
    ``barrier(name)`` synchronises the ranks. ``link`` (``{"chain": ID, "link": i}``) makes it a link of an
    incremental chain; ``delta`` (the tracked entries' paths, and the changed local rows of each tracked local shard
    by its data pointer) makes it a delta: the tracked entries' changed rows are copied out, the rest in full. With
    ``copy``, the local shards of the ``ShardedTensor``s at the paths in ``later`` are not copied but get staging
    memory (:attr:`PendingSave.later`: the caller fills it before :meth:`PendingSave.write`)."""
    staging = directory.staging_path(path)
    if is_global_zero and staging.exists():
        shutil.rmtree(staging)
    extra = extra_meta()
    barrier("dlrover_checkpoint_staging")
    sharded = {"model": checkpoint.pop("state_dict"), "fused_optimizer": fused_optimizer_state(fused_optimizer)}
    meta = {**checkpoint, **extra} if is_global_zero else None
    info = {"global_step": checkpoint["global_step"], "world_size": world_size, "backend": backend.name}
    if link is not None:
        info["incremental"] = link
    rows, tracked = None, set()
    if delta is not None:
        tracked, changed = delta
        rows = incremental.take_rows(sharded, tracked, changed)
        sharded = incremental.split(sharded, tracked)
    staged = rows.nbytes if rows is not None else 0
    deferred = Later(set(later or ()))
    if copy:
        old_sharded, old_meta = (reuse.sharded, reuse.meta) if reuse is not None else (None, None)
        sharded, size = copy_state(sharded, old_sharded, deferred if later else None)
        meta, meta_size = copy_state(meta, old_meta)
        staged += size + meta_size
    return PendingSave(path, staging, backend, sharded, meta, info if is_global_zero else None,
                       int(checkpoint["global_step"]), staged, rows, tracked, link, deferred.pairs)


def save(
    checkpoint: dict[str, Any],
    path: Path,
    backend: CheckpointBackend,
    fused_optimizer: KeyedOptimizer,
    *,
    world_size: int,
    is_global_zero: bool,
    barrier: Callable[[str], None],
    extra_meta: Callable[[], dict[str, Any]],
    link: dict[str, Any] | None = None,
    delta: tuple[set[str], dict[int, Any]] | None = None,
) -> PendingSave:
    """Writes ``checkpoint`` as a checkpoint directory at ``path`` (see :func:`prepare`), under a temporary name
    renamed when every rank's part is written, so a crash never leaves a partial checkpoint at ``path``."""
    pending = prepare(checkpoint, path, backend, fused_optimizer, world_size=world_size,
                      is_global_zero=is_global_zero, barrier=barrier, extra_meta=extra_meta, link=link, delta=delta)
    pending.write()
    barrier("dlrover_checkpoint_written")
    pending.commit()
    barrier("dlrover_checkpoint_committed")
    return pending


def load(
    path: Path,
    module: nn.Module,
    fused_optimizer: KeyedOptimizer,
    *,
    world_size: int,
    strict: bool = True,
    weights_only: bool | None = None,
    chain: incremental.Chain | None = None,
) -> dict[str, Any]:
    """Loads the checkpoint directory at ``path`` into ``module`` and ``fused_optimizer`` (in their current sharding,
    at any world size the backend can restore onto) and returns ``meta.pt``, read without unpickling arbitrary
    objects unless ``weights_only=False``. A delta of an incremental chain loads its chain (``chain``: the links to
    load, by default :func:`~lightning_dlrover.checkpoint.incremental.resolve`'s): the full link, every delta's rows
    in order, the last link's other entries and ``meta.pt``."""
    links = (chain or incremental.resolve(path)).links
    for link in links:
        info = directory.read_info(link)
        backend, saved_world_size = get_backend(info["backend"]), info["world_size"]
        if world_size > saved_world_size and not backend.restores_onto_new_ranks:
            raise RuntimeError(
                f"{link} was written by the {backend.name!r} backend at world size {saved_world_size}; it cannot "
                f"restore shards onto the new ranks of world size {world_size}. Resume at world size "
                f"<= {saved_world_size} or write checkpoints with DLRoverStrategy(checkpoint_backend='dcp')."
            )
    last = links[-1]
    meta = directory.read_meta(last, weights_only)
    sharded = {"model": module.state_dict(), "fused_optimizer": fused_optimizer_state(fused_optimizer)}
    # stateless table optimizers (SGD): the save wrote no entry for an empty dict, so none is asked for
    sharded["fused_optimizer"] = {k: v for k, v in sharded["fused_optimizer"].items() if v}
    if not sharded["fused_optimizer"]:
        del sharded["fused_optimizer"]
    first = get_backend(directory.read_info(links[0])["backend"])
    # row-wise optimizer states saved with another column split (table-wise into column-wise and back)
    relayouts = layout.take_relayouts(sharded, links[0] / directory.SHARDED_DIR) if first.name == "dcp" else []
    fused = sharded.get("fused_optimizer", {})
    if relayouts:  # a table whose every state was taken out has an empty dict, which no backend can ask for
        sharded = {**sharded, "fused_optimizer": {k: v for k, v in fused.items() if v}}
        if not sharded["fused_optimizer"]:
            del sharded["fused_optimizer"]
    first.load(sharded, links[0] / directory.SHARDED_DIR)
    if len(links) > 1:
        for link in links[1:]:
            incremental.apply_rows(link, sharded, plain={r.path: r.saved for r in relayouts})
        tracked = set(incremental.link_info(last).get("tracked", []))
        rest = incremental.split(sharded, tracked)
        backend.load(rest, last / directory.SHARDED_DIR)
        _merge(sharded, rest)
    for relayout in relayouts:
        relayout.finish()
    module.load_state_dict(sharded["model"], strict=strict)
    fused_optimizer.load_state_dict({"state": {k: fused.get(k, v) for k, v in fused_optimizer.state_dict()["state"].items()}})
    return meta


def _merge(into: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Puts the leaves of ``loaded`` (a backend may replace a dict's values rather than fill them) into ``into``."""
    for key, value in loaded.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def remove_partial(checkpoint_dir: Path) -> None:
    """Removes the half-written checkpoints (``*.partial``) a failed save left under ``checkpoint_dir``."""
    for partial in checkpoint_dir.glob("*.partial"):
        shutil.rmtree(partial, ignore_errors=True)
