"""GF(2^8) kernels written in plain torch ops: correct on any device, but slow.

They stand in when the C extension is not built (CPU) or CuPy is missing (CUDA). There is no
per-byte table gather (0.16 GB/s on CPU): multiplication is bit-sliced. With ``x_b`` the byte
tensor holding bit b of every byte of x (0 or 1), ``c * x = XOR over b of x_b * (c * 2**b)``, and
each ``x_b * (c * 2**b)`` is an ordinary uint8 product (no carry). The eight bit planes of a
source are computed once and shared by every output it contributes to.

Same contract as :mod:`.cpu` and :mod:`.cuda`: tensors are uint8 and contiguous, and all on one
device; the caller (:class:`~lightning_dlrover.parity.codes.ReedSolomonCode`) checks that.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from . import gf256

# Bytes per pass: the eight bit planes of a chunk stay within a few MB of temporaries.
_CHUNK_BYTES = 1 << 20


def _bit_planes(x: Tensor) -> list[Tensor]:
    return [(x >> b) & 1 for b in range(8)]


def _mul_xor(acc: Tensor, x: Tensor, planes: list[Tensor] | None, c: int) -> None:
    """``acc ^= c * x``; ``planes`` are x's bit planes, needed unless c is 0 or 1."""
    if c == 0:
        return
    if c == 1:
        acc ^= x
        return
    assert planes is not None
    for plane, factor in zip(planes, gf256.bit_products(c).tolist()):
        if factor:
            acc ^= plane * factor


def matmul(dst: Sequence[Tensor], src: Sequence[Tensor], coefs: np.ndarray, accumulate: bool) -> None:
    """``dst[j] = (dst[j] if accumulate else 0) ^ XOR_i coefs[j, i] * src[i]``.

    Args:
        dst: r uint8 tensors of n bytes each (any shape), written in place.
        src: k uint8 tensors of n bytes each, not overlapping ``dst``.
        coefs: uint8 [r, k].
        accumulate: fold into the current ``dst`` instead of overwriting it.
    """
    flat_dst = [d.view(-1) for d in dst]
    flat_src = [s.view(-1) for s in src]
    n = flat_dst[0].numel()
    for start in range(0, n, _CHUNK_BYTES):
        stop = min(start + _CHUNK_BYTES, n)
        acc = [d[start:stop] for d in flat_dst]
        if not accumulate:
            for a in acc:
                a.zero_()
        for i, s in enumerate(flat_src):
            x = s[start:stop]
            column = coefs[:, i].tolist()
            planes = _bit_planes(x) if any(c > 1 for c in column) else None
            for a, c in zip(acc, column):
                _mul_xor(a, x, planes, c)


def check_rows(rows: Tensor, num_rows: int, row_bytes: int) -> None:
    """Raise ValueError unless every entry of ``rows`` lies in [0, num_rows).

    Reads the result on the host, so on CUDA it waits for the device.
    """
    if rows.numel() == 0:
        return
    low, high = (v.item() for v in torch.aminmax(rows))
    if low >= 0 and high < num_rows:
        return
    t = int(((rows < 0) | (rows >= num_rows)).nonzero()[0, 0])
    raise ValueError(
        f"rows[{t}] = {int(rows[t])} is out of range: the parity has {num_rows} rows of "
        f"{row_bytes} bytes"
    )


def _duplicate_free_batches(rows: Tensor) -> list[Tensor]:
    """Positions of ``rows`` split into batches in which no row index repeats.

    Batch l holds the (l+1)-th occurrence of every row, so that indexed read-modify-writes of
    one batch never collide and repeated rows get every one of their deltas.
    """
    m = rows.numel()
    order = torch.argsort(rows, stable=True)
    ordered = rows[order]
    starts_group = torch.ones(m, dtype=torch.bool, device=rows.device)
    starts_group[1:] = ordered[1:] != ordered[:-1]
    positions = torch.arange(m, device=rows.device)
    group_start = torch.cummax(torch.where(starts_group, positions, 0), dim=0).values
    occurrence = torch.empty_like(positions)
    occurrence[order] = positions - group_start
    return [(occurrence == level).nonzero().squeeze(1) for level in range(int(occurrence.max()) + 1)]


def update_rows(parity: Tensor, coefs: np.ndarray, rows: Tensor, delta: Tensor, check: bool) -> None:
    """``parity[p, rows[t]] ^= coefs[p] * delta[t]`` for every p and t.

    Args:
        parity: uint8 [P, num_rows, row_bytes], updated in place.
        coefs: uint8 [P].
        rows: int64 [m]; may repeat (each delta is applied).
        delta: uint8 [m, row_bytes].
        check: raise ValueError on rows out of range (otherwise torch raises IndexError).
    """
    if rows.numel() == 0:
        return
    if check:
        check_rows(rows, parity.shape[1], parity.shape[2])
    for batch in _duplicate_free_batches(rows):
        batch_rows = rows[batch]
        d = delta[batch]
        planes = _bit_planes(d) if any(c > 1 for c in coefs.tolist()) else None
        for shard, c in zip(parity, coefs.tolist()):
            updated = shard[batch_rows]
            _mul_xor(updated, d, planes, c)
            shard[batch_rows] = updated
