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

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dlrover.fault.coded_state import INT_OF_SIZE, CodedState
from lightning_dlrover.fault.decode import Combination, Term, combine, decode_combinations, layout_spans
from lightning_dlrover.fault.messages import align, exchange_with, unpack
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
        #: Bytes of the messages the last :meth:`send_deltas` sent.
        self.sent_bytes = 0
        self._pending: list[tuple[int, int, Tensor, Tensor]] = []
        k, r, me = placement.k, placement.r, self.rank
        # Fixed parity partners: the holders of this rank's chunks, and the data ranks of the groups held here.
        self._partners_out = sorted({placement.parity_rank(placement.group_of_chunk(me, c), p)
                                     for c in range(k) for p in range(r)})
        self._coefficients = self.code.coefficients.tolist()
        self._spans_of: list[list[list[tuple[int, int]]]] | None = None
        self._partners_in = sorted({placement.data_rank(g, c) for g, _ in placement.parity_held(me) for c in range(k)})
        self.encode()

    def _spans(self, rank: int, shard: int) -> list[tuple[int, int]]:
        """Byte ranges of ``rank``'s data chunk ``shard < k`` (rows only) or of its parity row ``shard - k`` (all)."""
        if self._spans_of is None:
            self._spans_of = [layout_spans(specs, self.state.chunk_len, self.placement.k) for specs in self.state.layouts]
        return self._spans_of[rank][shard] if shard < self.placement.k else [(0, self.state.chunk_len)]

    def _regions(self, shard: int) -> list[tuple[int, Tensor]]:
        """This rank's live views of its data chunk ``shard < k`` or parity row ``shard - k``."""
        k = self.placement.k
        return self.state.chunk_regions(shard) if shard < k else [(0, self.parity[shard - k])]

    def _parity_combinations(self, ranks: list[int]) -> list[Combination]:
        """The parity rows held by ``ranks``, each as a combination of its group's data chunks."""
        k, out = self.placement.k, []
        for rank in ranks:
            for group, p in self.placement.parity_held(rank):
                terms = []
                for c in range(k):
                    src = self.placement.data_rank(group, c)
                    terms.append(Term(src, self._spans(src, c), self._coefficients[p][c], lambda c=c: self._regions(c)))
                out.append(Combination(rank, [(0, self.state.chunk_len)], terms, lambda p=p: [(0, self.parity[p])]))
        return out

    def encode(self) -> None:
        """Encodes all parity from scratch (start-up and after a checkpoint restore): every rank's parity rows are
        written in place from views of the data ranks' live buffers (no intermediate copies)."""
        combine(self._parity_combinations(list(range(self.placement.world_size))))
        self.state.commit()
        self._pending.clear()

    def send_deltas(self) -> None:
        """Sends the row deltas since the last commit to their parity holders and folds in the ones received
        (pairwise with the fixed parity partners: no collective). The step stays undoable (:meth:`rollback`)
        until :meth:`commit`.

        Each delta is written once, straight into the message to its first parity holder: the new rows are
        gathered into the message and the committed ones XORed in place; further holders (``r > 1``) get a copy.
        """
        blocks: dict[int, list[tuple[int, int, int, int, int]]] = {dst: [] for dst in self._partners_out}
        touched = self.state.touched()
        slots_of, rows_of, old_of = {}, {}, {}
        for index, rows, old in touched:
            chunks, slots = self.state.locate(index, rows)
            slots_of[index], rows_of[index], old_of[index] = slots, rows, old
            first, last = int(chunks[0]), int(chunks[-1])
            # rows increase, so each chunk's rows are one slice
            bounds = [0, len(rows)] if first == last else torch.searchsorted(chunks, torch.arange(first, last + 2)).tolist()
            for chunk, lo, hi in zip(range(first, last + 1), bounds, bounds[1:]):
                if lo < hi:
                    group = self.placement.group_of_chunk(self.rank, chunk)
                    for p in range(self.placement.r):
                        blocks[self.placement.parity_rank(group, p)].append((p, chunk, index, lo, hi))
        written: dict[tuple[int, int], Tensor] = {}
        messages, self.sent_bytes = {}, 0
        for dst, plan in blocks.items():
            words = sum(4 + hi - lo for *_, lo, hi in plan)
            at = 8 * (1 + words)
            offsets = []
            for _, _, index, lo, hi in plan:
                at = align(at)
                offsets.append(at)
                at += (hi - lo) * self.state.segments[index].row_bytes
            message = torch.empty(at, dtype=torch.uint8)
            head = message[: 8 * (1 + words)].view(torch.int64)
            head[0] = words
            w = 1
            for (p, chunk, index, lo, hi), offset in zip(plan, offsets):
                segment, n = self.state.segments[index], hi - lo
                head[w : w + 4] = torch.tensor([p, chunk, segment.row_bytes, n])
                head[w + 4 : w + 4 + n] = slots_of[index][lo:hi]
                w += 4 + n
                out = message[offset : offset + n * segment.row_bytes].view(segment.tensor.dtype)
                out = out.view(n, *segment.tensor.shape[1:])
                if (index, lo) in written:
                    out.copy_(written[index, lo])
                    continue
                torch.index_select(segment.tensor, 0, rows_of[index][lo:hi], out=out)
                kind = INT_OF_SIZE[out.element_size()]  # XOR whole elements: fewer, wider operations than bytes
                out.view(kind).bitwise_xor_(old_of[index][lo:hi].view(kind))
                written[index, lo] = out
            messages[dst] = message
            self.sent_bytes += message.numel()
        for message in exchange_with(messages, self._partners_in).values():
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
        the blocks' delta bytes in order, each starting 8-byte aligned). Returns ``(p, c, slots, deltas [n, row_bytes])``."""
        header, _ = unpack(message)
        data_at, at, blocks = 8 * (1 + header.numel()), 0, []
        while at < header.numel():
            p, c, row_bytes, n = header[at : at + 4].tolist()
            slots = header[at + 4 : at + 4 + n]
            data_at = align(data_at)
            blocks.append((p, c, slots, message[data_at : data_at + n * row_bytes].view(n, row_bytes)))
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

    def recover(self, lost: list[int]) -> int:
        """Rebuilds the coded state and parity of the ``lost`` ranks in place on those ranks (collective); returns
        the bytes this rank received.

        Every rank first rolls back to the committed step. The lost ranks' buffers may hold anything
        (e.g. zeros after a restart); the survivors' data and parity are the source of truth. Survivors send views
        of their live buffers; a lost rank receives straight into its TorchRec buffers and parity rows (see
        :mod:`lightning_dlrover.fault.decode`). Its own parity share is re-encoded in the same batch of transfers
        when its sources are survivors (one lost rank), else right after the decode.
        """
        r = self.placement.r
        if len(lost) > r:
            raise RuntimeError(
                f"{len(lost)} ranks lost ({lost}) but parity tolerates r={r}; restore the last checkpoint instead."
            )
        self.rollback()

        def same(rank: int) -> int:  # in place: every rank holds and rebuilds its own chunks
            return rank

        decode = decode_combinations(self.placement, self._spans, lost, same, same, lambda _, shard: self._regions(shard),
                                     lambda _, chunk: self.state.chunk_regions(chunk))
        reencode = self._parity_combinations(lost)
        if any(term.holder in lost for combo in reencode for term in combo.terms):
            received = combine(decode) + combine(reencode)
        else:
            received = combine(decode + reencode)
        self.state.commit()
        return received
