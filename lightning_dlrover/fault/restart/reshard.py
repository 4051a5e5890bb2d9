"""Recovery across a worker restart: survivors spill their coded state to shared memory, the restarted
job decodes the lost ranks from it and re-shards everything onto its own (possibly different) world.

The elastic launcher (``torchrun``) restarts every worker of the job when one fails, so in-memory state
must outlive the worker process. When a rank sees a failure (a collective raising on a dead peer or on
its timeout, or the launcher's SIGTERM), it rolls back to the last committed step and *spills*: it writes
its ``k`` data chunks, its ``r`` parity chunks, every rank's chunk layout, every rank's random generators and
the committed trainer state (loops, data position, callbacks, dense parameters, buffers and optimizer state)
to one file in a node-local shared-memory directory (see :mod:`lightning_dlrover.fault.restart.spill`). Spilling
reads memory only; it needs no peer.

The restarted workers (survivors, replacements, or fewer or more ranks) call :func:`restore` from
``DLRoverStrategy.setup``, after TorchRec has sharded the model for the new world:

1. Every worker reads its share of the spills on its node and all workers gather what is held where.
   The spills of the latest commit that most ranks reached form the recovery point; ranks without one
   are lost. More than ``r`` lost members of one parity group cannot be decoded (:class:`Unrecoverable`).
2. Decode: each lost rank's ``k`` chunks are rebuilt on one worker from ``k`` surviving shards of each of
   its groups (data chunks and parity, fetched from whichever worker holds them).
3. Re-shard: every old segment (a shard of a table's weights or of one optimizer state) is cut along the
   new plan's shards of the same state-dict tensor and sent to the worker owning each piece, which writes
   it into TorchRec's live buffers. Every byte of the new layout must be covered, or nothing is resumed.

Parity is then encoded afresh for the new layout by :class:`~lightning_dlrover.fault.CodedEmbeddings`, or, when
the layout is unchanged and every survivor got its own spill back, kept on the survivors and encoded for the lost
ranks only.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dlrover import control_plane
from lightning_dlrover.fault.coding.coded_state import CodedState, SegmentSpec, chunk_layout
from lightning_dlrover.fault.coding.decode import decode_lost
from lightning_dlrover.fault.coding.placement import ParityPlacement
from lightning_dlrover.fault.report import RecoveryReport, Unrecoverable
from lightning_dlrover.fault.restart.spill import Spill


def restore(state: CodedState | None, spills: list[Spill]) -> RecoveryReport | None:
    """Rebuilds the committed embedding state of a failed job from the spills into ``state``'s live buffers
    (a collective on every rank of the new job; ``state`` is ``None`` when this job has no parity). Returns a
    report with the spilled trainer state, or ``None`` when no rank has a spill. Raises :class:`Unrecoverable`
    on every rank alike."""
    me, world = dist.get_rank(), dist.get_world_size()
    gathered: list[list[tuple[int, tuple[int, ...], bool]]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, [(s.rank, s.generation, s.tentative) for s in spills], group=control_plane.group())
    entries = [(holder, rank, gen, tentative) for holder, held in enumerate(gathered) for rank, gen, tentative in held]
    committed = {gen for _, _, gen, tentative in entries if not tentative}  # tentative spills only join these
    entries = [entry for entry in entries if entry[2] in committed]
    if not entries:
        return None
    counts = Counter(gen for _, _, gen, _ in entries)
    generation = max(counts, key=lambda gen: (counts[gen], gen[1]))
    old_world, step, k, r, local_world_size = generation
    if state is None:
        raise Unrecoverable(f"The job stopped at step {step}, and this job keeps no parity of its embedding state.", step)
    holders: dict[int, int] = {}
    for holder, rank, gen, _ in entries:
        if gen == generation:
            holders.setdefault(rank, holder)
    held = {s.rank: s for s in spills if s.generation == generation and holders[s.rank] == me}
    source_holder = min(holder for holder, _, gen, tentative in entries if gen == generation and not tentative)
    placement = ParityPlacement(old_world, k, r, local_world_size)
    lost = sorted(set(range(old_world)) - holders.keys())
    for group in range(old_world):
        if sum(m in lost for m in placement.members(group)) > r:
            raise Unrecoverable(
                f"{len(lost)} of {old_world} ranks lost their state at step {step} (ranks {lost}); parity group "
                f"{group} (ranks {placement.members(group)}) lost more than r={r} members and cannot be decoded.",
                step,
            )
    source = [None, None, None, None]
    if me == source_holder:  # a committed spill: a tentative one has no trainer nor rank states
        first = min((s for s in held.values() if not s.tentative), key=lambda s: s.rank)
        source = [first.layouts, first.chunk_len, first.meta, first.rank_states]
    dist.broadcast_object_list(source, src=source_holder, group=control_plane.group())
    layouts, chunk_len, meta, rank_states = source

    started = time.perf_counter()
    # Each lost rank is rebuilt on the worker holding its first parity source; with k = 1 that source *is* its
    # chunk (a view of the spill, nothing decoded or copied), and otherwise one of its k sources is local.
    decoder = {}
    for rank, _, sources in placement.decode_plan(lost):
        decoder.setdefault(rank, holders[next((src for src, shard in sources if shard >= k), sources[0][0])])
    where = {**holders, **decoder}
    chunks = {rank: spill.chunks for rank, spill in held.items()}
    aliased = [rank for rank in lost if k == 1 and decoder[rank] == me]
    for rank, _, sources in placement.decode_plan(aliased):
        (src, shard), = sources
        chunks[rank] = held[src].parity[shard - k : shard - k + 1] if shard >= k else held[src].chunks[shard : shard + 1]
    if k > 1:
        chunks.update(
            decode_lost(
                placement, layouts, chunk_len, lost, me,
                holder=holders.__getitem__,
                decoder=decoder.__getitem__,
                sources=lambda rank, shard: [(0, held[rank].chunks[shard] if shard < k else held[rank].parity[shard - k])],
            )
        )  # fmt: skip
    decoded = time.perf_counter()
    _reshard(state, layouts, chunk_len, chunks, where, step)
    kept = (old_world == world and k == state.k and chunk_len == state.chunk_len and layouts == state.layouts
            and all(holder == rank for rank, holder in holders.items()))
    return RecoveryReport(step, old_world, lost, decoded - started, time.perf_counter() - decoded, meta, rank_states,
                          layout_kept=kept, code=(k, r, local_world_size),
                          parity=held[me].parity if kept and me in held else None)


def _reshard(state: CodedState, layouts: list[list[SegmentSpec]], chunk_len: int, chunks: dict[int, Tensor],
             where: dict[int, int], step: int) -> None:
    """Moves every piece of the old segments to the new segments it overlaps, straight between the chunks held
    (``chunks``; old rank ``r``'s are on worker ``where[r]``) and the live TorchRec buffers: every worker derives the
    same list of transfers from the layouts, so no header travels; full rows are sent and received as views."""
    me, control = dist.get_rank(), control_plane.group()
    targets: dict[str, list[tuple[int, int, SegmentSpec]]] = defaultdict(list)
    for rank, specs in enumerate(state.layouts):
        for index, spec in enumerate(specs):
            if spec.rows:
                targets[spec.key].append((rank, index, spec))
    tags: dict[tuple[int, int], int] = defaultdict(int)
    works, copies = [], []
    changed = set()
    covered = [0] * len(state.segments)
    for rank in sorted(where):
        src, specs = where[rank], layouts[rank]
        for piece in chunk_layout(specs, chunk_len):
            spec = specs[piece.segment]
            lo, hi = spec.offsets[0] + piece.row_lo, spec.offsets[0] + piece.row_hi
            for dst, index, new in targets.get(spec.key, []):
                if new.global_size != spec.global_size:
                    changed.add(spec.key)
                    continue
                r0, r1 = max(lo, new.offsets[0]), min(hi, new.offsets[0] + new.rows)
                b0, b1 = _byte_columns(spec, new)
                if r0 >= r1 or b0 >= b1 or me not in (src, dst):
                    if r0 < r1 and b0 < b1 and src != dst:
                        tags[src, dst] += 1
                    continue
                src_b0 = b0 + _column_bytes(new) - _column_bytes(spec)
                tag = tags[src, dst]
                if src != dst:
                    tags[src, dst] += 1
                if src == me:
                    rows = chunks[rank][piece.chunk][piece.slot * spec.row_bytes :][: (piece.row_hi - piece.row_lo) * spec.row_bytes]
                    data = rows.view(-1, spec.row_bytes)[r0 - lo : r1 - lo, src_b0 : src_b0 + b1 - b0]
                if dst == me:
                    out = state.segments[index].row_view()[r0 - new.offsets[0] : r1 - new.offsets[0], b0:b1]
                    covered[index] += out.numel()
                if src == dst:
                    out.copy_(data)
                elif src == me:
                    works.append(dist.isend(data if data.is_contiguous() else data.contiguous(), dst, group=control, tag=tag))
                elif out.is_contiguous():
                    works.append(dist.irecv(out.view(-1), src, group=control, tag=tag))
                else:  # a column slice of the new rows: received whole, then copied in
                    buffer = torch.empty(out.shape, dtype=torch.uint8)
                    works.append(dist.irecv(buffer, src, group=control, tag=tag))
                    copies.append((out, buffer))
    for work in works:
        work.wait()
    for out, buffer in copies:
        out.copy_(buffer)
    missing = [s.key for s, seg, got in zip(state.specs, state.segments, covered) if got != seg.rows * seg.row_bytes]
    failed = torch.tensor([len(missing) + len(changed)])
    dist.all_reduce(failed, group=control_plane.group())
    if int(failed):
        raise Unrecoverable(
            f"The spilled state of step {step} does not cover the new sharding plan (changed global shapes: "
            f"{sorted(changed) or 'none'}; uncovered here: {missing or 'none'}). Column-wise shards of a table "
            "must keep their count across world sizes: pin it with a TableConstraint(min_partition=...).",
            step,
        )


def _column_bytes(spec: SegmentSpec) -> int:
    """Byte offset of the segment's first column within a full row of its tensor."""
    return spec.offsets[1] * (spec.row_bytes // spec.sizes[1]) if len(spec.sizes) > 1 else 0


def _byte_columns(old: SegmentSpec, new: SegmentSpec) -> tuple[int, int]:
    """Bytes ``[b0, b1)`` of a ``new`` row that ``old`` covers, relative to the start of the ``new`` row."""
    start = max(_column_bytes(old), _column_bytes(new))
    end = min(_column_bytes(old) + old.row_bytes, _column_bytes(new) + new.row_bytes)
    return start - _column_bytes(new), end - _column_bytes(new)
