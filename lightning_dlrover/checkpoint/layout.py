"""Row-wise optimizer states across column layouts: restoring a checkpoint into a sharding plan whose column split of
a table differs from the one that wrote it (table-wise into column-wise, column-wise into table-wise, 2 column shards
into 4).

A row-wise optimizer state (row-wise Adagrad's ``momentum1``: one value per row) is kept by TorchRec per column shard:
a table cut into ``k`` column shards has ``k`` momenta per row, the mean of the squared gradients over that shard's
columns, stored as one ``ShardedTensor`` of ``k * rows`` values (shard ``i``, in column order, at rows
``[i * rows, (i + 1) * rows)``). The backends cannot restore ``k`` values per row into ``k'``: DCP fails with
``Size mismatch``. The accumulated value is linear in the per-column squared gradients, so the momentum of a set of
columns made of whole saved shards is the column-weighted mean of theirs (column-wise into table-wise: exact, up to
the rounding of one weighted mean in float64). A target shard that cuts a saved shard gets the mean of the saved
shards it overlaps, weighted by the overlap: the per-column values inside one saved shard were never stored, so this
is the best estimate (table-wise into column-wise: each column shard starts from the table's momentum; back into the
table-wise layout it gives the saved momentum exactly).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor


@dataclass
class Relayout:
    """One row-wise state saved with another column split than the live one's, read whole (:attr:`saved`)."""

    path: str  # the entry's ``flatten`` path (as in a delta's rows files)
    states: dict[str, Any]  # the dict holding the entry in the state being restored
    name: str
    live: ShardedTensor
    saved: torch.Tensor  # the saved entry, plain: ``k * rows`` values
    saved_columns: list[tuple[int, int]]
    live_columns: list[tuple[int, int]]

    def finish(self) -> None:
        """Writes the saved values, converted to the live column split, into the live local shards and puts the entry
        back into the restored state."""
        rows = self.saved.numel() // len(self.saved_columns)
        saved = self.saved.view(len(self.saved_columns), rows).to(torch.float64)
        for shard in self.live.local_shards():
            index = shard.metadata.shard_offsets[0] // rows
            lo, hi = self.live_columns[index]
            value = torch.zeros(rows, dtype=torch.float64)
            for (start, end), momentum in zip(self.saved_columns, saved, strict=True):
                overlap = min(hi, end) - max(lo, start)
                if overlap > 0:
                    value += overlap * momentum
            shard.tensor.copy_((value / (hi - lo)).to(shard.tensor.dtype))
        self.states[self.name] = self.live


def _columns(chunks: Any, count: int) -> list[tuple[int, int]]:
    """The distinct column ranges of a table's chunks, in column order (``count`` equal unit ranges without them)."""
    ranges = sorted({(int(o[1]), int(o[1]) + int(s[1])) for o, s in chunks if len(o) > 1})
    return ranges if len(ranges) == count else [(i, i + 1) for i in range(count)]


def take_relayouts(sharded: dict[str, Any], checkpoint: Path) -> list[Relayout]:
    """The 1-D ``ShardedTensor``s of ``sharded["fused_optimizer"]`` whose size in the DCP checkpoint ``checkpoint``
    (its ``sharded/`` directory) differs from the live one's: taken out of ``sharded`` (so the backend restores the
    rest) and read whole (a collective). Call :meth:`Relayout.finish` on each once the restore is done."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    found: list[Relayout] = []
    wanted: dict[str, Any] = {}
    for outer, states in sharded.get("fused_optimizer", {}).items():
        for name, live in list(states.items()):
            saved = metadata.get(f"fused_optimizer.{outer}.{name}")
            if not isinstance(live, ShardedTensor) or len(live.size()) != 1 or not hasattr(saved, "size") or \
                    tuple(saved.size) == tuple(live.size()):
                continue
            weight = sharded.get("model", {}).get(outer)
            live_chunks = [(m.shard_offsets, m.shard_sizes) for m in weight.metadata().shards_metadata] \
                if isinstance(weight, ShardedTensor) else []
            rows = weight.size()[0] if isinstance(weight, ShardedTensor) else None
            if rows is None or live.size()[0] % rows or saved.size[0] % rows:
                continue  # not a per-row state of this table: left to the backend (it names the mismatch)
            saved_chunks = [(c.offsets, c.sizes) for c in getattr(metadata.get(f"model.{outer}"), "chunks", [])]
            relayout = Relayout(f"fused_optimizer/{outer}/{name}", states, name, live,
                                torch.empty(tuple(saved.size), dtype=saved.properties.dtype),
                                _columns(saved_chunks, saved.size[0] // rows),
                                _columns(live_chunks, live.size()[0] // rows))
            del states[name]
            wanted.setdefault(outer, {})[name] = relayout.saved
            found.append(relayout)
    if found:
        dcp.load({"fused_optimizer": wanted}, checkpoint_id=str(checkpoint))
    return found
