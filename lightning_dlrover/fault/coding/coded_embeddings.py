"""Erasure-coded embeddings: parity of every rank's embedding state on other ranks, committed per step.

Commit protocol (one training step ``s``; ``committed_step`` is ``s - 1`` before it):

1. Forward: a pre-hook on every fused embedding kernel records the rows it will update and saves their
   bytes (weights and optimizer state) in the rank's undo log, before the in-backward optimizer runs
   (every forward of the step: several forwards, or manual optimisation, are covered).
2. Backward(s) and optimizer step(s) update those rows in place.
3. :meth:`CodedEmbeddings.post_deltas` and :meth:`~CodedEmbeddings.finish_deltas`, once per step whatever
   the number of backward passes and optimizer calls: every rank sends ``old XOR new`` of its touched rows to
   the parity holders of their groups; each holder folds them into its parity and keeps them as its own undo
   log (XOR is its own inverse).
4. :meth:`CodedEmbeddings.vote`, then :meth:`~CodedEmbeddings.decide`: a vote (an all-gather of every rank's
   ballot) that every rank reaches only after applying every delta it received. When it completes, step ``s``
   is committed: undo logs are dropped and ``committed_step = s``. :class:`~lightning_dlrover.fault.FaultManager` starts step 3 once the whole
   training step is over (callbacks, LR schedulers, validation), with snapshots of the dense and trainer state
   and every rank's random generators (the ballots), so all of it belongs to the same step. With overlap,
   :meth:`~CodedEmbeddings.post_deltas` sends and the next step's start finishes step 3 and votes, so the
   messages travel while the next batch is fetched.

A failure before the vote completes leaves step ``s`` uncommitted everywhere; :meth:`rollback` undoes
it on the survivors (rows restored from the undo log, received deltas re-applied), so data and parity
are again those of step ``s - 1``, and the lost ranks are decoded at that step. A failure *during* the
all-gather can leave some survivors committed and others not, which is safe to resolve forward because every
rank had voted: in-process recovery has the others :meth:`decide` step ``s`` too, and a restart counts their
tentative spills of step ``s`` (:class:`~lightning_dlrover.fault.restart.spill.Spill`). Only touched rows travel.

Parity, undo logs and deltas live on the device of the coded shards. Shards on the CPU use the C kernels on buffer
addresses; shards elsewhere (CUDA) use torch operations and the device's kernels
(:func:`lightning_dlrover.parity.dispatch.kernels`), with the messages staged through pinned host memory for the
gloo exchange (:mod:`lightning_dlrover.fault.coding.staging`, which also says how the capture is ordered after the
fused optimizer's update). ``_native`` is the one switch between the two branches (tests set it to ``False`` to run
the device branch on CPU tensors).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dlrover import control_plane
from lightning_dlrover.fault.coding import reserve
from lightning_dlrover.fault.coding.coded_state import INT_OF_SIZE, CodedState
from lightning_dlrover.fault.coding.decode import Combination, Term, combine, decode_combinations, layout_spans
from lightning_dlrover.fault.coding.messages import Mailbox, align
from lightning_dlrover.fault.coding.placement import ParityPlacement
from lightning_dlrover.fault.coding.staging import Staging
from lightning_dlrover.fault.restart.spill import Spill, job_identity
from lightning_dlrover.parity import ReedSolomonCode
from lightning_dlrover.parity import cpu as gf_cpu


class CodedEmbeddings:
    """Keeps this rank's share of the parity and runs the per-step commit protocol (collective methods).

    Attributes:
        parity: uint8 ``[r, chunk_len]``; row ``p`` is parity shard ``k + p`` of group ``placement.parity_held(rank)[p][0]``.
        committed_step: the last step whose data and parity are consistent on every rank (-1: the encode).
    """

    def __init__(self, state: CodedState, placement: ParityPlacement, encode: bool = True) -> None:
        self.state, self.placement = state, placement
        self.rank = dist.get_rank()
        self.code = ReedSolomonCode(placement.k, placement.r)
        # Untested on GPU: parity and pinned mailbox buffers for shards on a CUDA device.
        # Without ``encode`` the caller's encode() / recover() / adopt() writes every byte of it: not zeroed first (a
        # replacement's parity share is as large as its state; zeroing it cost 0.2-0.3 s at 160 MiB per rank here).
        # A hot spare's reserve (faulted in while it waited) holds a replacement's share when it has room.
        held = reserve.take(placement.r * state.chunk_len, torch.uint8) if not encode and state.device.type == "cpu" else None
        self.parity = held.view(placement.r, state.chunk_len) if held is not None else (
            (torch.zeros if encode else torch.empty)(placement.r, state.chunk_len, dtype=torch.uint8, device=state.device))
        self._staging = Staging(state.device)
        #: The C kernels and plain memory copies on buffer addresses (shards in host memory), else torch operations.
        self._native = self._staging.on_host
        self.committed_step = -1
        #: Bytes of the messages the last :meth:`post_deltas` sent.
        self.sent_bytes = 0
        self._pending: list[tuple[int, int, Tensor, int, int, int, int]] = []  # blocks applied since the commit
        k, r, me = placement.k, placement.r, self.rank
        # Fixed parity partners: the holders of this rank's chunks, and the data ranks of the groups held here.
        self._partners_out = sorted({placement.parity_rank(placement.group_of_chunk(me, c), p)
                                     for c in range(k) for p in range(r)})
        self._coefficients = self.code.coefficients.tolist()
        self._coefficient_bytes = [[bytes([c]) for c in row] for row in self._coefficients]
        self._spans_of: list[list[list[tuple[int, int]]]] | None = None
        self._partners_in = sorted({placement.data_rank(g, c) for g, _ in placement.parity_held(me) for c in range(k)})
        self._mailbox = self._new_mailbox()
        if encode:  # else the caller runs encode() or recover() (a replacement joining survivors) next
            self.encode()

    def _new_mailbox(self) -> Mailbox:
        return Mailbox(self._partners_in, pin_memory=not self._staging.on_host)

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

    def adopt(self, parity: Tensor | None, lost: list[int]) -> None:
        """Encodes after a restore that kept the layout (collective): this rank takes ``parity``, its share as its
        previous incarnation spilled it (``None`` on a ``lost`` rank), and only the ``lost`` ranks' shares are encoded
        from the restored data."""
        # The copy (no GIL) runs beside the exchange: the lost ranks wait on this rank's sends, not on its copy.
        copy = threading.Thread(target=self.parity.copy_, args=(parity,)) if parity is not None else None
        if copy is not None:
            copy.start()
        try:
            combine(self._parity_combinations(lost))
        finally:
            if copy is not None:
                copy.join()
        self.state.commit()
        self._pending.clear()

    def verify(self) -> bool:
        """Whether every rank's parity equals a fresh encode of the data (collective; the parity is then re-encoded)."""
        held = self.parity.clone()
        self.encode()
        return control_plane.all_true(torch.equal(held, self.parity))

    def post_deltas(self) -> None:
        """Sends the row deltas since the last commit to their parity holders (pairwise with the fixed parity
        partners, one round, no collective) and returns at once; :meth:`finish_deltas` waits and folds in the ones
        received. The tables may be read, not written, until then (the next step's forward must wait), and the step
        stays undoable (:meth:`rollback`) until :meth:`decide`.

        Each delta is written once, straight into the message to its first parity holder (one gather-XOR pass of the
        new rows against the undo log, read in place); further holders (``r > 1``) get a copy. A message is int64
        words ``length, blocks``, then ``p, chunk, row_bytes, n`` per block, then every block's ``n`` row slots, then the blocks'
        delta bytes (each 8-byte aligned).
        """
        blocks: dict[int, list[tuple[int, int, int, int, int]]] = {dst: [] for dst in self._partners_out}
        rows_of, old_of, slots_of = {}, {}, {}
        for index, rows, at, log in self.state.logged():
            rows_of[index], old_of[index] = rows, (at, log)
            for chunk, lo, hi, slots in self.state.split_by_chunk(index, rows):
                slots_of[index, lo] = slots
                group = self.placement.group_of_chunk(self.rank, chunk)
                for p in range(self.placement.r):
                    blocks[self.placement.parity_rank(group, p)].append((p, chunk, index, lo, hi))
        # Shards on a GPU: the capture below (gathers, XORs, copies into the messages) is enqueued on the current
        # stream. The step's backward and its fused optimizer update (inside the embedding kernels' backward) are
        # ordered before it there, because autograd orders the stream current at backward() after the backward's
        # own, and this runs after the step's backward and optimizer calls returned (FaultManager ends the step).
        # So the capture reads the updated rows with no extra event; the host waits for it (an event after the
        # copies to pinned memory) before gloo reads the bytes: Staging.to_host, at the end.
        native = self._native
        raw = native and gf_cpu.has_undo_kernels()
        written: dict[tuple[int, int], tuple[int, Tensor, int]] = {}
        messages, self.sent_bytes = {}, 0
        for dst, plan in blocks.items():
            words = 2 + 4 * len(plan) + sum(hi - lo for *_, lo, hi in plan)
            at, offsets, descriptors = 8 * words, [], []
            for p, chunk, index, lo, hi in plan:
                at = align(at)
                offsets.append(at)
                row_bytes = self.state.segments[index].row_bytes
                at += (hi - lo) * row_bytes
                descriptors += [p, chunk, row_bytes, hi - lo]
            message = torch.empty(at, dtype=torch.uint8, device=self.parity.device)
            head = message[: 8 * words].view(torch.int64)
            head[: 2 + len(descriptors)] = torch.tensor([at, len(plan), *descriptors])
            if plan:
                torch.cat([slots_of[index, lo] for _, _, index, lo, _ in plan], out=head[2 + len(descriptors) :])
            base = gf_cpu.host_ptr(message, "the delta message") if native else 0
            for (p, chunk, index, lo, hi), offset in zip(plan, offsets):
                segment, n = self.state.segments[index], hi - lo
                if (index, lo) in written:  # r > 1: the same delta for another parity holder
                    address, source, start = written[index, lo]
                    size = n * segment.row_bytes
                    if native:
                        ctypes.memmove(base + offset, address, size)
                    else:  # Untested on GPU (run on CPU tensors by the tests): a copy on the message's device
                        message[offset : offset + size].copy_(source[start : start + size])
                    continue
                written[index, lo] = (base + offset, message, offset)
                rows, (at, log) = rows_of[index], old_of[index]  # the committed value of rows[i] is log[at[i]]
                if raw and segment.tensor.is_contiguous():
                    gf_cpu.gather_xor_at_raw(base + offset, gf_cpu.host_ptr(segment.tensor, segment.name), segment.rows,
                                             gf_cpu.host_ptr(rows, "rows") + 8 * lo, n,
                                             gf_cpu.host_ptr(log, "the undo log"), log.shape[0],
                                             gf_cpu.host_ptr(at, "at") + 8 * lo, segment.row_bytes)
                    continue
                # Any device (torch operations; on CUDA on the current stream, after the step's optimizer: above).
                # Untested on GPU: the tests run this branch on CPU tensors (``_native = False``), not on CUDA ones.
                out = message[offset : offset + n * segment.row_bytes].view(segment.tensor.dtype)
                out = out.view(n, *segment.tensor.shape[1:])
                torch.index_select(segment.tensor, 0, rows[lo:hi], out=out)
                kind = INT_OF_SIZE[out.element_size()]  # XOR whole elements: fewer, wider operations than bytes
                out.view(kind).bitwise_xor_(log.index_select(0, at[lo:hi]).view(kind))
            messages[dst] = message
            self.sent_bytes += message.numel()
        # Shards on a GPU: the messages go to pinned host memory, complete before gloo reads them.
        self._mailbox.post(self._staging.to_host(messages))

    def finish_deltas(self) -> None:
        """Waits for the deltas :meth:`post_deltas` sent and received, and folds the received ones into parity."""
        for message in self._mailbox.collect().values():
            for block in self._blocks(message, self._staging.to_device(message)):
                self._apply(*block)
                self._pending.append(block)

    def vote(self, ballot: Tensor) -> list[Tensor]:
        """The vote: an all-gather of every rank's ``ballot`` (uint8, the same size on every rank), reached by
        every rank only after :meth:`finish_deltas`. Once it returns on any rank, every rank had folded in its
        deltas, so the step is decided for all, including a rank whose own all-gather broke before it returned."""
        ballots = [torch.empty_like(ballot) for _ in range(self.placement.world_size)]
        dist.all_gather(ballots, ballot, group=control_plane.group())
        return ballots

    def decide(self, step: int) -> None:
        """Commits ``step`` on this rank: undo logs dropped (after the vote; or in recovery, on a rank whose vote
        broke after another rank's vote completed)."""
        self.state.commit()
        self._pending.clear()
        self.committed_step = step

    @staticmethod
    def _blocks(message: Tensor, data: Tensor | None = None) -> list[tuple[int, int, Tensor, int, int, int, int]]:
        """Parses a delta message (see :meth:`post_deltas`): ``(p, c, data, slots_at, n, row_bytes, data_at)`` per
        block (byte offsets into the message); ``data`` is the message's copy the blocks read (on the parity's
        device), the message itself by default."""
        data = message if data is None else data
        count = int(message[8:16].view(torch.int64))
        descriptors = message[16 : 16 + 32 * count].view(torch.int64).view(count, 4).tolist()
        slots_at = 16 + 32 * count
        data_at = slots_at + 8 * sum(n for *_, n in descriptors)
        blocks = []
        for p, c, row_bytes, n in descriptors:
            data_at = align(data_at)
            blocks.append((p, c, data, slots_at, n, row_bytes, data_at))
            slots_at, data_at = slots_at + 8 * n, data_at + n * row_bytes
        return blocks

    def _apply(self, p: int, c: int, message: Tensor, slots_at: int, n: int, row_bytes: int, data_at: int) -> None:
        """Folds one block of deltas into parity row ``p`` (applying it twice undoes it)."""
        chunk_len = self.state.chunk_len
        if self._native and gf_cpu.has_raw_kernels():
            base = gf_cpu.host_ptr(message, "the delta message")
            gf_cpu.update_rows_raw(gf_cpu.host_ptr(self.parity, "parity") + p * chunk_len, chunk_len,
                                   self._coefficient_bytes[p][c], base + slots_at, n, chunk_len // row_bytes,
                                   base + data_at, row_bytes)
            return
        # Any device: the device's update_rows kernel (CuPy on CUDA) through the code; the message is on its device.
        # Untested on GPU: the tests run this branch on CPU tensors (``_native = False``); CuPy's update_rows itself
        # is tested on a GPU by tests/parity/test_cuda.py.
        slots = message[slots_at : slots_at + 8 * n].view(torch.int64)
        deltas = message[data_at : data_at + n * row_bytes].view(n, row_bytes)
        self.code.update_rows(self.parity[p : p + 1], c, slots, deltas, parity_ids=[self.placement.k + p])

    def spill(self, rank: int, step: int, rank_states: Tensor | None, meta: dict[str, Any] | None,
              tentative: bool = False) -> Spill:
        """This rank's data chunks (a copy) and parity share (the live tensor) as they are now, as the spill of ``step``."""
        # Untested on GPU: with shards on a GPU the chunks are copied to the host and the parity is the live device
        # tensor (torch.save copies it to the host when the spill is written).
        state = self.state
        chunks = torch.empty(state.k, state.chunk_len, dtype=torch.uint8)
        for c in range(state.k):
            state.read_chunk(c, out=chunks[c])
        return Spill(
            rank=rank, world_size=self.placement.world_size, step=step, k=state.k, r=self.placement.r,
            local_world_size=self.placement.local_world_size, chunk_len=state.chunk_len, layouts=state.layouts,
            chunks=chunks, parity=self.parity, rank_states=rank_states, meta=meta, identity=job_identity(),
            tentative=tentative,
        )  # fmt: skip

    def rollback(self) -> None:
        """Undoes an uncommitted step on this rank: rows back to the committed bytes, received deltas removed."""
        for block in self._pending:
            self._apply(*block)
        self._pending.clear()
        self.state.rollback()

    def recover(self, lost: list[int]) -> int:
        """Rebuilds the coded state and parity of the ``lost`` ranks in place on those ranks (collective); returns
        the bytes this rank received.

        Every rank first rolls back to the committed step. The lost ranks' buffers may hold anything
        (e.g. zeros after a restart); the survivors' data and parity are the source of truth. Survivors send views
        of their live buffers; a lost rank receives straight into its TorchRec buffers and parity rows (see
        :mod:`lightning_dlrover.fault.coding.decode`). Its own parity share is re-encoded in the same batch of transfers
        when its sources are survivors (one lost rank), else right after the decode.
        """
        r = self.placement.r
        if len(lost) > r:
            raise RuntimeError(
                f"{len(lost)} ranks lost ({lost}) but parity tolerates r={r}; restore the last checkpoint instead."
            )
        self.rollback()
        # A replacement starts with small buffers, and an exchange abandoned by the failure leaves the partners
        # disagreeing on sizes: every rank starts over.
        self._mailbox = self._new_mailbox()

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
