"""Memory a hot spare touches while it waits, for the coded state it will decode if it takes a lost rank.

A replacement receives the lost rank's embedding shards, their optimizer state and its parity share into memory it
has just allocated. On this kind of machine the first write to fresh memory (a page fault per 4 KiB page) costs as
much as the copy itself: at 1.9 GiB of job state a replacement faulted ~1 GiB during its recovery. A hot spare has
nothing else to do while it waits for a rank, so it faults that memory then:

1. every rank of the running job publishes what a replacement of it would allocate (:func:`needed`, :func:`publish`:
   its FBGEMM host buffers that hold coded state, and its parity share), the store keeps the largest;
2. a hot spare reads it before it waits for a rank and touches that many bytes (:func:`prepare`);
3. the replacement's tables (``torchrec_glue.uninitialised_tables(host_buffer=take)``) and parity share
   (:func:`take`) are carved from it; whatever does not fit is fresh memory, as without a reserve.

The reserve holds memory the spare would allocate anyway once it takes a rank (a rank's state and parity); the part
that the rank it takes does not need (its state is smaller than the largest) is held until the process ends.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor
from torch.distributed import Store

from lightning_dlrover.log import get_logger
from lightning_dlrover.monitor.events import emit

log = get_logger(__name__)

#: Alignment of each buffer carved from the reserve (bytes): any dtype may view it.
ALIGN = 64
#: Bytes between the touches that fault the reserve in (the smallest page size of the machines it runs on).
PAGE = 4096
_KEY = "lightning_dlrover/{launch}/reserve_bytes"


class Reserve:
    """``nbytes`` of host memory, faulted in at construction, handed out front to back by :meth:`take`."""

    def __init__(self, nbytes: int) -> None:
        started = time.perf_counter()
        self.memory = torch.empty(nbytes, dtype=torch.uint8)
        self.memory[::PAGE].fill_(0)  # one write per page faults it in (the rest is written by the decode)
        self.used = 0
        #: Bytes handed out by :meth:`take`, and asked for that did not fit.
        self.taken = self.refused = 0
        #: Seconds spent faulting the memory in.
        self.prepare_s = time.perf_counter() - started

    def take(self, numel: int, dtype: torch.dtype) -> Tensor | None:
        """A 1-D ``dtype`` tensor of ``numel`` elements from the reserve (uninitialised), ``None`` when it does not
        fit in what is left."""
        start = -(-self.used // ALIGN) * ALIGN
        size = numel * torch.empty(0, dtype=dtype).element_size()
        if start + size > self.memory.numel():
            self.refused += size
            return None
        self.used, self.taken = start + size, self.taken + size
        return self.memory[start : start + size].view(dtype)


_reserve: Reserve | None = None


def needed(model: torch.nn.Module, parity: Tensor | None) -> int:
    """Bytes a replacement of this rank would take from a reserve: the FBGEMM host buffers of ``model``'s fused
    kernels that hold coded state and the ``parity`` share, each aligned."""
    from lightning_dlrover.torchrec_glue import CODED_HOST_BUFFERS, fused_embedding_kernels

    buffers = [getattr(kernel.emb_module, f"{name}_host", None) for kernel in fused_embedding_kernels(model)
               for name in CODED_HOST_BUFFERS]
    if parity is not None:
        buffers.append(parity)
    return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in buffers if t is not None and t.numel())


def publish(store: Store, launch: int, nbytes: int) -> None:
    """Raises the job's reserve size in ``store`` to ``nbytes`` if it is smaller (every rank calls it once)."""
    key = _KEY.format(launch=launch)
    current = b""
    while True:
        if current and int(current) >= nbytes:
            return
        swapped = store.compare_set(key, current, str(nbytes).encode())
        if swapped == str(nbytes).encode():
            return
        current = swapped


def published(store: Store, launch: int) -> int:
    """The largest rank's coded state and parity share in bytes, as the ranks published it (0 before they did)."""
    key = _KEY.format(launch=launch)
    return int(store.get(key)) if store.check([key]) else 0


def prepare(store: Store, launch: int) -> Reserve | None:
    """On a hot spare before it waits for a rank: faults in the reserve the job's ranks published (``None`` when
    none did yet); :func:`take` hands it out once the spare is a replacement. Never raises: without a reserve the
    replacement allocates fresh memory."""
    global _reserve
    try:
        nbytes = published(store, launch)
        _reserve = Reserve(nbytes) if nbytes else None
    except (RuntimeError, MemoryError, ValueError) as err:
        log.warning(f"this hot spare keeps no memory ready for a rank's state ({err}); a replacement allocates it")
        _reserve = None
    return _reserve


def take(numel: int, dtype: torch.dtype) -> Tensor | None:
    """A 1-D ``dtype`` tensor of ``numel`` elements from this process's reserve (faulted in, uninitialised), ``None``
    without a reserve or when it does not fit."""
    return _reserve.take(numel, dtype) if _reserve is not None else None


def release() -> None:
    """Forgets the reserve (what was taken stays with its tensors); on a replacement that had one, records how it
    was used (a ``reserve_used`` event)."""
    global _reserve
    if _reserve is not None:
        r = _reserve
        emit("reserve_used", reserved_bytes=r.memory.numel(), prepare_s=r.prepare_s, taken_bytes=r.taken,
             refused_bytes=r.refused)
    _reserve = None
