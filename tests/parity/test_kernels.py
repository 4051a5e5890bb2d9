"""CPU kernels, every instruction set this machine runs, against gf256 (itself checked against reedsolo)."""

import importlib
import os
import sys

import numpy as np
import pytest
import torch

from lightning_dlrover.parity import cpu, gf256

ISAS = cpu.available_isas()


@pytest.fixture(params=ISAS)
def isa(request):
    previous = cpu.set_isa(request.param)
    yield request.param
    cpu.set_isa(previous)


def unaligned(rng: np.random.Generator, count: int, n: int, offset: int) -> list[torch.Tensor]:
    """``count`` buffers of n random bytes, each starting ``offset`` bytes into its allocation."""
    return [torch.from_numpy(rng.integers(0, 256, n + offset, dtype=np.uint8))[offset:] for _ in range(count)]


def stacked(buffers: list[torch.Tensor]) -> np.ndarray:
    return np.stack([b.numpy() for b in buffers])


def random_coefficients(rng: np.random.Generator, r: int, k: int) -> np.ndarray:
    coefs = rng.integers(0, 256, (r, k), dtype=np.uint8)
    coefs.flat[::3] = 1  # the c == 1 and c == 0 shortcuts
    coefs.flat[1::5] = 0
    return coefs


@pytest.mark.parametrize("r, k", [(1, 1), (1, 5), (2, 4), (3, 3), (4, 17), (5, 2), (9, 3)])
@pytest.mark.parametrize("n", [0, 1, 31, 64, 65, 1000, 4099])
@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_matches_reference(isa, r, k, n, accumulate):
    rng = np.random.default_rng(r * 1000 + k * 10 + n)
    offset = n % 7
    src = unaligned(rng, k, n, offset)
    dst = unaligned(rng, r, n, (offset + 3) % 8)
    coefs = random_coefficients(rng, r, k)
    expected = gf256.matmul(coefs, stacked(src)) ^ (stacked(dst) if accumulate else 0)
    cpu.matmul(dst, src, coefs, accumulate)
    np.testing.assert_array_equal(stacked(dst), expected)


@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_xor_only(isa, accumulate):
    rng = np.random.default_rng(7)
    src = unaligned(rng, 6, 5000, 5)
    dst = unaligned(rng, 1, 5000, 1)
    expected = np.bitwise_xor.reduce(stacked(src), axis=0) ^ (dst[0].numpy() if accumulate else 0)
    cpu.matmul(dst, src, np.ones((1, 6), dtype=np.uint8), accumulate)
    np.testing.assert_array_equal(dst[0].numpy(), expected)


def test_matmul_in_column_blocks(isa):
    # More than 4 outputs: several passes over column blocks sized to stay in L2.
    rng = np.random.default_rng(3)
    r, k, n = 7, 3, 200_003
    src = unaligned(rng, k, n, 0)
    dst = unaligned(rng, r, n, 0)
    coefs = random_coefficients(rng, r, k)
    cpu.matmul(dst, src, coefs, False)
    np.testing.assert_array_equal(stacked(dst), gf256.matmul(coefs, stacked(src)))


@pytest.mark.parametrize("P", [1, 2, 5])
@pytest.mark.parametrize("row_bytes", [1, 7, 32, 64, 100, 128, 130])
def test_update_rows_matches_reference(isa, P, row_bytes):
    rng = np.random.default_rng(P * 1000 + row_bytes)
    num_rows, m = 50, 300  # m > num_rows: rows repeat
    offset = row_bytes % 5
    flat = torch.from_numpy(rng.integers(0, 256, P * num_rows * row_bytes + offset, dtype=np.uint8))
    parity = flat[offset:].view(P, num_rows, row_bytes)
    rows = torch.from_numpy(rng.integers(0, num_rows, m))
    delta = torch.from_numpy(rng.integers(0, 256, (m, row_bytes), dtype=np.uint8))
    for coefs in (rng.integers(0, 256, P, dtype=np.uint8), np.ones(P, dtype=np.uint8)):
        expected = parity.numpy().copy()
        for p in range(P):
            np.bitwise_xor.at(expected[p], rows.numpy(), gf256.MUL_TABLE[coefs[p], delta.numpy()])
        cpu.update_rows(parity, coefs, rows, delta, True)
        np.testing.assert_array_equal(parity.numpy(), expected)


def test_update_rows_rejects_rows_out_of_range(isa):
    parity = torch.zeros(2, 10, 8, dtype=torch.uint8)
    delta = torch.ones(2, 8, dtype=torch.uint8)
    coefs = np.array([1, 2], dtype=np.uint8)
    with pytest.raises(ValueError, match="rows\\[1\\] = 10 is out of range: the parity has 10 rows of 8 bytes"):
        cpu.update_rows(parity, coefs, torch.tensor([0, 10]), delta, True)
    assert not parity.any()


def test_set_isa_rejects_unknown():
    with pytest.raises(ValueError, match="instruction set 'sse9' is not available here; choose one of"):
        cpu.set_isa("sse9")


def test_default_isa_is_fastest_available():
    if os.environ.get(cpu.ISA_ENV):
        pytest.skip(f"{cpu.ISA_ENV} chooses the instruction set")
    assert cpu.isa() == ISAS[-1]


def test_isa_environment_variable(monkeypatch):
    # The variable is read when the module is imported: re-execute it in place.
    previous = cpu.isa()
    try:
        monkeypatch.setenv(cpu.ISA_ENV, ISAS[0])
        importlib.reload(cpu)
        assert cpu.isa() == ISAS[0]
        monkeypatch.setenv(cpu.ISA_ENV, "sse9")
        with pytest.raises(ValueError, match="LIGHTNING_DLROVER_GF_ISA='sse9': instruction set 'sse9' is not"):
            importlib.reload(cpu)
    finally:
        monkeypatch.undo()
        importlib.reload(cpu)
        cpu.set_isa(previous)


def test_missing_extension_falls_back_to_portable_with_a_warning(monkeypatch):
    previous = cpu.isa()
    try:
        # `from . import _gf256` then fails as if the extension had never been built.
        monkeypatch.delattr(sys.modules["lightning_dlrover.parity"], "_gf256")
        monkeypatch.setitem(sys.modules, "lightning_dlrover.parity._gf256", None)
        with pytest.warns(RuntimeWarning, match="C extension _gf256 is not built.*slow torch kernels"):
            importlib.reload(cpu)
        assert cpu.available_isas() == ("portable",) and cpu.isa() == "portable"
        rng = np.random.default_rng(0)
        src, dst = unaligned(rng, 2, 100, 0), unaligned(rng, 1, 100, 0)
        coefs = np.array([[3, 200]], dtype=np.uint8)
        cpu.matmul(dst, src, coefs, False)
        np.testing.assert_array_equal(stacked(dst), gf256.matmul(coefs, stacked(src)))
    finally:
        monkeypatch.undo()
        importlib.reload(cpu)
        cpu.set_isa(previous)


@pytest.mark.skipif(not hasattr(cpu._gf256, "gather_xor"), reason="the C extension is not built with gather_xor")
@pytest.mark.parametrize("row_bytes", [4, 13, 256])
def test_gather_xor_equals_index_select_xor(row_bytes):
    rng = np.random.default_rng(row_bytes)
    table = torch.from_numpy(rng.integers(0, 256, (500, row_bytes), dtype=np.uint8))
    rows = torch.from_numpy(np.sort(rng.choice(500, 77, replace=False))).to(torch.int64)
    old = torch.from_numpy(rng.integers(0, 256, (77, row_bytes), dtype=np.uint8))
    out = torch.empty(77, row_bytes, dtype=torch.uint8)
    cpu.gather_xor_raw(out.data_ptr(), table.data_ptr(), 500, rows.data_ptr(), 77, old.data_ptr(), row_bytes)
    assert torch.equal(out, table.index_select(0, rows) ^ old)
    bad = rows.clone()
    bad[5] = 500
    before = out.clone()
    with pytest.raises(ValueError, match="out of range"):
        cpu.gather_xor_raw(out.data_ptr(), table.data_ptr(), 500, bad.data_ptr(), 77, old.data_ptr(), row_bytes)
    assert torch.equal(out, before)
