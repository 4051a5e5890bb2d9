"""Erasure coding of tensors' bytes: XOR (r = 1) and Reed-Solomon over GF(2^8) (r >= 2).

:class:`ReedSolomonCode` encodes k data shards into r parity shards, keeps parity current under
dense or row-sparse updates, and recovers any r lost shards bit-exactly. :func:`as_bytes` views
float32/bfloat16/float16 (or any) contiguous tensors as bytes without copying.

Modules: :mod:`.gf256` (the field), :mod:`.codes` (the code), :mod:`.cpu` (C kernels and their
instruction-set selection), :mod:`.cuda` (CuPy kernels), :mod:`.portable` (torch fallback), :mod:`.dispatch`
(which of them serves a device).
"""

from .codes import ReedSolomonCode, as_bytes

__all__ = ["ReedSolomonCode", "as_bytes"]
