"""Decoding lost ranks' chunks from the surviving members of their parity groups, without intermediate copies.

Every output chunk (a lost rank's data chunk, or a parity row to re-encode) is a linear combination over
GF(2^8) of ``k`` source chunks held by other workers (:class:`Combination`). Only the bytes that hold rows
travel: each chunk is described by its *spans* (byte ranges of the chunk that hold rows; padding is zero), so
every worker computes the same schedule of transfers from the layouts alone, with no header or size exchange.

The receiver writes straight into the output's live memory (TorchRec's buffers, a parity row, or one
preallocated buffer): one source with coefficient 1 is received there directly; the others stream through a
small ring of scratch blocks and are folded in (``out ^= c * block``) while the next blocks are in flight.
Senders send views of their chunks (TorchRec buffers, parity rows, memory-mapped spills): nothing is read
into a message first. One routine serves the in-process recovery and the restore after a restart.

Live memory on a GPU: the transfers run over gloo, which moves host memory only, so a view on the device is sent
from a host copy and received into a host buffer, then copied to the device (:mod:`.staging`); the folds run on the
output's device with its kernels (:func:`lightning_dlrover.parity.dispatch.kernels`).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dlrover import control_plane
from lightning_dlrover.fault.coding.coded_state import SegmentSpec, chunk_layout
from lightning_dlrover.fault.coding.placement import ParityPlacement
from lightning_dlrover.fault.coding.staging import host_copy, land, landing
from lightning_dlrover.parity import ReedSolomonCode
from lightning_dlrover.parity.dispatch import kernels

#: Bytes of one scratch block (a streamed source arrives block by block).
BLOCK = 4 << 20
#: Scratch blocks in flight per receiver.
SLOTS = 4

Spans = list[tuple[int, int]]
#: ``(start, view)`` pairs: uint8 1-D views of live memory holding a chunk's bytes from ``start`` on.
Regions = list[tuple[int, Tensor]]


def layout_spans(specs: list[SegmentSpec], chunk_len: int, k: int) -> list[Spans]:
    """Byte ranges holding rows of each of the ``k`` chunks of a rank with segment ``specs``: one per piece of a
    segment (sorted; a range is one view of a live buffer on the rank)."""
    spans: list[Spans] = [[] for _ in range(k)]
    for p in chunk_layout(specs, chunk_len):
        lo = p.slot * specs[p.segment].row_bytes
        spans[p.chunk].append((lo, lo + (p.row_hi - p.row_lo) * specs[p.segment].row_bytes))
    return [sorted(s) for s in spans]


def intersect(a: Spans, b: Spans) -> Spans:
    """Byte ranges in both ``a`` and ``b`` (each sorted and disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Spans, b: Spans) -> Spans:
    """Byte ranges in ``a`` and not in ``b`` (each sorted and disjoint)."""
    out = []
    for lo, hi in a:
        for blo, bhi in b:
            if bhi <= lo or blo >= hi:
                continue
            if blo > lo:
                out.append((lo, blo))
            lo = max(lo, bhi)
            if lo >= hi:
                break
        if lo < hi:
            out.append((lo, hi))
    return out


def cut(spans: Spans, edges: Spans, block: int = BLOCK) -> Spans:
    """``spans`` cut at every edge of the ``edges`` ranges and every multiple of ``block``, so that each piece lies
    in one range of ``edges`` (one view on a worker) and one scratch block."""
    points = sorted({x for lo, hi in edges for x in (lo, hi)})
    out = []
    for lo, hi in spans:
        at = bisect.bisect_right(points, lo)
        while lo < hi:
            stop = min(hi, (lo // block + 1) * block, points[at] if at < len(points) else hi)
            out.append((lo, stop))
            lo = stop
            while at < len(points) and points[at] <= lo:
                at += 1
    return out


def view_of(regions: Regions, lo: int, hi: int) -> Tensor:
    """Bytes ``[lo, hi)`` of a chunk held in ``regions`` (they must lie in one region)."""
    at = bisect.bisect_right([start for start, _ in regions], lo) - 1
    start, view = regions[at]
    if at < 0 or hi - start > view.numel():
        raise ValueError(f"bytes [{lo}, {hi}) of the chunk do not lie in one region held here")
    return view[lo - start : hi - start]


@dataclass
class Term:
    """``coef`` times a source chunk: its holder (a worker), the byte ranges it has (zero elsewhere), and, on the
    holder only, ``regions`` (its live bytes)."""

    holder: int
    spans: Spans
    coef: int
    regions: Callable[[], Regions] | None = None


@dataclass
class Combination:
    """Output chunk = XOR of the terms, written on ``receiver`` into ``regions()`` over the byte ranges ``spans``."""

    receiver: int
    spans: Spans
    terms: list[Term]
    regions: Callable[[], Regions] | None = None
    _direct: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        ones = [i for i, t in enumerate(self.terms) if t.coef == 1]
        self._direct = ones[0] if ones else None


def combine(combinations: Sequence[Combination], me: int | None = None, block: int = BLOCK,
            scratch: Tensor | None = None) -> int:
    """Runs ``combinations`` (a collective over the workers they name; every worker passes the same list, with
    ``regions`` set for what it holds and receives). Returns the bytes this worker received.

    ``scratch``: optional uint8 ``[SLOTS * terms, block]`` buffer to stream through (allocated when absent).
    """
    me = dist.get_rank() if me is None else me
    control = control_plane.group()
    tags: dict[tuple[int, int], int] = defaultdict(int)
    sends, direct, streamed = [], [], []  # streamed: (combination, term, lo, hi, tag)
    for combo in combinations:
        for i, term in enumerate(combo.terms):
            # each piece lies in one region of the source and one of the output (and one scratch block if streamed)
            whole = i == combo._direct
            for lo, hi in cut(intersect(term.spans, combo.spans), term.spans + combo.spans, 1 << 62 if whole else block):
                tag = 0
                if term.holder != combo.receiver:
                    tag = tags[term.holder, combo.receiver]
                    tags[term.holder, combo.receiver] += 1
                if term.holder == me and combo.receiver != me:
                    sends.append((term, combo.receiver, lo, hi, tag))
                elif combo.receiver == me:
                    (direct if i == combo._direct else streamed).append((combo, term, lo, hi, tag))
    held: dict[int, Regions] = {}

    def source(term: Term, lo: int, hi: int) -> Tensor:
        if id(term) not in held:
            held[id(term)] = term.regions()
        return view_of(held[id(term)], lo, hi)

    # A send from device memory goes from a host copy; the work keeps it alive until it is sent.
    works = [dist.isend(host_copy(source(term, lo, hi)), dst, group=control, tag=tag) for term, dst, lo, hi, tag in sends]
    received = 0
    regions_of = {id(c): c.regions() for c in combinations if c.receiver == me}
    pending_direct: dict[int, list] = defaultdict(list)  # (work, out, where it lands)
    for combo in combinations:  # outputs not covered by their direct source are zero there first
        if combo.receiver != me:
            continue
        covered = combo.terms[combo._direct].spans if combo._direct is not None else []
        for lo, hi in cut(subtract(combo.spans, covered), combo.spans, 1 << 62):
            view_of(regions_of[id(combo)], lo, hi).zero_()
    for combo, term, lo, hi, tag in direct:
        out = view_of(regions_of[id(combo)], lo, hi)
        if term.holder == me:
            out.copy_(source(term, lo, hi))
        else:
            into = landing(out)
            pending_direct[id(combo)].append((dist.irecv(into, term.holder, group=control, tag=tag), out, into))
            received += hi - lo
    remote = [item for item in streamed if item[1].holder != me]
    slots = SLOTS if remote else 0
    if slots and (scratch is None or scratch.numel() < slots * block):
        scratch = torch.empty(slots, block, dtype=torch.uint8)
    elif slots:
        scratch = scratch.view(-1)[: slots * block].view(slots, block)
    posted: list = [None] * len(remote)

    def post(n: int) -> None:
        if n < len(remote):
            _, term, lo, hi, tag = remote[n]
            posted[n] = dist.irecv(scratch[n % slots, : hi - lo], term.holder, group=control, tag=tag)

    for n in range(min(slots, len(remote))):
        post(n)
    n = 0
    for combo, term, lo, hi, _ in streamed:
        for work, target, into in pending_direct.pop(id(combo), []):
            work.wait()
            land(target, into)
        out = view_of(regions_of[id(combo)], lo, hi)
        if term.holder == me:
            data = source(term, lo, hi)
        else:
            posted[n].wait()
            data = scratch[n % slots, : hi - lo]
        # One dispatch for the fold: the C kernel for host memory (as it always was), the device's otherwise.
        # Untested on GPU: the fold into CUDA outputs (CuPy matmul) and the copy of received blocks to the device.
        kernels(out.device).matmul([out], [data.to(out.device)], np.array([[term.coef]], dtype=np.uint8), True)
        if term.holder != me:
            received += hi - lo
            post(n + slots)
            n += 1
    for work, target, into in [item for items in pending_direct.values() for item in items]:
        work.wait()
        land(target, into)
    for work in works:
        work.wait()
    return received


def decode_coefficients(code: ReedSolomonCode, chosen: Sequence[int], wanted: int) -> list[int]:
    """Coefficients of shard ``wanted`` over the shards ``chosen`` (``k`` shard ids, increasing)."""
    return [int(c) for c in code._decode_matrix(tuple(chosen), (wanted,))[0]]


def decode_combinations(
    placement: ParityPlacement,
    spans: Callable[[int, int], Spans],
    lost: list[int],
    holder: Callable[[int], int],
    decoder: Callable[[int], int],
    sources: Callable[[int, int], Regions],
    target: Callable[[int, int], Regions],
) -> list[Combination]:
    """One :class:`Combination` per data chunk of each rank in ``lost`` (ranks of ``placement``).

    Args:
        spans: ``spans(rank, shard)``: byte ranges of data chunk ``shard < k`` of ``rank`` or its parity row
            ``shard - k`` (the whole chunk).
        holder: worker that holds the chunks and parity of a surviving rank of ``placement``.
        decoder: worker that rebuilds a lost rank.
        sources: ``sources(rank, shard)``, on the holder of ``rank``: the regions of that chunk or parity row.
        target: ``target(rank, chunk)``, on the decoder of ``rank``: where its chunk ``chunk`` is written.
    """
    code = ReedSolomonCode(placement.k, placement.r)
    out = []
    for rank, chunk, plan in placement.decode_plan(lost):
        coefs = decode_coefficients(code, [shard for _, shard in plan], chunk)
        terms = [Term(holder(src), spans(src, shard), c, lambda src=src, shard=shard: sources(src, shard))
                 for (src, shard), c in zip(plan, coefs) if c]
        out.append(Combination(decoder(rank), spans(rank, chunk), terms, lambda rank=rank, chunk=chunk: target(rank, chunk)))
    return out


def decode_lost(
    placement: ParityPlacement,
    layouts: list[list[SegmentSpec]],
    chunk_len: int,
    lost: list[int],
    me: int,
    holder: Callable[[int], int],
    decoder: Callable[[int], int],
    sources: Callable[[int, int], Regions],
) -> dict[int, Tensor]:
    """Rebuilds the ``k`` data chunks of every rank in ``lost`` into one new buffer per lost rank decoded here
    (a collective over the current process group; see :func:`decode_combinations` for the arguments).

    Returns:
        uint8 ``[k, chunk_len]`` for each lost rank decoded on this worker (padding bytes are zero).
    """
    k = placement.k
    spans_of = {rank: layout_spans(specs, chunk_len, k) for rank, specs in enumerate(layouts)}
    rebuilt = {rank: torch.zeros(k, chunk_len, dtype=torch.uint8) for rank in lost if decoder(rank) == me}
    combinations = decode_combinations(
        placement,
        lambda rank, shard: spans_of[rank][shard] if shard < k else [(0, chunk_len)],
        lost, holder, decoder, sources,
        lambda rank, chunk: [(0, rebuilt[rank][chunk])],
    )
    combine(combinations, me)
    return rebuilt
