"""Which kernels serve tensors on a device: one dispatch point for every caller of the kernels.

CPU tensors go to :mod:`.cpu` (the C kernels, or the torch ones when the extension is not built), CUDA tensors to
:mod:`.cuda` (CuPy) when CuPy can run, and any other device, or CUDA without CuPy, to :mod:`.portable` (torch ops,
correct on any device, slow; a warning says so once per device type). Every module returned has the same
``matmul(dst, src, coefs, accumulate)`` and ``update_rows(parity, coefs, rows, delta, check)``.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import torch

from . import cpu, cuda, portable

_warned_portable: set[str] = set()


def kernels(device: torch.device) -> ModuleType:
    """The kernel module for tensors on ``device`` (see the module docstring)."""
    if device.type == "cpu":
        return cpu
    if device.type == "cuda" and cuda.available():
        return cuda
    if device.type not in _warned_portable:
        _warned_portable.add(device.type)
        hint = " (install CuPy for the CUDA kernels)" if device.type == "cuda" else ""
        warnings.warn(
            f"lightning_dlrover.parity: no native kernels for {device.type} tensors{hint}; "
            f"using slow portable torch kernels",
            RuntimeWarning,
            stacklevel=3,
        )
    return portable
