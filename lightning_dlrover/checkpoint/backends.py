"""Sharded checkpoint backends: every rank writes its own shards, and loads into any sharding layout.

A backend saves and loads a nested ``dict`` whose leaves are tensors or ``ShardedTensor``s; it is
called on every rank at once (a collective). Loading is in place: the caller passes a dict shaped like
the one saved, holding the live tensors of the current (possibly different) sharding plan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any


class CheckpointBackend(ABC):
    """Saves and loads the sharded part of a training state."""

    name: str
    #: Whether ``load`` fills the shards of ranks that did not exist when the checkpoint was written.
    restores_onto_new_ranks: bool = True

    @abstractmethod
    def save(self, state: dict[str, Any], path: Path, group: Any = None) -> None:
        """Writes ``state`` under the directory ``path`` (collective over ``group``; ``None``: the default group)."""

    @abstractmethod
    def load(self, state: dict[str, Any], path: Path) -> None:
        """Fills the tensors of ``state`` in place from the checkpoint in ``path`` (collective)."""


class DCPBackend(CheckpointBackend):
    """``torch.distributed.checkpoint``: one file per rank plus a global metadata file."""

    name = "dcp"

    def save(self, state: dict[str, Any], path: Path, group: Any = None) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=str(path), process_group=group)

    def load(self, state: dict[str, Any], path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(state, checkpoint_id=str(path))


class TorchSnapshotBackend(CheckpointBackend):
    """``torchsnapshot`` (last released 2022): chunked per-shard files with a manifest."""

    name = "torchsnapshot"
    # torchsnapshot 0.1.0 gives a rank beyond the saved world size only replicated entries (measured).
    restores_onto_new_ranks = False

    def save(self, state: dict[str, Any], path: Path, group: Any = None) -> None:
        from torchsnapshot import Snapshot, StateDict

        # Tensors that are not sharded are replicated (dense parameters): stored once, readable by any rank.
        Snapshot.take(str(path), app_state={"state": StateDict(state)}, pg=group, replicated=["**"])

    def load(self, state: dict[str, Any], path: Path) -> None:
        from torchsnapshot import Snapshot, StateDict

        # Tensors are restored in place; the dict torchsnapshot hands back omits sharded entries on ranks
        # that did not exist when the snapshot was taken, so it is not used.
        Snapshot(str(path)).restore(app_state={"state": StateDict(dict(state))})


BACKENDS: dict[str, type[CheckpointBackend]] = {b.name: b for b in (DCPBackend, TorchSnapshotBackend)}


def get_backend(name: str) -> CheckpointBackend:
    """The backend called ``name``; raises a ``ValueError`` listing the choices otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"strategy.checkpoint_backend={name!r} is not one of {sorted(BACKENDS)}.")
    return BACKENDS[name]()
