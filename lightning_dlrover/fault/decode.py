"""Decoding lost ranks' chunks from the surviving members of their parity groups: one routine for the
in-process recovery (the lost ranks are alive again, their buffers wiped) and for the restore after a
restart (the chunks live in spills held by other workers)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_dlrover.fault.messages import exchange
from lightning_dlrover.fault.placement import ParityPlacement
from lightning_dlrover.parity import ReedSolomonCode


def decode_lost(
    placement: ParityPlacement,
    chunk_len: int,
    lost: list[int],
    me: int,
    holder: Callable[[int], int],
    decoder: Callable[[int], int],
    read: Callable[[int, int, Tensor], None],
) -> dict[int, Tensor]:
    """Rebuilds the ``k`` data chunks of every rank in ``lost`` (a collective over the current process group).

    Args:
        placement: the code and placement the chunks were encoded with (the failed job's).
        chunk_len: bytes per chunk.
        lost: ranks (of ``placement``) whose chunks are gone.
        me: this worker's rank in the current process group.
        holder: worker that holds the chunks and parity of a surviving rank of ``placement``.
        decoder: worker that rebuilds a lost rank.
        read: ``read(rank, shard, out)``, on the holder of ``rank``: writes its data chunk ``shard < k`` or its
            parity row ``shard - k`` into ``out`` (uint8 ``[chunk_len]``, a slice of the outgoing message).

    Returns:
        uint8 ``[k, chunk_len]`` for each lost rank decoded on this worker.
    """
    k = placement.k
    plan = placement.decode_plan(lost)
    counts: dict[int, int] = defaultdict(int)
    for rank, _, sources in plan:
        counts[decoder(rank)] += sum(holder(src) == me for src, _ in sources)
    sends = {dst: torch.empty(n * chunk_len, dtype=torch.uint8) for dst, n in counts.items() if n}
    filled: dict[int, int] = defaultdict(int)
    for rank, _, sources in plan:  # each source chunk is read once, straight into its message
        for src, shard in sources:
            if holder(src) == me:
                dst = decoder(rank)
                read(src, shard, sends[dst][filled[dst] : filled[dst] + chunk_len])
                filled[dst] += chunk_len
    received = exchange(sends)
    code, offsets = ReedSolomonCode(k, placement.r), defaultdict(int)
    rebuilt = {rank: torch.empty(k, chunk_len, dtype=torch.uint8) for rank in lost if decoder(rank) == me}
    for rank, chunk, sources in plan:
        if decoder(rank) != me:
            continue
        shards = {}
        for src, shard in sources:
            at = offsets[holder(src)]
            shards[shard] = received[holder(src)][at : at + chunk_len]
            offsets[holder(src)] = at + chunk_len
        code.reconstruct(shards, [chunk], out=rebuilt[rank][chunk : chunk + 1])
    return rebuilt
