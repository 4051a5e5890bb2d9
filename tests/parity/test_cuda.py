"""CUDA kernels: on a GPU against the CPU kernels; without one, the same CUDA source emulated on the host.

The emulation compiles ``cuda.SOURCE`` as C++ with a few lines standing in for the CUDA built-ins
(thread indices, ``uint4``, ``atomicXor``) and runs every thread of a launch in turn, so the
kernels' indexing, tails, alignment paths and the host code of :mod:`.cuda` (address tables,
output groups) are checked on machines without a GPU. What it cannot check is concurrency:
threads run one after another, so ``atomicXor`` is trivially atomic there.
"""

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from lightning_dlrover.parity import ReedSolomonCode, as_bytes, cuda, gf256
from tests.gpu import requires_gpu


def random_bytes(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


# ------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("k, r", [(4, 1), (4, 2), (3, 5), (10, 4)])
@pytest.mark.parametrize("n, offset", [(1 << 20, 0), (1000, 0), (4099, 3)])
def test_gpu_matches_cpu(k, r, n, offset):
    code = ReedSolomonCode(k, r)
    host = random_bytes(k, n + offset)[:, offset:]
    data_cpu = host.contiguous()
    data_gpu = torch.empty(k * (n + offset) + offset, dtype=torch.uint8, device="cuda")
    data_gpu = data_gpu[offset : offset + k * n].view(k, n)  # unaligned when offset > 0
    data_gpu.copy_(data_cpu)

    parity_cpu = code.encode(data_cpu)
    parity_gpu = code.encode(data_gpu)
    assert parity_gpu.device.type == "cuda"
    assert torch.equal(parity_gpu.cpu(), parity_cpu)

    delta = random_bytes(n, seed=1)
    code.update(parity_cpu, k - 1, delta)
    code.update(parity_gpu, k - 1, delta.cuda())
    assert torch.equal(parity_gpu.cpu(), parity_cpu)

    lost = list(range(min(r, k)))
    shards_cpu = {s: t for s, t in enumerate(list(data_cpu) + list(parity_cpu)) if s not in lost}
    shards_gpu = {s: t for s, t in enumerate(list(data_gpu) + list(parity_gpu)) if s not in lost}
    assert torch.equal(code.reconstruct(shards_gpu, lost).cpu(), code.reconstruct(shards_cpu, lost))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("r", [1, 2, 3])
@pytest.mark.parametrize("row_bytes", [128, 512, 6])
def test_gpu_update_rows_matches_cpu(r, row_bytes):
    code = ReedSolomonCode(4, r)
    num_rows, m = 1000, 5000  # rows repeat: atomics must apply every delta
    parity_cpu = random_bytes(r, num_rows, row_bytes)
    parity_gpu = parity_cpu.cuda()
    rows = torch.randint(0, num_rows, (m,), generator=torch.Generator().manual_seed(2))
    delta = random_bytes(m, row_bytes, seed=3)
    code.update_rows(parity_cpu, 2, rows, delta)
    code.update_rows(parity_gpu, 2, rows.cuda(), delta.cuda())
    assert torch.equal(parity_gpu.cpu(), parity_cpu)


@pytest.mark.gpu
@requires_gpu
def test_gpu_float_rows_on_side_stream():
    code = ReedSolomonCode(2, 2)
    table = torch.randn(2, 4096, 32, device="cuda")
    table[0, 0, :2] = torch.tensor([-0.0, float("nan")])
    parity = code.encode(list(as_bytes(table)))
    rows = torch.tensor([0, 7, 4095], device="cuda")
    new_rows = torch.randn(3, 32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        code.update_rows(parity, 1, rows, as_bytes(table[1, rows]) ^ as_bytes(new_rows))
        table[1, rows] = new_rows
        decoded = code.decode({0: as_bytes(table[0]), 2: parity[0]})
    stream.synchronize()
    assert torch.equal(decoded[1], as_bytes(table[1]))


@pytest.mark.gpu
@requires_gpu
def test_gpu_unchecked_rows_out_of_range_are_skipped():
    code = ReedSolomonCode(3, 2)
    parity = torch.zeros(2, 10, 16, dtype=torch.uint8, device="cuda")
    delta = torch.ones(2, 16, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="rows\\[1\\] = 10 is out of range"):
        code.update_rows(parity, 0, torch.tensor([3, 10], device="cuda"), delta)
    assert not parity.any()
    code.update_rows(parity, 0, torch.tensor([3, 10], device="cuda"), delta, check_rows=False)
    assert parity[:, 3].all() and parity.sum() == parity[:, 3].sum()


# ------------------------------------------------------------------------- emulated on the host

_SHIM = r"""
struct uint4 { unsigned int x, y, z, w; };
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
    uint4 v = {x, y, z, w};
    return v;
}
struct Dim3 { unsigned int x; };
static Dim3 threadIdx, blockIdx, blockDim, gridDim;
inline unsigned int atomicXor(unsigned int* address, unsigned int value) {
    const unsigned int old = *address;
    *address = old ^ value;
    return old;
}
#define __global__
#define __device__
#define __forceinline__ inline
"""

_C_TYPES = {np.uint64: ("unsigned long long", ctypes.c_ulonglong), np.int32: ("int", ctypes.c_int),
            np.int64: ("long long", ctypes.c_longlong)}
_EMULATED_THREADS = 32


def _launcher(name: str, types: tuple) -> str:
    params = ", ".join(f"{_C_TYPES[t][0]} a{i}" for i, t in enumerate(types))
    args = ", ".join(f"a{i}" for i in range(len(types)))
    return f"""
extern "C" void launch_{name}(unsigned int grid, unsigned int block, {params}) {{
    gridDim.x = grid;
    blockDim.x = block;
    for (blockIdx.x = 0; blockIdx.x < grid; ++blockIdx.x)
        for (threadIdx.x = 0; threadIdx.x < block; ++threadIdx.x) {name}({args});
}}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler (g++ or clang++) to emulate the CUDA kernels")
    source = tmp_path_factory.mktemp("cuda") / "emulated.cpp"
    source.write_text(_SHIM + cuda.SOURCE + "".join(_launcher(n, t) for n, t in cuda.KERNELS.items()))
    library = source.with_suffix(".so")
    subprocess.run(
        [compiler, "-std=c++14", "-O1", "-shared", "-fPIC", "-Wno-unknown-pragmas", str(source), "-o", str(library)],
        check=True,
    )
    lib = ctypes.CDLL(str(library))
    for name, types in cuda.KERNELS.items():
        getattr(lib, f"launch_{name}").argtypes = [ctypes.c_uint, ctypes.c_uint] + [_C_TYPES[t][1] for t in types]
    return lib


@pytest.fixture
def emulated(emulator, monkeypatch):
    """Route cuda.matmul / cuda.update_rows to the emulated kernels, on CPU tensors."""

    def launch(device, name, work_items, *args):
        # A small grid, so that every thread loops over several items (grid-stride).
        blocks = max(1, min(3, -(-work_items // _EMULATED_THREADS)))
        getattr(emulator, f"launch_{name}")(blocks, _EMULATED_THREADS, *args)

    monkeypatch.setattr(cuda, "_launch", launch)
    monkeypatch.setattr(cuda, "_upload", lambda array, device, wait=False: torch.from_numpy(array.copy()))
    cuda._cached_products.cache_clear()
    yield
    cuda._cached_products.cache_clear()


def stacked(buffers: list[torch.Tensor]) -> np.ndarray:
    return np.stack([b.numpy() for b in buffers])


def _buffers(count: int, n: int, offset: int, seed: int) -> list[torch.Tensor]:
    """``count`` random n-byte buffers starting ``offset`` bytes past a 64-byte boundary."""
    out = []
    for s in range(count):
        raw = random_bytes(n + offset + 64, seed=seed + s)
        start = (-raw.data_ptr()) % 64 + offset
        out.append(raw[start : start + n])
    return out


@pytest.mark.parametrize("r, k", [(1, 3), (2, 4), (5, 2), (9, 3)])
@pytest.mark.parametrize("n, offset", [(1000, 0), (4099, 0), (333, 5)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_emulated_matmul(emulated, r, k, n, offset, accumulate):
    rng = np.random.default_rng(r * 100 + k + n)
    src = _buffers(k, n, offset, seed=1)
    dst = _buffers(r, n, offset, seed=100)
    for coefs in (rng.integers(0, 256, (r, k), dtype=np.uint8), np.ones((r, k), dtype=np.uint8)):
        expected = gf256.matmul(coefs, stacked(src)) ^ (stacked(dst) if accumulate else 0)
        cuda.matmul(dst, src, coefs, accumulate)
        np.testing.assert_array_equal(stacked(dst), expected)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("row_bytes, offset", [(128, 0), (64, 4), (6, 0), (130, 1)])
def test_emulated_update_rows(emulated, P, row_bytes, offset):
    rng = np.random.default_rng(P * 1000 + row_bytes)
    num_rows, m = 40, 120  # rows repeat
    parity = _buffers(1, P * num_rows * row_bytes, offset, seed=5)[0].view(P, num_rows, row_bytes)
    delta = _buffers(1, m * row_bytes, offset, seed=6)[0].view(m, row_bytes)
    rows = torch.from_numpy(rng.integers(0, num_rows, m))
    for coefs in (rng.integers(0, 256, P, dtype=np.uint8), np.ones(P, dtype=np.uint8)):
        expected = parity.numpy().copy()
        for p in range(P):
            np.bitwise_xor.at(expected[p], rows.numpy(), gf256.MUL_TABLE[coefs[p], delta.numpy()])
        cuda.update_rows(parity, coefs, rows, delta, True)
        np.testing.assert_array_equal(parity.numpy(), expected)


def test_emulated_unchecked_rows_out_of_range_are_skipped(emulated):
    parity = torch.zeros(2, 10, 8, dtype=torch.uint8)
    delta = torch.ones(3, 8, dtype=torch.uint8)
    rows = torch.tensor([3, 10, -1])
    coefs = np.array([1, 2], dtype=np.uint8)
    with pytest.raises(ValueError, match="rows\\[1\\] = 10 is out of range"):
        cuda.update_rows(parity, coefs, rows, delta, True)
    cuda.update_rows(parity, coefs, rows, delta, False)
    assert (parity[0, 3] == 1).all() and (parity[1, 3] == 2).all()
    assert parity.sum() == 8 * 3


def test_cuda_source_compiles_for_hopper(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    source = tmp_path / "kernels.cu"
    source.write_text(cuda.SOURCE)
    result = subprocess.run(
        [nvcc, "--ptx", "-arch=sm_90", str(source), "-o", str(tmp_path / "kernels.ptx")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    ptx = (tmp_path / "kernels.ptx").read_text()
    for name in cuda.KERNELS:
        assert f".entry {name}(" in ptx
