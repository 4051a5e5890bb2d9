"""Point-to-point exchanges between ranks: a general one (:func:`exchange`, sizes told first, with the
:func:`pack` framing: ``int64 H``, ``H`` int64 header words, payload bytes) and the per-step one of parity commits
(:class:`Mailbox`: fixed partners, persistent buffers, one round). Decode and re-shard transfers need neither:
every worker derives them from the layouts (:mod:`lightning_dlrover.fault.coding.decode`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dlrover import control_plane
from lightning_dlrover.parity import as_bytes


def exchange(sends: dict[int, Tensor], dtype: torch.dtype = torch.uint8) -> dict[int, Tensor]:
    """Point-to-point exchange of 1-D tensors: ``sends[dst]`` goes to ``dst``; returns what each rank sent here
    (a collective: one all-to-all of sizes, then the transfers)."""
    world, me, control = dist.get_world_size(), dist.get_rank(), control_plane.group()
    counts = torch.tensor([sends[d].numel() if d in sends else 0 for d in range(world)], dtype=torch.int64)
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=control)
    received = {src: torch.empty(int(n), dtype=dtype) for src, n in enumerate(incoming.tolist()) if n and src != me}
    ops = [dist.P2POp(dist.isend, t.contiguous(), d, group=control) for d, t in sends.items() if t.numel() and d != me]
    ops += [dist.P2POp(dist.irecv, t, src, group=control) for src, t in received.items()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if me in sends and sends[me].numel():
        received[me] = sends[me].clone()
    return received


def align(offset: int, to: int = 8) -> int:
    """``offset`` rounded up to a multiple of ``to`` (payload blocks start aligned, so they can be viewed as any dtype)."""
    return -(-offset // to) * to


def pack(words: list[Tensor] | list[int], payload: list[Tensor]) -> Tensor:
    """One message: the header ``words`` (int64 tensors or ints) and the ``payload`` tensors' bytes, in order."""
    head = torch.cat([w.reshape(-1) for w in words]) if words and torch.is_tensor(words[0]) else torch.tensor(words)
    head = head.to(torch.int64)
    return torch.cat([as_bytes(torch.tensor([head.numel()], dtype=torch.int64)), as_bytes(head), *map(as_bytes, payload)])


def unpack(message: Tensor) -> tuple[Tensor, Tensor]:
    """``(header words int64 [H], payload uint8)`` of a message built by :func:`pack` (views, no copy)."""
    count = int(message[:8].view(torch.int64))
    return message[8 : 8 + 8 * count].view(torch.int64), message[8 + 8 * count :]


class Mailbox:
    """Pairwise exchange with fixed partners over persistent receive buffers, in one round and no collective.

    Every message starts with its total length in bytes (an int64). A receiver posts its buffer for the message
    before knowing its length (gloo accepts a shorter message); a message longer than the buffer travels in two
    parts, the rest once the receiver has read the length. Both sides then grow the buffer the same way (each knows
    the length), so a later message of that size fits in one part. Received messages are views of the buffers,
    valid until the next :meth:`exchange`. :meth:`post` and :meth:`collect` split an exchange in two, so that
    other work runs while the messages travel. After a failure mid-exchange the two sides may disagree on the
    buffer sizes: every rank of the new communicator then starts a new ``Mailbox``.

    Args:
        sources: ranks that send a message here at every exchange.
        capacity: initial receive buffer bytes per source. Small: a buffer grows to the first message that does not
            fit (one message in two parts), so every job, small test jobs included, runs the growth path.
        pin_memory: receive into pinned host memory (shards on a GPU: the received deltas are copied to the device
            asynchronously, see :mod:`lightning_dlrover.fault.coding.staging`). Messages are host memory either way:
            the exchange runs over the CPU (gloo) control plane.
    """

    def __init__(self, sources: list[int], capacity: int = 1 << 12, pin_memory: bool = False) -> None:
        self._pin = pin_memory  # Untested on GPU: pinned receive buffers
        self._inbox = {src: torch.empty(capacity, dtype=torch.uint8, pin_memory=pin_memory) for src in sources}
        self._capacity_out: dict[int, int] = {}
        self._initial = capacity
        self._posted: tuple[list[tuple[int, Tensor, dist.Work]], list[dist.Work], list[Tensor]] | None = None

    @staticmethod
    def _grown(capacity: int, length: int) -> int:
        while capacity < length:
            capacity *= 2
        return capacity

    def exchange(self, sends: dict[int, Tensor]) -> dict[int, Tensor]:
        """Sends ``sends[dst]`` (uint8, first 8 bytes its length) to each ``dst``; returns each source's message."""
        self.post(sends)
        return self.collect()

    def post(self, sends: dict[int, Tensor]) -> None:
        """Starts an exchange (:meth:`exchange`) and returns at once; :meth:`collect` finishes it. The messages
        must not change until then."""
        if self._posted is not None:
            raise RuntimeError("Mailbox.post: the previous exchange was not collected.")
        control = control_plane.group()
        receives = [(src, box, dist.irecv(box, src, group=control, tag=0)) for src, box in self._inbox.items()]
        sending = []
        for dst, message in sends.items():
            capacity = self._capacity_out.get(dst, self._initial)
            sending.append(dist.isend(message[:capacity], dst, group=control, tag=0))
            if message.numel() > capacity:
                sending.append(dist.isend(message[capacity:], dst, group=control, tag=1))
                self._capacity_out[dst] = self._grown(capacity, message.numel())
        self._posted = (receives, sending, list(sends.values()))  # the messages live until sent

    def collect(self) -> dict[int, Tensor]:
        """Waits for the posted exchange; returns each source's message."""
        if self._posted is None:
            raise RuntimeError("Mailbox.collect: nothing was posted.")
        receives, sending, _ = self._posted
        received, rest, control = {}, [], control_plane.group()
        for src, box, work in receives:
            work.wait()
            length = int(box[:8].view(torch.int64))
            if length > box.numel():
                grown = torch.empty(self._grown(box.numel(), length), dtype=torch.uint8, pin_memory=self._pin)
                grown[: box.numel()] = box
                rest.append(dist.irecv(grown[box.numel() : length], src, group=control, tag=1))
                self._inbox[src] = box = grown
            received[src] = box[:length]
        for work in rest + sending:
            work.wait()
        self._posted = None
        return received

    @property
    def posted(self) -> bool:
        """Whether an exchange was posted and not collected."""
        return self._posted is not None
