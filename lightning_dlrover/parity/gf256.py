"""Arithmetic in GF(2^8), the field every parity byte lives in.

Elements are bytes. Addition is XOR. Multiplication is polynomial multiplication modulo the
primitive polynomial x^8 + x^4 + x^3 + x^2 + 1 (``0x11d``, also ``reedsolo``'s default), so
``2`` generates the multiplicative group and ``EXP``/``LOG`` tables exist. This module is the
single source of the field: the C kernels receive :data:`MUL_TABLE` at import and derive their
split-nibble tables and GFNI bit matrices from it; the CUDA and portable torch kernels use
:func:`bit_products`.

Matrices are ``numpy.uint8`` arrays; :func:`matmul` and :func:`inverse` are the linear algebra
the code needs (coefficients, decode matrices), vectorised over rows so that k = 255 stays fast.
"""

from __future__ import annotations

import numpy as np

PRIMITIVE_POLYNOMIAL = 0x11D
GENERATOR = 2


def _exp_log_tables() -> tuple[np.ndarray, np.ndarray]:
    exp = np.zeros(512, dtype=np.uint8)
    log = np.zeros(256, dtype=np.int64)
    x = 1
    for power in range(255):
        exp[power] = x
        log[x] = power
        x <<= 1
        if x & 0x100:
            x ^= PRIMITIVE_POLYNOMIAL
    # exp repeats with period 255; the second copy lets mul() skip a modulo.
    exp[255:510] = exp[:255]
    return exp, log


EXP, LOG = _exp_log_tables()
"""``EXP[p] = 2**p`` for p in [0, 510) and ``LOG[x]`` for x in [1, 256); ``LOG[0]`` is unused."""


def _mul_table() -> np.ndarray:
    a = np.arange(256)
    table = EXP[LOG[a][:, None] + LOG[a][None, :]]
    table[0, :] = 0
    table[:, 0] = 0
    return table


MUL_TABLE: np.ndarray = _mul_table()
"""uint8 [256, 256]: ``MUL_TABLE[a, b] = a * b``."""

INVERSE: np.ndarray = np.concatenate(([0], EXP[255 - LOG[1:]])).astype(np.uint8)
"""uint8 [256]: ``INVERSE[a] = 1 / a`` for a != 0; ``INVERSE[0]`` is 0 and means nothing."""


def mul(a: int, b: int) -> int:
    """``a * b`` for bytes a, b."""
    return int(MUL_TABLE[a, b])


def inverse(a: int) -> int:
    """``1 / a`` for a byte a != 0; raises ZeroDivisionError for 0."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return int(INVERSE[a])


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Matrix product over GF(2^8): uint8 [m, n] @ uint8 [n, p] -> uint8 [m, p]."""
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply matrices of shapes {a.shape} and {b.shape}")
    if a.shape[1] == 0:
        return np.zeros((a.shape[0], b.shape[1]), dtype=np.uint8)
    return np.bitwise_xor.reduce(MUL_TABLE[a[:, :, None], b[None, :, :]], axis=1)


def inverse_matrix(a: np.ndarray) -> np.ndarray:
    """Inverse of a square uint8 [n, n] matrix over GF(2^8), by Gauss-Jordan elimination.

    Raises ValueError if ``a`` is singular.
    """
    n = a.shape[0]
    if a.shape != (n, n):
        raise ValueError(f"expected a square matrix, got shape {a.shape}")
    work = np.concatenate([a.astype(np.uint8), np.eye(n, dtype=np.uint8)], axis=1)
    for col in range(n):
        nonzero = np.flatnonzero(work[col:, col])
        if nonzero.size == 0:
            raise ValueError("matrix is singular over GF(2^8)")
        pivot = col + nonzero[0]
        if pivot != col:
            work[[col, pivot]] = work[[pivot, col]]
        work[col] = MUL_TABLE[INVERSE[work[col, col]], work[col]]
        factors = work[:, col].copy()
        factors[col] = 0
        work ^= MUL_TABLE[factors[:, None], work[col][None, :]]
    return work[:, n:].copy()


def cauchy_matrix(r: int, k: int) -> np.ndarray:
    """Parity coefficients of the systematic MDS code: uint8 [r, k].

    Built from the Cauchy matrix ``1 / (x_j + y_i)`` with ``x_j = j`` (j < r) and
    ``y_i = r + i`` (i < k); these k + r points are distinct bytes as long as k + r <= 256, so
    every square submatrix is invertible, which makes ``[I_k; C]`` MDS: any k of its k + r rows
    are invertible. Each column is then divided by its first entry. Scaling a column by a nonzero
    constant keeps every square submatrix invertible, and it makes the first parity row all ones:
    parity 0 is the XOR of the data shards, and with r == 1 the whole code is plain XOR.
    """
    if r < 1 or k < 1 or k + r > 256:
        raise ValueError(f"need k >= 1, r >= 1 and k + r <= 256, got k={k}, r={r}")
    x = np.arange(r)[:, None]
    y = np.arange(r, r + k)[None, :]
    cauchy = INVERSE[x ^ y]
    # Column i divided by its first entry 1 / (0 ^ y_i), i.e. multiplied by y_i.
    return MUL_TABLE[cauchy, np.broadcast_to(y, cauchy.shape)]


def bit_products(coefficients: np.ndarray) -> np.ndarray:
    """``c * 2**b`` for every coefficient c and bit b: uint8 [..., 8] for uint8 [...] input.

    Bit-sliced kernels use it: ``c * x = XOR over b of bit_b(x) * (c * 2**b)``, where each
    ``bit_b(x) * (c * 2**b)`` is an ordinary integer product of a 0/1 byte and a byte (no carry),
    so a whole word of bytes is multiplied without table lookups.
    """
    return MUL_TABLE[np.asarray(coefficients, dtype=np.uint8)[..., None], 1 << np.arange(8)]
