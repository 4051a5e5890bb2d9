"""A rank's embedding state as ``k`` byte chunks, and the rows each training step changes in it.

The coded state of a rank is every local shard of its fused embedding kernels: each table shard's
weights ``[rows, cols]`` and each of its optimizer states (e.g. row-wise Adagrad ``momentum1``
``[rows]``), in TorchRec's own buffers. Row ``j`` of such a *segment* is ``row_bytes`` bytes. Rows are
laid out in ``k`` chunks of ``chunk_len`` bytes (the same on every rank): a segment's rows fill the current
chunk from a position aligned to its ``row_bytes`` and continue in the next chunk, so a row never
straddles two chunks and chunk ``c`` read as ``[chunk_len / row_bytes, row_bytes]`` holds it at one index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from lightning_dlrover import control_plane
from lightning_dlrover.checkpoint.sharded import flatten
from lightning_dlrover.fault.coding.undo_log import UndoLog
from lightning_dlrover.parity import as_bytes
from lightning_dlrover.torchrec_glue import fused_embedding_kernels, kernel_input_ids

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Segment:
    """One coded tensor: ``tensor`` is a live 2-D or 1-D view ``[rows, ...]`` of a TorchRec buffer."""

    name: str
    table: int
    tensor: Tensor

    @cached_property
    def rows(self) -> int:
        return self.tensor.shape[0]

    @cached_property
    def row_bytes(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size() if self.rows else 0

    def row_view(self) -> Tensor:
        """uint8 ``[rows, row_bytes]`` zero-copy view."""
        return as_bytes(self.tensor.reshape(self.rows, -1))


@dataclass(frozen=True)
class SegmentSpec:
    """Where a segment sits in the training state, independent of the rank and plan that hold it.

    ``key`` is the path of its ``ShardedTensor`` in ``{"model": state_dict, "fused_optimizer": state}``;
    the segment is the shard at ``offsets`` with ``sizes`` of that tensor (global shape ``global_size``).
    """

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_size: tuple[int, ...]
    row_bytes: int

    @property
    def rows(self) -> int:
        return self.sizes[0]


@dataclass(frozen=True)
class Piece:
    """Rows ``[row_lo, row_hi)`` of a segment stored in ``chunk`` from row slot ``slot`` (in units of row_bytes)."""

    segment: int
    row_lo: int
    row_hi: int
    chunk: int
    slot: int


def chunk_layout(specs: list[SegmentSpec], chunk_len: int) -> list[Piece]:
    """Places every segment's rows in chunks of ``chunk_len`` bytes (see the module docstring)."""
    pieces, chunk, pos = [], 0, 0
    for index, spec in enumerate(specs):
        row = 0
        while row < spec.rows:
            pos = math.ceil(pos / spec.row_bytes) * spec.row_bytes
            fit = min(spec.rows - row, (chunk_len - pos) // spec.row_bytes)
            if fit == 0:
                chunk, pos = chunk + 1, 0
                continue
            pieces.append(Piece(index, row, row + fit, chunk, pos // spec.row_bytes))
            row, pos = row + fit, pos + fit * spec.row_bytes
    return pieces


def _shard_specs(module: nn.Module) -> dict[int, SegmentSpec]:
    """``SegmentSpec`` of every local shard of the model's and fused optimizer's ``ShardedTensor``s, by data pointer.

    TorchRec's state dicts hold views of the fused kernels' buffers, so a segment is found by its address.
    """
    state = {"model": module.state_dict(), "fused_optimizer": module.fused_optimizer.state_dict()["state"]}
    specs = {}
    for key, value in flatten(state):
        for shard in value.local_shards() if isinstance(value, ShardedTensor) else []:
            tensor, meta = shard.tensor, shard.metadata
            row_bytes = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
            specs[tensor.data_ptr()] = SegmentSpec(
                key, tuple(meta.shard_offsets), tuple(meta.shard_sizes), tuple(value.metadata().size), row_bytes
            )
    return specs


class CodedState:
    """This rank's coded embedding state, its chunk layout and the rows touched in the current step.

    Args:
        module: the sharded model (after ``DistributedModelParallel``).
        k: data chunks per rank (the code's ``k``).
    """

    def __init__(self, module: nn.Module, k: int) -> None:
        segments: list[Segment] = []
        self._hooks = []
        num_tables = 0
        for kernel in fused_embedding_kernels(module):
            self._hooks.append(kernel.register_forward_pre_hook(self._capture(kernel, first_table=num_tables)))
            states = kernel.emb_module.split_optimizer_states() or []  # SGD keeps no state: an empty list
            tables, weights = kernel.config.embedding_tables, kernel.split_embedding_weights()
            for i, (table, weight) in enumerate(zip(tables, weights)):
                table_states = states[i] if i < len(states) else []
                index, num_tables = num_tables, num_tables + 1
                offsets = ",".join(map(str, table.local_metadata.shard_offsets)) if table.local_metadata else "0"
                segments.append(Segment(f"{table.name}@{offsets}/weight", index, weight))
                for s, state in enumerate(table_states):
                    segments.append(Segment(f"{table.name}@{offsets}/state{s}", index, state))
        by_address = _shard_specs(module)
        self._build(segments, [self._spec(seg, by_address) for seg in segments], k)

    @classmethod
    def of_segments(cls, segments: list[Segment], specs: list[SegmentSpec], k: int) -> CodedState:
        """A coded state over ``segments`` described by ``specs`` (collective), without a TorchRec model: no forward
        hooks, rows are logged with :meth:`_touch` (tests, and coding tensors other than a model's tables)."""
        state = cls.__new__(cls)
        state._hooks = []
        state._build(segments, specs, k)
        return state

    def _build(self, segments: list[Segment], specs: list[SegmentSpec], k: int) -> None:
        self.k = k
        self.segments = segments
        devices = {seg.tensor.device for seg in segments}
        if len(devices) > 1:
            raise ValueError(f"the coded segments of a rank must be on one device; got {sorted(map(str, devices))}")
        #: Where the segments live: the parity, undo logs and deltas that code them are kept there too.
        self.device = devices.pop() if devices else torch.device("cpu")
        self.specs = specs
        self.share_layout()
        self.pieces = chunk_layout(self.specs, self.chunk_len)
        self._segments_of_table: dict[int, list[int]] = {}
        for index, seg in enumerate(self.segments):
            self._segments_of_table.setdefault(seg.table, []).append(index)
        # On the segments' device: they index the logged rows, which live there (the undo log).
        # Untested on GPU: the piece index on a CUDA device (split_by_chunk and locate then run there).
        self._piece_index = [
            (
                torch.tensor([p.row_lo for p in pieces], dtype=torch.int64, device=self.device),
                torch.tensor([p.chunk for p in pieces], dtype=torch.int64, device=self.device),
                torch.tensor([p.slot - p.row_lo for p in pieces], dtype=torch.int64, device=self.device),
            )
            for pieces in ([p for p in self.pieces if p.segment == i] for i in range(len(self.segments)))
        ]
        #: Each table's undo log: the rows touched since the last commit and their committed values.
        self._logs = {t: UndoLog([self.segments[i].tensor for i in seg]) for t, seg in self._segments_of_table.items()}

    def share_layout(self) -> None:
        """Gathers every rank's segment specs and agrees on the chunk length (collective; a rank joining a running
        job builds its state while the others call this again)."""
        layouts: list[list[SegmentSpec]] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(layouts, self.specs, group=control_plane.group())
        chunk_len = self._agree_chunk_len(layouts)
        # Set only once agreed: a rank whose recovery breaks in here still spills its last complete layout.
        #: Every rank's segment specs, by rank (a recovery needs the layout of lost ranks).
        self.layouts = layouts
        self.chunk_len = chunk_len

    @staticmethod
    def _spec(segment: Segment, by_address: dict[int, SegmentSpec]) -> SegmentSpec:
        if not segment.rows:
            return SegmentSpec(segment.name, (0,), (0,), (0,), 0)
        spec = by_address.get(segment.tensor.data_ptr())
        if spec is None or spec.rows != segment.rows or spec.row_bytes != segment.row_bytes:
            raise RuntimeError(
                f"Embedding segment {segment.name} is not a shard of the model's or fused optimizer's state dict; "
                "this TorchRec kernel does not expose its buffers as state-dict views, which parity coding needs."
            )
        return spec

    @property
    def num_bytes(self) -> int:
        """Bytes of coded state on this rank."""
        return sum(s.rows * s.row_bytes for s in self.segments)

    def _agree_chunk_len(self, layouts: list[list[SegmentSpec]]) -> int:
        """The smallest chunk length, a multiple of every rank's row sizes, that fits every rank's rows in ``k`` chunks."""
        row_sizes = sorted({s.row_bytes for s in self.segments if s.rows})
        align = math.lcm(1, *(spec.row_bytes for specs in layouts for spec in specs if spec.rows))
        chunk_len = math.ceil(self.num_bytes / self.k / align) * align or align
        step = max(align, math.ceil(len(self.segments) * max(row_sizes, default=1) / self.k / align) * align)
        while (pieces := chunk_layout(self.specs, chunk_len)) and pieces[-1].chunk >= self.k:
            chunk_len += step  # row alignment and chunk ends leave padding
        agreed = torch.tensor([chunk_len], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=control_plane.group())
        return int(agreed)

    def read_chunk(self, chunk: int, out: Tensor | None = None) -> Tensor:
        """A copy of chunk ``chunk``: uint8 ``[chunk_len]`` (padding bytes are zero), written into ``out`` if given."""
        out = torch.zeros(self.chunk_len, dtype=torch.uint8) if out is None else out.zero_()
        for p in self.pieces:
            if p.chunk == chunk:
                seg = self.segments[p.segment]
                start = p.slot * seg.row_bytes
                out[start : start + (p.row_hi - p.row_lo) * seg.row_bytes] = seg.row_view()[p.row_lo : p.row_hi].reshape(-1)
        return out

    def chunk_regions(self, chunk: int) -> list[tuple[int, Tensor]]:
        """``(start, view)`` of every piece of chunk ``chunk``: zero-copy uint8 views of the live TorchRec buffers
        holding the chunk's bytes ``[start, start + view.numel())``, in increasing order (padding is not held)."""
        out = []
        for p in self.pieces:
            if p.chunk == chunk:
                seg = self.segments[p.segment]
                out.append((p.slot * seg.row_bytes, seg.row_view()[p.row_lo : p.row_hi].reshape(-1)))
        return sorted(out, key=lambda region: region[0])

    def write_chunk(self, chunk: int, data: Tensor) -> None:
        """Writes chunk ``chunk`` (uint8 ``[chunk_len]``) into the live TorchRec buffers."""
        for p in self.pieces:
            if p.chunk == chunk:
                seg = self.segments[p.segment]
                start = p.slot * seg.row_bytes
                rows = data[start : start + (p.row_hi - p.row_lo) * seg.row_bytes].view(-1, seg.row_bytes)
                seg.row_view()[p.row_lo : p.row_hi] = rows

    def split_by_chunk(self, segment: int, rows: Tensor) -> list[tuple[int, int, int, Tensor]]:
        """``(chunk, lo, hi, slots)`` for each chunk holding some of ``rows`` (int64 [m], increasing): ``rows[lo:hi]``
        lie in ``chunk`` at row slots ``slots`` (units of the segment's ``row_bytes``)."""
        bounds, chunks, shifts = self._piece_index[segment]
        if len(bounds) == 1:  # the segment lies in one chunk: no search
            return [(int(chunks[0]), 0, len(rows), rows + int(shifts[0]))]
        chunk_of, slots = self.locate(segment, rows)
        first, last = int(chunk_of[0]), int(chunk_of[-1])
        edges = torch.searchsorted(chunk_of, torch.arange(first, last + 2, device=chunk_of.device)).tolist()
        return [(c, lo, hi, slots[lo:hi]) for c, lo, hi in zip(range(first, last + 1), edges, edges[1:]) if lo < hi]

    def locate(self, segment: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Chunk index and row slot (units of the segment's ``row_bytes``) of each of ``rows`` (int64 [m])."""
        bounds, chunks, shifts = self._piece_index[segment]
        which = torch.searchsorted(bounds, rows, right=True) - 1
        return chunks[which], shifts[which] + rows

    def _capture(self, kernel: nn.Module, first_table: int):
        """A forward pre-hook recording the rows ``kernel`` will update (its input ids, per table)."""

        def hook(module: nn.Module, args: tuple) -> None:
            if not torch.is_grad_enabled() or not module.training:
                return
            for t, ids in enumerate(kernel_input_ids(kernel, args[0])):
                self._touch(first_table + t, ids)

        return hook

    def _touch(self, table: int, ids: Tensor) -> None:
        """Records rows of ``table`` about to be updated and saves their current values (the undo log); rows already
        touched since the last commit keep their first (committed) values."""
        self._logs[table].capture(ids)

    def logged(self) -> list[tuple[int, Tensor, Tensor, Tensor]]:
        """``(segment, rows, at, log)`` for every segment changed since :meth:`commit`: the touched rows in increasing
        order, and the segment's undo log, where ``log[at[i]]`` is the committed value of ``rows[i]`` (no copy; valid
        until the next forward or commit)."""
        out = []
        for table, log in self._logs.items():
            if len(log):
                rows, at = log.sorted()
                out += [(index, rows, at, log.values[j]) for j, index in enumerate(self._segments_of_table[table])]
        return sorted(out, key=lambda entry: entry[0])

    def touched(self) -> list[tuple[int, Tensor, Tensor]]:
        """``(segment, rows, old)`` for every segment changed since :meth:`commit`: the touched rows in increasing
        order and their committed values (aligned with ``rows``; a copy, see :meth:`logged`)."""
        return [(index, rows, log.index_select(0, at)) for index, rows, at, log in self.logged()]

    def rollback(self) -> None:
        """Restores every row touched since :meth:`commit` to its committed values."""
        for log in self._logs.values():
            log.rollback()

    def commit(self) -> None:
        """Forgets the undo log: the current bytes become the committed state."""
        for log in self._logs.values():
            log.clear()

    def close(self) -> None:
        """Removes the forward hooks."""
        for hook in self._hooks:
            hook.remove()
