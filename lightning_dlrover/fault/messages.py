"""Point-to-point exchange between ranks, and the one message framing every exchange of the fault layer uses.

A message is ``int64 H``, then ``H`` int64 header words, then payload bytes; what the words mean is the
sender's and receiver's business (row deltas, decode inputs, re-shard pieces).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dlrover.parity import as_bytes


def exchange(sends: dict[int, Tensor], dtype: torch.dtype = torch.uint8) -> dict[int, Tensor]:
    """Point-to-point exchange of 1-D tensors: ``sends[dst]`` goes to ``dst``; returns what each rank sent here
    (a collective: one all-to-all of sizes, then the transfers)."""
    world, me = dist.get_world_size(), dist.get_rank()
    counts = torch.tensor([sends[d].numel() if d in sends else 0 for d in range(world)], dtype=torch.int64)
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts)
    received = {src: torch.empty(int(n), dtype=dtype) for src, n in enumerate(incoming.tolist()) if n and src != me}
    ops = [dist.P2POp(dist.isend, t.contiguous(), d) for d, t in sends.items() if t.numel() and d != me]
    ops += [dist.P2POp(dist.irecv, t, src) for src, t in received.items()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if me in sends and sends[me].numel():
        received[me] = sends[me].clone()
    return received


def exchange_with(sends: dict[int, Tensor], sources: list[int]) -> dict[int, Tensor]:
    """Pairwise exchange with fixed partners and no collective: one uint8 message to every rank in ``sends`` and
    one from every rank in ``sources`` (a rank with nothing to say sends an empty message). Each message's length
    travels first (8 bytes), then the message; only the partners wait for each other."""
    lengths = {src: torch.empty(1, dtype=torch.int64) for src in sources}
    ops = [dist.P2POp(dist.isend, torch.tensor([t.numel()], dtype=torch.int64), dst) for dst, t in sends.items()]
    ops += [dist.P2POp(dist.irecv, length, src) for src, length in lengths.items()]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    received = {src: torch.empty(int(length), dtype=torch.uint8) for src, length in lengths.items()}
    ops = [dist.P2POp(dist.isend, t, dst) for dst, t in sends.items() if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, src) for src, t in received.items() if t.numel()]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
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
