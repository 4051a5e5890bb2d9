"""The erasure code: :class:`ReedSolomonCode`, and :func:`as_bytes` to code any tensor's bytes."""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from . import gf256
from .dispatch import kernels as _backend


def as_bytes(t: Tensor) -> Tensor:
    """Zero-copy uint8 view of a contiguous tensor of any dtype (float32, bfloat16, float16, ...).

    Args:
        t: contiguous tensor of shape [*B, D] and element size s (a 0-d tensor counts as [1]).

    Returns:
        uint8 tensor [*B, D * s] sharing storage with ``t``: writes to either show in the
        other, and ``as_bytes(t).view(t.dtype)`` gives ``t`` back bit for bit (NaN payloads and
        -0.0 included). Rows stay rows, so ``as_bytes(table)[rows]`` are the bytes of
        ``table[rows]``.
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"as_bytes expects a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(
            f"as_bytes needs a contiguous tensor to view it without copying; got shape "
            f"{tuple(t.shape)} with strides {t.stride()}: call .contiguous() first"
        )
    if t.dtype == torch.uint8:
        return t
    return (t.reshape(1) if t.dim() == 0 else t).view(torch.uint8)


def _check_bytes(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        raise TypeError(
            f"{name} must be a uint8 tensor, got {t.dtype}; view float or other data as bytes "
            f"with lightning_dlrover.parity.as_bytes(t)"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (the kernels read and write it as flat bytes); got shape "
            f"{tuple(t.shape)} with strides {t.stride()}: call .contiguous() or pass the "
            f"underlying buffer"
        )
    return t


def _check_like(name: str, t: Tensor, ref_name: str, ref: Tensor, shape: Sequence[int]) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} to match {ref_name}"
        )


def _check_index(name: str, value: object, low: int, high: int) -> int:
    try:
        index = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if not low <= index < high:
        raise ValueError(f"{name} = {index} is out of range [{low}, {high})")
    return index


class ReedSolomonCode:
    """Systematic MDS erasure code over bytes: k data shards, r parity shards, any k recover all.

    A shard is a uint8 tensor; all shards of one code word have the same shape S (usually [n]
    or [num_rows, row_bytes]) and are coded as flat bytes, byte position by byte position.
    Shard ids ``0..k-1`` are the data shards and ``k..k+r-1`` the parity shards. Parity shard
    ``k + j`` is ``XOR_i c[j, i] * data[i]`` over GF(2^8) (:mod:`.gf256`, polynomial 0x11d),
    with the coefficients :attr:`coefficients` of :func:`.gf256.cauchy_matrix`: every square
    submatrix is invertible, so any r lost shards are recovered exactly. Its first row is all
    ones: parity ``k`` is the XOR of the data shards, with r == 1 the code is plain XOR, and one
    lost data shard is rebuilt by XOR alone.

    The code is linear, so parity follows data changes without re-encoding: when data shard i
    changes from ``old`` to ``new``, ``update(parity, i, old ^ new)`` folds the change in
    (and starting from zero parity, ``update(parity, i, data_i)`` for every i encodes
    incrementally). :meth:`update_rows` does the same for a set of touched rows, the per-step
    path of embedding training. Data of other dtypes is coded through :func:`as_bytes`.

    Tensors may live on CPU (C kernels, :mod:`.cpu`) or CUDA (CuPy kernels, :mod:`.cuda`); all
    tensors of one call must be on the same device, and nothing is copied between devices.
    Tensors are never copied to make them contiguous: pass contiguous uint8 tensors.

    Args:
        k: number of data shards, >= 1.
        r: number of parity shards, >= 1, with k + r <= 256.

    Example::

        code = ReedSolomonCode(k=4, r=2)
        data = torch.randint(0, 256, (4, 1 << 20), dtype=torch.uint8)
        parity = code.encode(data)                                   # [2, 1 << 20]
        new0 = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        code.update(parity, 0, data[0] ^ new0)
        data[0] = new0
        lost = code.reconstruct({1: data[1], 2: data[2], 3: data[3], 5: parity[1]}, [0])
        assert torch.equal(lost[0], data[0])
    """

    def __init__(self, k: int, r: int) -> None:
        for name, value in (("k", k), ("r", r)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if k < 1 or r < 1:
            raise ValueError(f"need k >= 1 data shards and r >= 1 parity shards, got k={k}, r={r}")
        if k + r > 256:
            raise ValueError(
                f"k + r = {k + r} shards exceed the 256 distinct elements of GF(2^8) that the "
                f"code needs; use k + r <= 256 (e.g. split the shards into several groups)"
            )
        self._k = k
        self._r = r
        self._coefficients = gf256.cauchy_matrix(r, k)
        self._generator = np.concatenate([np.eye(k, dtype=np.uint8), self._coefficients])
        self._decode_matrix = functools.lru_cache(maxsize=256)(self._compute_decode_matrix)

    @property
    def k(self) -> int:
        """Number of data shards."""
        return self._k

    @property
    def r(self) -> int:
        """Number of parity shards (and of lost shards the code recovers)."""
        return self._r

    @property
    def coefficients(self) -> Tensor:
        """uint8 [r, k] (CPU, a copy): parity shard ``k + j`` is ``XOR_i c[j, i] * data[i]``."""
        return torch.from_numpy(self._coefficients.copy())

    def __repr__(self) -> str:
        return f"ReedSolomonCode(k={self._k}, r={self._r})"

    def encode(
        self,
        data: Tensor | Sequence[Tensor],
        *,
        parity_ids: Sequence[int] | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """Compute parity shards from the k data shards.

        Args:
            data: uint8 [k, *S], or a sequence of k uint8 tensors of shape [*S] (e.g. shards
                received from k ranks into separate buffers).
            parity_ids: the parity shards to compute (ids in ``k..k+r-1``); all r by default.
            out: optional uint8 [P, *S] to write into, P = len(parity_ids).

        Returns:
            uint8 [P, *S]: parity shard ``parity_ids[p]`` at index p (``out`` if given).
        """
        sources = self._shard_list("data", data, self._k)
        rows = self._parity_rows(parity_ids)
        shape = (len(rows), *sources[0].shape)
        out = self._output(out, shape, sources[0], "data")
        _backend(out.device).matmul(list(out), sources, self._coefficients[rows], False)
        return out

    def update(
        self,
        parity: Tensor,
        i: int,
        delta: Tensor,
        *,
        parity_ids: Sequence[int] | None = None,
    ) -> None:
        """Fold a change of data shard i into parity, in place: ``parity[p] ^= c[j, i] * delta``.

        Args:
            parity: uint8 [P, *S], parity shard ``parity_ids[p]`` at index p, updated in place.
            i: the data shard that changed, in ``0..k-1``.
            delta: uint8 [*S], old XOR new bytes of data shard i.
            parity_ids: the parity shard ids ``parity`` holds (in ``k..k+r-1``); all r by
                default. A rank holding only parity shard ``k + j`` passes ``[k + j]`` and a
                [1, *S] tensor.
        """
        i = _check_index("i", i, 0, self._k)
        rows = self._parity_rows(parity_ids)
        _check_bytes("parity", parity)
        _check_bytes("delta", delta)
        _check_like("parity", parity, "delta", delta, (len(rows), *delta.shape))
        _backend(parity.device).matmul(list(parity), [delta], self._coefficients[rows, i : i + 1], True)

    def update_rows(
        self,
        parity: Tensor,
        i: int,
        rows: Tensor,
        delta_rows: Tensor,
        *,
        parity_ids: Sequence[int] | None = None,
        check_rows: bool = True,
    ) -> None:
        """Fold changes of some rows of data shard i into parity, in place.

        Each parity shard is viewed as rows of ``row_bytes = delta_rows.shape[1]`` bytes, and
        for every t: ``parity[p, rows[t]] ^= c[j, i] * delta_rows[t]``. For an embedding table
        of D float32 columns, a row is ``4 * D`` bytes and ``delta_rows`` is
        ``as_bytes(old_rows) ^ as_bytes(new_rows)``.

        Args:
            parity: uint8 [P, *S] (typically [P, num_rows, row_bytes] or a flat [P, n]); each
                shard's ``prod(S)`` bytes must be a whole number ``num_rows`` of rows.
            i: the data shard the rows belong to, in ``0..k-1``.
            rows: int64 [m], row indices in ``0..num_rows-1``; they may repeat (every delta is
                applied, in order, which for XOR means all of them).
            delta_rows: uint8 [m, row_bytes], old XOR new bytes of each row.
            parity_ids: the parity shard ids ``parity`` holds, as in :meth:`update`.
            check_rows: raise ValueError (changing nothing) if a row is out of range. On CPU
                this is always done and costs nothing. On CUDA it reads a min/max back to the
                host, a synchronisation; with ``check_rows=False`` the kernel skips rows out of
                range instead.
        """
        i = _check_index("i", i, 0, self._k)
        coefs = self._coefficients[self._parity_rows(parity_ids), i]
        _check_bytes("parity", parity)
        _check_bytes("delta_rows", delta_rows)
        if not isinstance(rows, Tensor):
            raise TypeError(f"rows must be an int64 tensor, got {type(rows).__name__}")
        if rows.dtype != torch.int64:
            raise TypeError(f"rows must be an int64 tensor, got {rows.dtype}: convert with rows.long()")
        if rows.dim() != 1:
            raise ValueError(f"rows must be 1-D [m], got shape {tuple(rows.shape)}")
        if not rows.is_contiguous():
            raise ValueError("rows must be contiguous: call .contiguous()")
        if delta_rows.dim() != 2 or delta_rows.shape[0] != rows.shape[0] or delta_rows.shape[1] < 1:
            raise ValueError(
                f"delta_rows must be [m, row_bytes] with m = len(rows) = {rows.shape[0]} and "
                f"row_bytes >= 1, got shape {tuple(delta_rows.shape)}"
            )
        if parity.dim() < 1 or parity.shape[0] != len(coefs):
            raise ValueError(
                f"parity must be [P, *S] with P = {len(coefs)} parity shards, got shape "
                f"{tuple(parity.shape)}"
            )
        for name, t in (("rows", rows), ("delta_rows", delta_rows)):
            if t.device != parity.device:
                raise ValueError(f"{name} is on {t.device} but parity is on {parity.device}")
        row_bytes = delta_rows.shape[1]
        shard_bytes = parity[0].numel()
        if shard_bytes % row_bytes:
            raise ValueError(
                f"each parity shard has {shard_bytes} bytes, not a whole number of rows of "
                f"row_bytes = delta_rows.shape[1] = {row_bytes}"
            )
        parity_rows = parity.view(len(coefs), shard_bytes // row_bytes, row_bytes)
        _backend(parity.device).update_rows(parity_rows, coefs, rows, delta_rows, check_rows)

    def reconstruct(
        self,
        shards: Mapping[int, Tensor],
        ids: Sequence[int],
        *,
        out: Tensor | None = None,
    ) -> Tensor:
        """Recover the shards ``ids`` (data or parity) from any k available shards.

        Only the requested shards are computed, each reading k of the available shards (data
        shards first, then parity ``k``, ``k+1``, ...): a lost data shard with parity ``k``
        available costs one XOR pass. Shards listed in both ``ids`` and ``shards`` are copied.

        To recover only some rows (e.g. the rows a step needs first), pass the same rows of
        every available shard, e.g. ``{s: t.view(-1, row_bytes)[rows] for s, t in ...}``;
        the result holds those rows of the lost shards.

        Args:
            shards: at least k entries ``{shard id: uint8 [*S]}``, ids in ``0..k+r-1``, all of
                the same shape and on the same device.
            ids: the shard ids to return, without repeats.
            out: optional uint8 [len(ids), *S] to write into (e.g. ``lost.unsqueeze(0)`` to
                decode straight into a live buffer); must not overlap the shards read.

        Returns:
            uint8 [len(ids), *S]: shard ``ids[p]`` at index p (``out`` if given).
        """
        available = self._check_shards(shards)
        wanted = [_check_index(f"ids[{p}]", w, 0, self._k + self._r) for p, w in enumerate(ids)]
        if len(set(wanted)) != len(wanted):
            raise ValueError(f"ids must not repeat, got {wanted}")
        first = shards[available[0]]
        out = self._output(out, (len(wanted), *first.shape), first, "the shards")
        missing = []
        for p, w in enumerate(wanted):
            if w in shards:
                out[p].copy_(shards[w])
            else:
                missing.append(p)
        if missing:
            chosen = tuple(available[: self._k])
            matrix = self._decode_matrix(chosen, tuple(wanted[p] for p in missing))
            used = matrix.any(axis=0)
            sources = [shards[s] for s, u in zip(chosen, used) if u]
            _backend(out.device).matmul([out[p] for p in missing], sources, matrix[:, used], False)
        return out

    def decode(self, shards: Mapping[int, Tensor], *, out: Tensor | None = None) -> Tensor:
        """Recover all k data shards from any k available shards.

        Args:
            shards: at least k entries ``{shard id: uint8 [*S]}``, as in :meth:`reconstruct`.
            out: optional uint8 [k, *S] to write into.

        Returns:
            uint8 [k, *S], the data shards, bit-exact.
        """
        return self.reconstruct(shards, range(self._k), out=out)

    def _compute_decode_matrix(self, chosen: tuple[int, ...], wanted: tuple[int, ...]) -> np.ndarray:
        """uint8 [len(wanted), k]: shard ``wanted[p]`` = XOR_t M[p, t] * shard ``chosen[t]``."""
        # The chosen shards are G[chosen] @ data, so data = inverse(G[chosen]) @ chosen shards.
        recover = gf256.inverse_matrix(self._generator[list(chosen)])
        return gf256.matmul(self._generator[list(wanted)], recover)

    def _parity_rows(self, parity_ids: Sequence[int] | None) -> list[int]:
        """Rows of the coefficient matrix for ``parity_ids`` (shard ids in k..k+r-1)."""
        if parity_ids is None:
            return list(range(self._r))
        k, r = self._k, self._r
        rows = [_check_index(f"parity_ids[{p}]", s, k, k + r) - k for p, s in enumerate(parity_ids)]
        if not rows or len(set(rows)) != len(rows):
            raise ValueError(
                f"parity_ids must list one or more parity shard ids in [{k}, {k + r}) without "
                f"repeats, got {list(parity_ids)}"
            )
        return rows

    def _shard_list(self, name: str, data: Tensor | Sequence[Tensor], count: int) -> list[Tensor]:
        if isinstance(data, Tensor):
            _check_bytes(name, data)
            if data.dim() < 1 or data.shape[0] != count:
                raise ValueError(
                    f"{name} must be [{count}, *S] (one entry per shard), got shape "
                    f"{tuple(data.shape)}"
                )
            return list(data)
        shards = list(data)
        if len(shards) != count:
            raise ValueError(f"{name} must hold {count} shards, got {len(shards)}")
        for p, t in enumerate(shards):
            _check_bytes(f"{name}[{p}]", t)
            _check_like(f"{name}[{p}]", t, f"{name}[0]", shards[0], shards[0].shape)
        return shards

    def _check_shards(self, shards: Mapping[int, Tensor]) -> list[int]:
        """Validate ``shards`` and return its ids, sorted."""
        if not isinstance(shards, Mapping):
            raise TypeError(f"shards must be a mapping {{shard id: tensor}}, got {type(shards).__name__}")
        ids = sorted(_check_index("shard id", s, 0, self._k + self._r) for s in shards)
        if len(ids) < self._k:
            raise ValueError(
                f"need at least k = {self._k} shards to decode, got {len(ids)} (ids {ids}): "
                f"more than r = {self._r} shards are lost, which this code cannot recover"
            )
        ref = shards[ids[0]]
        for s in ids:
            _check_bytes(f"shards[{s}]", shards[s])
            _check_like(f"shards[{s}]", shards[s], f"shards[{ids[0]}]", ref, ref.shape)
        return ids

    @staticmethod
    def _output(out: Tensor | None, shape: tuple[int, ...], like: Tensor, like_name: str) -> Tensor:
        if out is None:
            return torch.empty(shape, dtype=torch.uint8, device=like.device)
        _check_bytes("out", out)
        _check_like("out", out, like_name, like, shape)
        return out
