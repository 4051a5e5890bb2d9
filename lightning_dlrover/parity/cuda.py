"""CUDA kernels: CuPy RawModule, compiled by NVRTC on first use per device.

Kernels take the tensors' device addresses (``Tensor.data_ptr()``): nothing is copied to the
host or between buffers, and they run on torch's current stream, ordered with torch's own work.
CuPy is imported lazily; :func:`available` says whether it can run.

Multiplication is bit-sliced on 32-bit words (as in :mod:`.portable`): with ``x_b`` the word
holding bit b of each of its four bytes in bit 0 of that byte, ``c * x = XOR_b x_b * (c * 2**b)``
where each product is one integer multiply with no carry between bytes. The eight planes of a
source word are shared by every output, so a k-to-r product costs about 4 integer operations per
byte for the planes plus 4 per byte and output (8 multiplies and 8 XORs per word), with no
shared-memory tables (no bank conflicts, no setup).
Each thread handles 16 bytes (one ``uint4``) when every buffer is 16-byte aligned, otherwise
single bytes.

Sparse row updates XOR into the parity with ``atomicXor`` on 32-bit words, so rows may repeat
within one call.

Same contract as :mod:`.cpu`: tensors are uint8 and contiguous, and all on one CUDA device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from . import gf256
from .portable import check_rows

GROUP = 4
"""Outputs computed per pass over the sources (their accumulators live in registers)."""

SOURCE = r"""
typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;

#define GROUP 4

// Bit plane b of the four bytes of w: bit b of each byte, moved to bit 0 of that byte.
__device__ __forceinline__ void bit_planes(u32 w, u32 (&plane)[8]) {
#pragma unroll
    for (int b = 0; b < 8; ++b) plane[b] = (w >> b) & 0x01010101u;
}

// c * x for the four bytes whose bit planes are given; cb[b] = c * 2^b in GF(2^8).
__device__ __forceinline__ u32 mul_planes(const u32 (&plane)[8], const u32 (&cb)[8]) {
    u32 acc = 0;
#pragma unroll
    for (int b = 0; b < 8; ++b) acc ^= plane[b] * cb[b];
    return acc;
}

// The 8 products c * 2^b of one coefficient, stored as 8 u32 at a 16-byte aligned address.
__device__ __forceinline__ void load_products(const u32* p, u32 (&cb)[8]) {
    const uint4 lo = reinterpret_cast<const uint4*>(p)[0];
    const uint4 hi = reinterpret_cast<const uint4*>(p)[1];
    cb[0] = lo.x; cb[1] = lo.y; cb[2] = lo.z; cb[3] = lo.w;
    cb[4] = hi.x; cb[5] = hi.y; cb[6] = hi.z; cb[7] = hi.w;
}

// Bytes handled per thread and step: 16 as four words (16-byte aligned buffers), or one.
template <int WORDS> struct Unit;
template <> struct Unit<4> {
    static const int BYTES = 16;
    __device__ static void load(const u8* p, u32 (&w)[4]) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
    __device__ static void store(u8* p, const u32 (&w)[4]) {
        *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    }
};
template <> struct Unit<1> {
    static const int BYTES = 1;
    __device__ static void load(const u8* p, u32 (&w)[1]) { w[0] = *p; }
    __device__ static void store(u8* p, const u32 (&w)[1]) { *p = (u8)w[0]; }
};

// dst[g] = (accumulate ? dst[g] : 0) ^ XOR_i c[g][i] * src[i] for g < G <= GROUP, over the
// `units` units from byte `offset`. src, dst: device arrays of k and G addresses; products:
// [G, k, 8] u32, c[g][i] * 2^b. xor_only (G == 1, every c == 1): plain XOR.
template <int WORDS>
__device__ void matmul(u64 src_addr, int k, u64 dst_addr, int G, u64 products_addr,
                       int xor_only, int accumulate, long long offset, long long units) {
    typedef Unit<WORDS> U;
    const u64* src = reinterpret_cast<const u64*>(src_addr);
    const u64* dst = reinterpret_cast<const u64*>(dst_addr);
    const u32* products = reinterpret_cast<const u32*>(products_addr);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += stride) {
        const long long off = offset + u * U::BYTES;
        u32 acc[GROUP][WORDS];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            if (g >= G) continue;
            if (accumulate) {
                U::load(reinterpret_cast<const u8*>(dst[g]) + off, acc[g]);
            } else {
#pragma unroll
                for (int q = 0; q < WORDS; ++q) acc[g][q] = 0;
            }
        }
        for (int i = 0; i < k; ++i) {
            u32 x[WORDS];
            U::load(reinterpret_cast<const u8*>(src[i]) + off, x);
            if (xor_only) {
#pragma unroll
                for (int q = 0; q < WORDS; ++q) acc[0][q] ^= x[q];
                continue;
            }
            u32 planes[WORDS][8];
#pragma unroll
            for (int q = 0; q < WORDS; ++q) bit_planes(x[q], planes[q]);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                if (g >= G) continue;
                u32 cb[8];
                load_products(products + ((long long)g * k + i) * 8, cb);
#pragma unroll
                for (int q = 0; q < WORDS; ++q) acc[g][q] ^= mul_planes(planes[q], cb);
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            if (g < G) U::store(reinterpret_cast<u8*>(dst[g]) + off, acc[g]);
        }
    }
}

extern "C" __global__ void gf_matmul16(u64 src, int k, u64 dst, int G, u64 products,
                                       int xor_only, int accumulate, long long offset,
                                       long long units) {
    matmul<4>(src, k, dst, G, products, xor_only, accumulate, offset, units);
}

extern "C" __global__ void gf_matmul1(u64 src, int k, u64 dst, int G, u64 products,
                                      int xor_only, int accumulate, long long offset,
                                      long long units) {
    matmul<1>(src, k, dst, G, products, xor_only, accumulate, offset, units);
}

// parity[p][rows[t]] ^= c[p] * delta[t] for p < P, t < m, one 32-bit word per thread and step
// (row_bytes, the buffers and shard_stride are multiples of 4). Rows may repeat: atomicXor.
// Rows out of range are skipped (the host checks them unless told not to).
extern "C" __global__ void gf_update_rows4(u64 parity_addr, long long shard_stride, int P,
                                           u64 products_addr, int xor_only, u64 rows_addr,
                                           long long m, long long num_rows, u64 delta_addr,
                                           long long row_bytes) {
    u8* parity = reinterpret_cast<u8*>(parity_addr);
    const u32* products = reinterpret_cast<const u32*>(products_addr);
    const long long* rows = reinterpret_cast<const long long*>(rows_addr);
    const u32* delta = reinterpret_cast<const u32*>(delta_addr);
    const long long row_words = row_bytes / 4;
    const long long total = m * row_words;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += stride) {
        const long long t = idx / row_words;
        const long long row = rows[t];
        const u32 d = delta[idx];
        if (row < 0 || row >= num_rows || d == 0) continue;
        u32 planes[8];
        bit_planes(d, planes);
        u32* word = reinterpret_cast<u32*>(parity + row * row_bytes) + (idx - t * row_words);
        for (int p = 0; p < P; ++p) {
            u32 prod = d;
            if (!xor_only) {
                u32 cb[8];
                load_products(products + p * 8, cb);
                prod = mul_planes(planes, cb);
            }
            atomicXor(reinterpret_cast<u32*>(reinterpret_cast<u8*>(word) + p * shard_stride), prod);
        }
    }
}

// As gf_update_rows4, one byte per thread and step, for any alignment: the byte is XORed into
// its aligned 32-bit word (the other three bytes XOR with 0).
extern "C" __global__ void gf_update_rows1(u64 parity_addr, long long shard_stride, int P,
                                           u64 products_addr, int xor_only, u64 rows_addr,
                                           long long m, long long num_rows, u64 delta_addr,
                                           long long row_bytes) {
    const u32* products = reinterpret_cast<const u32*>(products_addr);
    const long long* rows = reinterpret_cast<const long long*>(rows_addr);
    const u8* delta = reinterpret_cast<const u8*>(delta_addr);
    const long long total = m * row_bytes;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += stride) {
        const long long t = idx / row_bytes;
        const long long row = rows[t];
        const u32 d = delta[idx];
        if (row < 0 || row >= num_rows || d == 0) continue;
        u32 planes[8];
        bit_planes(d, planes);
        const u64 byte_addr = parity_addr + row * row_bytes + (idx - t * row_bytes);
        for (int p = 0; p < P; ++p) {
            u32 prod = d;
            if (!xor_only) {
                u32 cb[8];
                load_products(products + p * 8, cb);
                prod = mul_planes(planes, cb);
            }
            const u64 addr = byte_addr + p * shard_stride;
            atomicXor(reinterpret_cast<u32*>(addr & ~3ull), prod << (8 * (addr & 3)));
        }
    }
}
"""

# (src, k, dst, G, products, xor_only, accumulate, offset, units)
_MATMUL_PARAMS = (np.uint64, np.int32, np.uint64, np.int32, np.uint64, np.int32, np.int32, np.int64, np.int64)
# (parity, shard_stride, P, products, xor_only, rows, m, num_rows, delta, row_bytes)
_ROWS_PARAMS = (np.uint64, np.int64, np.int32, np.uint64, np.int32, np.uint64, np.int64, np.int64, np.uint64, np.int64)

KERNELS: dict[str, tuple[type[np.generic], ...]] = {
    "gf_matmul16": _MATMUL_PARAMS,
    "gf_matmul1": _MATMUL_PARAMS,
    "gf_update_rows4": _ROWS_PARAMS,
    "gf_update_rows1": _ROWS_PARAMS,
}
"""Kernel name -> parameter types, in order (addresses are passed as u64)."""

_THREADS = 256


@functools.cache
def available() -> bool:
    """Whether the CUDA kernels can run: torch sees a GPU and CuPy imports and sees one too."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.cuda.is_available())


@functools.cache
def _functions(device_index: int) -> dict:
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=SOURCE)
        return {name: module.get_function(name) for name in KERNELS}


@functools.cache
def _max_blocks(device_index: int) -> int:
    return 16 * torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch(device: torch.device, name: str, work_items: int, *args: int) -> None:
    """Run kernel ``name`` on ``work_items`` items (grid-stride) on torch's current stream."""
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    blocks = max(1, min((work_items + _THREADS - 1) // _THREADS, _max_blocks(index)))
    typed = tuple(kind(value) for kind, value in zip(KERNELS[name], args, strict=True))
    stream = torch.cuda.current_stream(index).cuda_stream
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream, index):
        _functions(index)[name]((blocks,), (_THREADS,), typed)


def _products(coefs: np.ndarray) -> np.ndarray:
    """u32 [..., 8] of ``c * 2**b``, as bytes (1-D), for the kernels' ``products`` arrays."""
    return gf256.bit_products(coefs).astype(np.uint32).ravel().view(np.uint8)


def _upload(array: np.ndarray, device: torch.device, wait: bool = False) -> Tensor:
    """Copy a small host array to ``device``, ordered on the current stream.

    With ``wait``, also wait for the copy to land, so any stream may use the result.
    """
    uploaded = torch.from_numpy(array).pin_memory().to(device, non_blocking=True)
    if wait:
        torch.cuda.current_stream(device).synchronize()
    return uploaded


@functools.lru_cache(maxsize=1024)
def _cached_products(coefs: bytes, device: torch.device) -> Tensor:
    # Cached tensors may be used from any stream later, hence wait=True (once per coefficients).
    return _upload(_products(np.frombuffer(coefs, dtype=np.uint8)), device, wait=True)


def matmul(dst: Sequence[Tensor], src: Sequence[Tensor], coefs: np.ndarray, accumulate: bool) -> None:
    """``dst[j] = (dst[j] if accumulate else 0) ^ XOR_i coefs[j, i] * src[i]``.

    Args:
        dst: r uint8 contiguous CUDA tensors of n bytes each (any shape), written in place.
        src: k uint8 contiguous CUDA tensors of n bytes each, not overlapping ``dst``.
        coefs: uint8 [r, k].
        accumulate: fold into the current ``dst`` instead of overwriting it.
    """
    n = dst[0].numel()
    if n == 0:
        return
    device = dst[0].device
    r, k = coefs.shape
    xor_only = r == 1 and bool((coefs == 1).all())
    addresses = [s.data_ptr() for s in src] + [d.data_ptr() for d in dst]
    # One upload per call: src addresses, dst addresses, padding to 16 bytes, products.
    header = np.array(addresses + [0] * (len(addresses) % 2), dtype=np.uint64)
    table = _upload(np.concatenate([header.view(np.uint8), _products(coefs)]), device)
    src_addr = table.data_ptr()
    dst_addr = src_addr + 8 * k
    products_addr = src_addr + header.nbytes
    body = n // 16 if all(a % 16 == 0 for a in addresses) else 0
    tail = n - 16 * body
    for g0 in range(0, r, GROUP):
        group = min(GROUP, r - g0)
        args = (src_addr, k, dst_addr + 8 * g0, group, products_addr + 32 * k * g0, xor_only, accumulate)
        if body:
            _launch(device, "gf_matmul16", body, *args, 0, body)
        if tail:
            _launch(device, "gf_matmul1", tail, *args, 16 * body, tail)


def update_rows(parity: Tensor, coefs: np.ndarray, rows: Tensor, delta: Tensor, check: bool) -> None:
    """``parity[p, rows[t]] ^= coefs[p] * delta[t]`` for every p and t.

    Args:
        parity: uint8 [P, num_rows, row_bytes] contiguous CUDA tensor, updated in place.
        coefs: uint8 [P].
        rows: int64 [m] contiguous; may repeat (each delta is applied).
        delta: uint8 [m, row_bytes] contiguous.
        check: raise ValueError, changing nothing, if a row is out of range; this reads a
            min/max back to the host (a synchronisation). Unchecked rows out of range are skipped.
    """
    m = rows.numel()
    if m == 0:
        return
    num_rows, row_bytes = parity.shape[1], parity.shape[2]
    if check:
        check_rows(rows, num_rows, row_bytes)
    shard_stride = num_rows * row_bytes
    products = _cached_products(np.ascontiguousarray(coefs, dtype=np.uint8).tobytes(), parity.device)
    xor_only = bool((coefs == 1).all())
    words = row_bytes % 4 == 0 and parity.data_ptr() % 4 == 0 and delta.data_ptr() % 4 == 0
    name, items_per_row = ("gf_update_rows4", row_bytes // 4) if words else ("gf_update_rows1", row_bytes)
    _launch(
        parity.device, name, m * items_per_row,
        parity.data_ptr(), shard_stride, len(coefs), products.data_ptr(), xor_only,
        rows.data_ptr(), m, num_rows, delta.data_ptr(), row_bytes,
    )
