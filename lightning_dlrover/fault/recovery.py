"""Recovery across a worker restart: survivors spill their coded state to shared memory, the restarted
job decodes the lost ranks from it and re-shards everything onto its own (possibly different) world.

The elastic launcher (``torchrun``) restarts every worker of the job when one fails, so in-memory state
must outlive the worker process. When a rank sees a failure (a collective raising on a dead peer or on
its timeout, or the launcher's SIGTERM), it rolls back to the last committed step and *spills*: it writes
its ``k`` data chunks, its ``r`` parity chunks, every rank's chunk layout and the committed trainer state
(loops, data position, callbacks, dense parameters and optimizer state) to one file in a node-local
shared-memory directory (:func:`spill_dir`). Spilling reads memory only; it needs no peer.

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

Parity is then encoded afresh for the new layout by :class:`~lightning_dlrover.fault.CodedEmbeddings`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dlrover.fault.coded_embeddings import exchange
from lightning_dlrover.fault.coded_state import CodedState, SegmentSpec, chunk_layout
from lightning_dlrover.fault.placement import ParityPlacement
from lightning_dlrover.parity import ReedSolomonCode, as_bytes

log = logging.getLogger(__name__)

#: Environment variable naming this node's spill directory (default: under ``/dev/shm``, per elastic run).
SPILL_ENV = "LIGHTNING_DLROVER_SPILL_DIR"


def spill_dir() -> Path | None:
    """This node's spill directory: ``$LIGHTNING_DLROVER_SPILL_DIR``, else ``/dev/shm/lightning_dlrover/<run id>``
    under ``torchrun`` (``TORCHELASTIC_RUN_ID``); ``None`` when neither is set (no launcher restarts workers)."""
    if os.environ.get(SPILL_ENV):
        return Path(os.environ[SPILL_ENV])
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return Path("/dev/shm/lightning_dlrover") / os.environ["TORCHELASTIC_RUN_ID"]
    return None


def elastic_trainer_args() -> dict[str, int]:
    """``Trainer(devices=..., num_nodes=...)`` of the current ``torchrun`` worker group, ``{}`` outside ``torchrun``.

    After a shrink or grow the world size is no longer the one the job was launched with, and Lightning
    rejects a ``devices * num_nodes`` that differs from ``WORLD_SIZE``; pass these instead of constants.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return {}
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    return {"devices": local, "num_nodes": int(os.environ["WORLD_SIZE"]) // local}


@dataclass
class Spill:
    """What one rank leaves in shared memory when it fails: its coded state at the committed ``step``.

    Attributes:
        rank, world_size: the rank's place in the job that failed.
        step: the committed step (``trainer.global_step``) the state belongs to.
        k, r, local_world_size, chunk_len: the parity code, ranks per node and chunk length of that job.
        layouts: every rank's segment specs (to decode and re-shard a lost rank's chunks).
        chunks: uint8 ``[k, chunk_len]``, the rank's data chunks.
        parity: uint8 ``[r, chunk_len]``, the parity chunks the rank held.
        meta: the trainer's state at ``step`` as a Lightning checkpoint dict (``state_dict``: dense tensors only).

    A job without parity spills only where it stopped (``k = 0``, no state): its restart resumes from a checkpoint.
    """

    rank: int
    world_size: int
    step: int
    k: int
    r: int
    local_world_size: int
    chunk_len: int
    layouts: list[list[SegmentSpec]]
    chunks: Tensor | None
    parity: Tensor | None
    meta: dict[str, Any] | None
    path: Path | None = field(default=None, compare=False)

    @property
    def generation(self) -> tuple[int, int, int, int, int]:
        return self.world_size, self.step, self.k, self.r, self.local_world_size


def write_spill(directory: Path, spill: Spill) -> Path:
    """Writes ``spill`` as ``rank<R>.pt`` in ``directory`` (atomically: a reader never sees a partial file)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{spill.rank}.pt"
    partial = path.with_name(path.name + f".{os.getpid()}.partial")
    torch.save({k: v for k, v in vars(spill).items() if k != "path"}, partial)
    partial.rename(path)
    return path


def read_spills(directory: Path | None, local_rank: int, local_world_size: int) -> list[Spill]:
    """This worker's share of the node's spills: every ``local_world_size``-th file from ``local_rank`` on."""
    if directory is None or not directory.is_dir():
        return []
    paths = sorted(directory.glob("rank*.pt"), key=lambda p: int(p.stem[4:]))[local_rank::local_world_size]
    spills = []
    for path in paths:
        try:
            spills.append(Spill(**torch.load(path, map_location="cpu", mmap=True, weights_only=False), path=path))
        except Exception as err:  # a truncated or foreign file is a lost rank, not a crash
            log.warning("lightning_dlrover: ignoring unreadable spill %s: %s", path, err)
    return spills


class Unrecoverable(RuntimeError):
    """The spills cannot rebuild the state: too many ranks lost, or the state's layout changed."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


@dataclass
class RecoveryReport:
    """What :func:`restore` did: the recovered ``step``, the failed job's ``world_size``, the ``lost`` ranks
    (decoded), and seconds spent decoding and re-sharding."""

    step: int
    world_size: int
    lost: list[int]
    decode_s: float
    reshard_s: float

    def __str__(self) -> str:
        lost = f"decoded lost ranks {self.lost}" if self.lost else "no rank lost"
        return (
            f"recovered step {self.step} of a {self.world_size}-rank job onto {dist.get_world_size()} ranks: {lost} "
            f"(decode {self.decode_s:.3f} s, re-shard {self.reshard_s:.3f} s)"
        )


def restore(state: CodedState | None, spills: list[Spill]) -> tuple[dict[str, Any] | None, RecoveryReport] | None:
    """Rebuilds the committed embedding state of a failed job from the spills into ``state``'s live buffers
    (a collective on every rank of the new job; ``state`` is ``None`` when this job has no parity). Returns the
    spilled trainer state (``None``: the job failed before its first commit) and a report, or ``None`` when no
    rank has a spill (a fresh start). Raises :class:`Unrecoverable` on every rank alike."""
    me, world = dist.get_rank(), dist.get_world_size()
    gathered: list[list[tuple[int, tuple[int, ...]]]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, [(s.rank, s.generation) for s in spills])
    entries = [(holder, rank, gen) for holder, held in enumerate(gathered) for rank, gen in held]
    if not entries:
        return None
    counts = Counter(gen for _, _, gen in entries)
    generation = max(counts, key=lambda gen: (counts[gen], gen[1]))
    old_world, step, k, r, local_world_size = generation
    if k == 0 or state is None:
        where = "the failed job" if k == 0 else "this job"
        raise Unrecoverable(f"The job stopped at step {step}, and {where} keeps no parity of its embedding state.", step)
    holders: dict[int, int] = {}
    for holder, rank, gen in entries:
        if gen == generation:
            holders.setdefault(rank, holder)
    held = {s.rank: s for s in spills if s.generation == generation and holders[s.rank] == me}
    placement = ParityPlacement(old_world, k, r, local_world_size)
    lost = sorted(set(range(old_world)) - holders.keys())
    for group in range(old_world):
        if sum(m in lost for m in placement.members(group)) > r:
            raise Unrecoverable(
                f"{len(lost)} of {old_world} ranks lost their state at step {step} (ranks {lost}); parity group "
                f"{group} (ranks {placement.members(group)}) lost more than r={r} members and cannot be decoded.",
                step,
            )
    source = [None, None, None]
    if me == min(holders.values()):
        first = held[min(held)]
        source = [first.layouts, first.chunk_len, first.meta]
    dist.broadcast_object_list(source, src=min(holders.values()))
    layouts, chunk_len, meta = source

    started = time.perf_counter()
    chunks = {rank: spill.chunks for rank, spill in held.items()}
    chunks.update(_decode(placement, holders, held, lost, chunk_len))
    decoded = time.perf_counter()
    _reshard(state, layouts, chunk_len, chunks, step)
    report = RecoveryReport(step, old_world, lost, decoded - started, time.perf_counter() - decoded)
    return meta, report


def _decode(
    placement: ParityPlacement, holders: dict[int, int], held: dict[int, Spill], lost: list[int], chunk_len: int
) -> dict[int, Tensor]:
    """Rebuilds every lost rank's chunks ``[k, chunk_len]`` on worker ``i mod W`` for the ``i``-th lost rank."""
    me, world, k = dist.get_rank(), dist.get_world_size(), placement.k
    decoder = {rank: i % world for i, rank in enumerate(lost)}
    plan = placement.decode_plan(lost)
    sends: dict[int, list[Tensor]] = defaultdict(list)
    for rank, _, sources in plan:
        for src, shard in sources:
            if holders[src] == me:
                spill = held[src]
                sends[decoder[rank]].append(spill.chunks[shard] if shard < k else spill.parity[shard - k])
    received = exchange({d: torch.cat(t) for d, t in sends.items()}, torch.uint8)
    code, offsets = ReedSolomonCode(k, placement.r), defaultdict(int)
    rebuilt = {rank: torch.empty(k, chunk_len, dtype=torch.uint8) for rank in lost if decoder[rank] == me}
    for rank, chunk, sources in plan:
        if decoder[rank] != me:
            continue
        shards = {}
        for src, shard in sources:
            at = offsets[holders[src]]
            shards[shard] = received[holders[src]][at : at + chunk_len]
            offsets[holders[src]] = at + chunk_len
        code.reconstruct(shards, [chunk], out=rebuilt[rank][chunk : chunk + 1])
    return rebuilt


def _reshard(state: CodedState, layouts: list[list[SegmentSpec]], chunk_len: int, chunks: dict[int, Tensor], step: int) -> None:
    """Sends every piece of the old segments held here to the new segments it overlaps and writes what arrives."""
    targets: dict[str, list[tuple[int, int, SegmentSpec]]] = defaultdict(list)
    for rank, specs in enumerate(state.layouts):
        for index, spec in enumerate(specs):
            if spec.rows:
                targets[spec.key].append((rank, index, spec))
    headers: dict[int, list[int]] = defaultdict(list)
    payload: dict[int, list[Tensor]] = defaultdict(list)
    changed = set()
    for rank, data in chunks.items():
        specs = layouts[rank]
        for piece in chunk_layout(specs, chunk_len):
            spec = specs[piece.segment]
            rows = data[piece.chunk][piece.slot * spec.row_bytes :][: (piece.row_hi - piece.row_lo) * spec.row_bytes]
            rows = rows.view(-1, spec.row_bytes)
            lo, hi = spec.offsets[0] + piece.row_lo, spec.offsets[0] + piece.row_hi
            for dst, index, new in targets.get(spec.key, []):
                if new.global_size != spec.global_size:
                    changed.add(spec.key)
                    continue
                r0, r1 = max(lo, new.offsets[0]), min(hi, new.offsets[0] + new.rows)
                b0, b1 = _byte_columns(spec, new)
                if r0 >= r1 or b0 >= b1:
                    continue
                src_b0 = b0 + _column_bytes(new) - _column_bytes(spec)
                headers[dst] += [index, r0 - new.offsets[0], r1 - r0, b0, b1 - b0]
                payload[dst].append(rows[r0 - lo : r1 - lo, src_b0 : src_b0 + b1 - b0].reshape(-1))
    messages = {}
    for dst, head in headers.items():
        words = torch.tensor([len(head), *head], dtype=torch.int64)
        messages[dst] = torch.cat([as_bytes(words), *payload[dst]])
    received = exchange(messages, torch.uint8)
    covered = [0] * len(state.segments)
    for message in received.values():
        count = int(message[:8].view(torch.int64))
        header = message[8 : 8 + 8 * count].view(torch.int64).view(-1, 5).tolist()
        at = 8 + 8 * count
        for index, row, n, b0, width in header:
            state.segments[index].row_view()[row : row + n, b0 : b0 + width] = message[at : at + n * width].view(n, width)
            covered[index] += n * width
            at += n * width
    missing = [s.key for s, seg, got in zip(state.specs, state.segments, covered) if got != seg.rows * seg.row_bytes]
    failed = torch.tensor([len(missing) + len(changed)])
    dist.all_reduce(failed)
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
