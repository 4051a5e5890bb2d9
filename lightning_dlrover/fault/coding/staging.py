"""The commit's bytes when the coded shards are on a GPU: ordered after the step's work on the device, and staged
through pinned host memory to and from the CPU (gloo) control plane.

Parity, undo logs and deltas live on the shards' device and are computed there (the kernels of
:mod:`lightning_dlrover.parity.dispatch`). What travels between ranks goes through CPU collectives and point-to-point
transfers (gloo, which sends and receives host memory only): a delta message built on the device is copied to pinned
host memory before it is sent, and a received one is copied back to the device before it is folded into parity.
Shards in host memory are not staged: every function and method here then returns its input as it is.

Ordering. The fused optimizer updates the rows inside the embedding kernels' backward; autograd runs a backward op
on the stream of its forward op and orders the stream current at the ``backward()`` call after it. The deltas are
captured (new rows XOR the undo log) by ops enqueued on the current stream once the step's backward and optimizer
calls have returned, so they read the updated rows. The host then waits for an event recorded after the copies to
pinned memory (:meth:`Staging.to_host`) before gloo reads those bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor


def host_copy(t: Tensor) -> Tensor:
    """``t`` if it is in host memory, else a copy there, complete when this returns (what gloo can send)."""
    if t.device.type == "cpu":
        return t
    # Untested on GPU: a blocking copy to pageable memory (waits for the current stream's work before it).
    return t.to("cpu")


def landing(out: Tensor) -> Tensor:
    """Where gloo receives bytes meant for ``out``: ``out`` itself in host memory, else a host buffer of its size
    (copy it into ``out`` with :func:`land` once received)."""
    if out.device.type == "cpu":
        return out
    # Untested on GPU: the receive lands in pinned memory, then one copy to the device.
    return torch.empty(out.shape, dtype=out.dtype, pin_memory=True)


def land(out: Tensor, received: Tensor) -> None:
    """Copies the bytes received into ``landing(out)`` into ``out`` (nothing to do when they are the same)."""
    if received is not out:
        # Untested on GPU: a blocking copy from pinned memory (``received`` is reused or freed once it returns).
        out.copy_(received)


class Staging:
    """The delta messages of one rank's :class:`~lightning_dlrover.fault.coding.CodedEmbeddings` between the shards'
    device and pinned host memory (see the module docstring).

    Args:
        device: where the coded shards (and their parity) live.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: Whether the shards are in host memory: nothing is staged and the C kernels serve them.
        self.on_host = device.type == "cpu"
        self._received: torch.cuda.Event | None = None

    def to_host(self, messages: dict[int, Tensor]) -> dict[int, Tensor]:
        """The messages in host memory for the exchange: themselves on the CPU, else pinned copies whose bytes are
        complete when this returns."""
        if self.on_host:
            return messages
        # Untested on GPU: the copies are enqueued on the current stream after the capture that wrote the messages
        # (see the module docstring); the event after them is waited on here, before gloo reads the pinned bytes.
        stream = torch.cuda.current_stream(self.device)
        staged = {}
        for dst, message in messages.items():
            staged[dst] = torch.empty(message.numel(), dtype=torch.uint8, pin_memory=True)
            staged[dst].copy_(message, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
        copied.synchronize()
        self.wait_received()
        return staged

    def to_device(self, message: Tensor) -> Tensor:
        """A received message (host memory) on the shards' device: itself on the CPU, else a copy, ordered before
        the work enqueued after it on the current stream (the parity update that reads it)."""
        if self.on_host:
            return message
        # Untested on GPU: an asynchronous copy from the mailbox's pinned buffer, which must not be received into
        # again before the copy has read it: :meth:`wait_received` (called by :meth:`to_host`, before the next
        # exchange is posted) waits for it.
        copy = message.to(self.device, non_blocking=True)
        self._received = torch.cuda.Event()
        self._received.record(torch.cuda.current_stream(self.device))
        return copy

    def wait_received(self) -> None:
        """Waits until the device has read the messages last received (their buffers may then be written again)."""
        if self._received is not None:
            # Untested on GPU.
            self._received.synchronize()
            self._received = None
