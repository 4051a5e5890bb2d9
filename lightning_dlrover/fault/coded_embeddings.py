"""Erasure-coded embeddings: parity of every rank's embedding state on other ranks, committed per step.

Commit protocol (one training step ``s``; ``committed_step`` is ``s - 1`` before it):

1. Forward: a pre-hook on every fused embedding kernel records the rows it will update and saves their
   bytes (weights and optimizer state) in the rank's undo log, before the in-backward optimizer runs
   (every forward of the step: several forwards, or manual optimisation, are covered).
2. Backward(s) and optimizer step(s) update those rows in place.
3. :meth:`CodedEmbeddings.send_deltas`, once per step whatever the number of backward passes and
   optimizer calls: every rank sends ``old XOR new`` of its touched rows to the parity holders of their
   groups; each holder folds them into its parity and keeps them as its own undo log (XOR is its own inverse).
4. :meth:`CodedEmbeddings.commit`: a vote (an all-gather of every rank's ballot) that every rank reaches only
   after applying every delta it received. When it completes, step ``s`` is committed: undo logs are dropped
   and ``committed_step = s``. :class:`~lightning_dlrover.fault.FaultManager` runs steps 3-4 once the whole
   training step is over (callbacks, LR schedulers, validation), with snapshots of the dense and trainer state
   and every rank's random generators (the ballots), so all of it belongs to the same step.

A failure before the vote completes leaves step ``s`` uncommitted everywhere; :meth:`rollback` undoes
it on the survivors (rows restored from the undo log, received deltas re-applied), so data and parity
are again those of step ``s - 1``, and the lost ranks are decoded at that step. Only touched rows travel.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dlrover.fault.coded_state import CodedState
from lightning_dlrover.fault.decode import decode_lost
from lightning_dlrover.fault.messages import exchange, pack, unpack
from lightning_dlrover.fault.placement import ParityPlacement
from lightning_dlrover.parity import ReedSolomonCode


class CodedEmbeddings:
    """Keeps this rank's share of the parity and runs the per-step commit protocol (collective methods).

    Attributes:
        parity: uint8 ``[r, chunk_len]``; row ``p`` is parity shard ``k + p`` of group ``placement.parity_held(rank)[p][0]``.
        committed_step: the last step whose data and parity are consistent on every rank (-1: the encode).
    """

    def __init__(self, state: CodedState, placement: ParityPlacement) -> None:
        self.state, self.placement = state, placement
        self.rank = dist.get_rank()
        self.code = ReedSolomonCode(placement.k, placement.r)
        self.parity = torch.zeros(placement.r, state.chunk_len, dtype=torch.uint8)
        self.committed_step = -1
        self._pending: list[tuple[int, int, Tensor, Tensor]] = []
        self.encode()

    def _group_chunks(self, holders: list[int]) -> dict[int, Tensor]:
        """Sends each rank in ``holders`` the data chunks held here of the groups it holds parity of;
        returns the chunks received, concatenated per source rank."""
        sends: dict[int, list[Tensor]] = defaultdict(list)
        for dst in holders:
            for group, _ in self.placement.parity_held(dst):
                for c in range(self.placement.k):
                    if self.placement.data_rank(group, c) == self.rank:
                        sends[dst].append(self.state.read_chunk(c))
        return exchange({d: torch.cat(t) for d, t in sends.items()})

    def _encode_held(self, received: dict[int, Tensor]) -> None:
        """Encodes this rank's parity rows from the group data chunks received by :meth:`_group_chunks`."""
        offsets: dict[int, int] = defaultdict(int)
        for group, p in self.placement.parity_held(self.rank):
            data = []
            for c in range(self.placement.k):
                src, at = self.placement.data_rank(group, c), offsets[self.placement.data_rank(group, c)]
                data.append(received[src][at : at + self.state.chunk_len])
                offsets[src] += self.state.chunk_len
            self.code.encode(torch.stack(data), parity_ids=[self.placement.k + p], out=self.parity[p : p + 1])

    def encode(self) -> None:
        """Encodes all parity from scratch (start-up and after a checkpoint restore)."""
        self._encode_held(self._group_chunks(list(range(self.placement.world_size))))
        self.state.commit()
        self._pending.clear()

    def send_deltas(self) -> None:
        """Sends this step's row deltas to their parity holders and folds in the ones received (collective).

        The step stays undoable (:meth:`rollback`) until :meth:`commit`.
        """
        headers: dict[int, list[Tensor]] = defaultdict(list)
        payload: dict[int, list[Tensor]] = defaultdict(list)
        for segment, rows, delta in self.state.step_deltas():
            chunks, slots = self.state.locate(segment, rows)
            first, last = int(chunks.min()), int(chunks.max())
            for chunk in range(first, last + 1):
                if first == last:
                    block_slots, block_delta = slots, delta
                else:
                    mask = chunks == chunk
                    block_slots, block_delta = slots[mask], delta[mask]
                if not len(block_slots):
                    continue
                group = self.placement.group_of_chunk(self.rank, chunk)
                for p in range(self.placement.r):
                    dst = self.placement.parity_rank(group, p)
                    head = torch.tensor([p, chunk, block_delta.shape[1], len(block_slots)], dtype=torch.int64)
                    headers[dst] += [head, block_slots]
                    payload[dst].append(block_delta.reshape(-1))
        received = exchange({dst: pack(head, payload[dst]) for dst, head in headers.items()})
        for message in received.values():
            for p, c, slots, deltas in self._blocks(message):
                self._apply(p, c, slots, deltas)
                self._pending.append((p, c, slots, deltas))

    def commit(self, step: int, ballot: Tensor) -> list[Tensor]:
        """The vote: an all-gather of every rank's ``ballot`` (uint8, the same size on every rank), reached by
        every rank only after :meth:`send_deltas`. When it completes, ``step`` is committed; returns the ballots."""
        ballots = [torch.empty_like(ballot) for _ in range(self.placement.world_size)]
        dist.all_gather(ballots, ballot)
        self.state.commit()
        self._pending.clear()
        self.committed_step = step
        return ballots

    @staticmethod
    def _blocks(message: Tensor) -> list[tuple[int, int, Tensor, Tensor]]:
        """Parses a delta message (header words per block: ``p, c, row_bytes, n`` then ``n`` row slots; payload:
        the blocks' delta bytes in order). Returns ``(p, c, slots, deltas [n, row_bytes])`` per block."""
        header, data = unpack(message)
        data_at, at, blocks = 0, 0, []
        while at < header.numel():
            p, c, row_bytes, n = header[at : at + 4].tolist()
            slots = header[at + 4 : at + 4 + n]
            blocks.append((p, c, slots, data[data_at : data_at + n * row_bytes].view(n, row_bytes)))
            at, data_at = at + 4 + n, data_at + n * row_bytes
        return blocks

    def _apply(self, p: int, c: int, slots: Tensor, deltas: Tensor) -> None:
        self.code.update_rows(self.parity[p : p + 1], c, slots, deltas, parity_ids=[self.placement.k + p])

    def rollback(self) -> None:
        """Undoes an uncommitted step on this rank: rows back to the committed bytes, received deltas removed."""
        for p, c, slots, deltas in self._pending:
            self._apply(p, c, slots, deltas)
        self._pending.clear()
        self.state.rollback()

    def recover(self, lost: list[int]) -> None:
        """Rebuilds the coded state and parity of the ``lost`` ranks in place on those ranks (collective).

        Every rank first rolls back to the committed step. The lost ranks' buffers may hold anything
        (e.g. zeros after a restart); the survivors' data and parity are the source of truth.
        """
        k, r = self.placement.k, self.placement.r
        if len(lost) > r:
            raise RuntimeError(
                f"{len(lost)} ranks lost ({lost}) but parity tolerates r={r}; restore the last checkpoint instead."
            )
        self.rollback()
        same = lambda rank: rank  # noqa: E731  (in place: every rank holds and rebuilds its own chunks)
        read = lambda _, shard: self.state.read_chunk(shard) if shard < k else self.parity[shard - k]  # noqa: E731
        rebuilt = decode_lost(self.placement, self.state.chunk_len, lost, self.rank, same, same, read)
        for chunk, data in enumerate(rebuilt.get(self.rank, [])):
            self.state.write_chunk(chunk, data)
        # The lost ranks' own parity shares are re-encoded from the (now complete) data.
        received = self._group_chunks(lost)
        if self.rank in lost:
            self._encode_held(received)
        self.state.commit()
