"""CPU kernels: the C extension ``_gf256`` (built by setup.py), with run-time instruction sets.

Instruction sets, slowest first: ``portable`` (the torch kernels of :mod:`.portable`, always
there), then those of the extension the CPU supports: ``scalar`` (table lookups, any CPU),
``avx2`` and ``avx512`` (split-nibble pshufb), ``gfni-avx2`` and ``gfni-avx512``
(gf2p8affineqb). The fastest available is used unless the environment variable
``LIGHTNING_DLROVER_GF_ISA`` names another, or :func:`set_isa` is called (tests, benchmarks).
If the extension is not built, a warning says so once and ``portable`` is used.

Kernels run on one thread and release the GIL. They read and write host memory only: every tensor address
handed to them is taken through :func:`host_ptr`, which refuses a tensor that is not on the CPU (the ``*_raw``
functions take addresses: their callers take them with :func:`host_ptr`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import numpy as np
from torch import Tensor

from . import gf256, portable

ISA_ENV = "LIGHTNING_DLROVER_GF_ISA"
PORTABLE = "portable"

try:
    from . import _gf256
except ImportError:
    _gf256 = None
    warnings.warn(
        "lightning_dlrover.parity: the C extension _gf256 is not built, so CPU parity coding "
        "uses slow torch kernels. Build it with `pip install --no-build-isolation -e .`.",
        RuntimeWarning,
        stacklevel=2,
    )
else:
    _gf256.init(gf256.MUL_TABLE.tobytes())

_use_portable = _gf256 is None


def available_isas() -> tuple[str, ...]:
    """Instruction sets this machine can run, slowest first (see the module docstring)."""
    return (PORTABLE,) + (_gf256.isas() if _gf256 is not None else ())


def isa() -> str:
    """The instruction set in use."""
    return PORTABLE if _use_portable else _gf256.get_isa()


def set_isa(name: str) -> str:
    """Use instruction set ``name`` (one of :func:`available_isas`); returns the previous one."""
    global _use_portable
    if name not in available_isas():
        raise ValueError(
            f"instruction set {name!r} is not available here; choose one of {available_isas()}"
        )
    previous = isa()
    _use_portable = name == PORTABLE
    if not _use_portable:
        _gf256.set_isa(name)
    return previous


def host_ptr(tensor: Tensor, what: str) -> int:
    """``tensor.data_ptr()``, to hand to a C kernel, or ValueError if ``tensor`` is not in host memory.

    A C kernel given the address of a CUDA (or any non-CPU) buffer reads or writes it as host memory: a crash or
    silent corruption, not an error. Every ``data_ptr()`` passed to a kernel of this module goes through here.

    Args:
        tensor: the tensor whose buffer the kernel reads or writes.
        what: what it is, for the message (e.g. ``"parity"``).
    """
    if tensor.is_cpu:  # tensor.device.type == "cpu", without building a device object (this is per kernel call)
        return tensor.data_ptr()
    raise ValueError(
        f"{what} is on {tensor.device}; the CPU kernels need CPU tensors: keep the buffers on the CPU, or use "
        f"the per-device kernels (lightning_dlrover.parity.dispatch.kernels(device), ReedSolomonCode)"
    )


def matmul(dst: Sequence[Tensor], src: Sequence[Tensor], coefs: np.ndarray, accumulate: bool) -> None:
    """``dst[j] = (dst[j] if accumulate else 0) ^ XOR_i coefs[j, i] * src[i]``.

    Args:
        dst: r uint8 contiguous tensors of n bytes each (any shape), written in place.
        src: k uint8 contiguous tensors of n bytes each, not overlapping ``dst``.
        coefs: uint8 [r, k].
        accumulate: fold into the current ``dst`` instead of overwriting it.
    """
    if _use_portable:
        portable.matmul(dst, src, coefs, accumulate)
        return
    _gf256.matmul(
        [host_ptr(d, "dst") for d in dst],
        [host_ptr(s, "src") for s in src],
        np.ascontiguousarray(coefs, dtype=np.uint8).tobytes(),
        dst[0].numel(),
        accumulate,
    )


def update_rows(parity: Tensor, coefs: np.ndarray, rows: Tensor, delta: Tensor, check: bool) -> None:
    """``parity[p, rows[t]] ^= coefs[p] * delta[t]`` for every p and t.

    Args:
        parity: uint8 [P, num_rows, row_bytes] contiguous, updated in place.
        coefs: uint8 [P].
        rows: int64 [m] contiguous; may repeat (each delta is applied).
        delta: uint8 [m, row_bytes] contiguous.
        check: ignored by the C kernels, which always check rows (it costs nothing next to the
            row updates) and raise ValueError, changing nothing, if one is out of range.
    """
    if _use_portable:
        portable.update_rows(parity, coefs, rows, delta, check)
        return
    _gf256.update_rows(
        host_ptr(parity, "parity"),
        parity.shape[1] * parity.shape[2],
        np.ascontiguousarray(coefs, dtype=np.uint8).tobytes(),
        host_ptr(rows, "rows"),
        rows.numel(),
        parity.shape[1],
        host_ptr(delta, "delta"),
        parity.shape[2],
    )


if os.environ.get(ISA_ENV):
    try:
        set_isa(os.environ[ISA_ENV])
    except ValueError as error:
        raise ValueError(f"{ISA_ENV}={os.environ[ISA_ENV]!r}: {error}") from None


def has_raw_kernels() -> bool:
    """Whether :func:`gather_xor_raw` and :func:`update_rows_raw` run (the C extension is built with them and in use);
    callers fall back to torch operations (bit-identical) otherwise."""
    return not _use_portable and hasattr(_gf256, "gather_xor")


def gather_xor_raw(out: int, table: int, num_rows: int, rows: int, m: int, old: int, row_bytes: int) -> None:
    """``out[t] = table[rows[t]] ^ old[t]`` for ``t < m`` over rows of ``row_bytes`` bytes, on buffer addresses (no
    tensor views to build: the per-block cost of a parity commit). ``rows``: int64 [m] in ``[0, num_rows)``, else
    ValueError and nothing written."""
    _gf256.gather_xor(out, table, num_rows, rows, m, old, row_bytes)


def update_rows_raw(parity: int, shard_stride: int, coefs: bytes, rows: int, m: int, num_rows: int, delta: int,
                    row_bytes: int) -> None:
    """:func:`update_rows` on buffer addresses: ``parity[p][rows[t]] ^= coefs[p] * delta[t]``."""
    _gf256.update_rows(parity, shard_stride, coefs, rows, m, num_rows, delta, row_bytes)


def has_undo_kernels() -> bool:
    """Whether :func:`gather_xor_at_raw`, :func:`undo_mark_raw` and :func:`undo_sorted_raw` run (an extension built with
    them, in use); callers fall back to torch operations with the same results otherwise."""
    return not _use_portable and hasattr(_gf256, "undo_mark")


def gather_xor_at_raw(out: int, table: int, num_rows: int, rows: int, m: int, old: int, old_rows: int, at: int,
                      row_bytes: int) -> None:
    """``out[t] = table[rows[t]] ^ old[at[t]]`` for ``t < m`` (:func:`gather_xor_raw` with the old rows at the int64
    places ``at`` in ``[0, old_rows)``), else ValueError and nothing written."""
    _gf256.gather_xor_at(out, table, num_rows, rows, m, old, old_rows, at, row_bytes)


def undo_mark_raw(ids: int, m: int, pos: int, num_rows: int, log_rows: int, n: int, cap: int) -> int:
    """Appends each of ``ids`` (int64 [m]) with ``pos[id] < 0`` (int32 [num_rows]) once to ``log_rows`` (int64, ``n``
    rows logged, room for ``cap >= min(num_rows, n + m)``) in first-seen order, setting ``pos[id]`` to its place;
    returns the new ``n``. An id out of range raises ValueError and changes nothing."""
    return _gf256.undo_mark(ids, m, pos, num_rows, log_rows, n, cap)


def undo_sorted_raw(pos: int, num_rows: int, rows: int, at: int, n: int) -> None:
    """Writes the ``n`` rows with ``pos[row] >= 0`` in increasing order to ``rows`` and their ``pos[row]`` to ``at``
    (both int64 [n])."""
    _gf256.undo_sorted(pos, num_rows, rows, at, n)
