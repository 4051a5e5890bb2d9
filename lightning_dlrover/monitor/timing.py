"""Per-step section timing: the :class:`StepTimer` strategies time their own work with, and batch-size inference."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

BUILTIN_SECTIONS = ("data_wait", "forward", "backward", "optimizer")


class StepTimer:
    """Accumulates wall-clock seconds per named section within the current training step.

    A strategy owns one as ``self.step_timer`` and wraps its own work::

        with self.step_timer.section("parity"):
            ...

    :class:`ThroughputMonitor` takes the step's sections with :meth:`pop_step` at every training batch
    end. A section entered several times in one step accumulates.

    Args:
        cuda_sync: synchronise the current CUDA device when a section starts and ends, so that the
            section measures the kernels it launched rather than their launch.
    """

    def __init__(self, cuda_sync: bool = False) -> None:
        self.cuda_sync = cuda_sync
        self._seconds: dict[str, float] = {}

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time the enclosed block and add it to section ``name`` of the current step."""
        if name in BUILTIN_SECTIONS:
            raise ValueError(f"Section name {name!r} is reserved for ThroughputMonitor's own sections")
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def pop_step(self) -> dict[str, float]:
        """Return the seconds per section accumulated since the last call, and start afresh."""
        seconds, self._seconds = self._seconds, {}
        return seconds

    def _sync(self) -> None:
        if self.cuda_sync and torch.cuda.is_available():
            torch.cuda.synchronize()


def _infer_batch_size(batch: Any) -> int | None:
    """Dim 0 of the batch: of a tensor, of ``batch.labels`` (TorchRec ``Batch``), or of the first tensor
    found depth-first in a mapping or sequence; ``None`` if there is none."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    labels = getattr(batch, "labels", None)
    if isinstance(labels, torch.Tensor):
        return _infer_batch_size(labels)
    if isinstance(batch, Mapping):
        items = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return None
    for item in items:
        size = _infer_batch_size(item)
        if size is not None:
            return size
    return None
