"""ReedSolomonCode on CPU: against a reedsolo oracle, erasure patterns, updates, float views, errors."""

import itertools

import numpy as np
import pytest
import reedsolo
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dlrover.parity import ReedSolomonCode, as_bytes

PROPERTY = settings(max_examples=150, deadline=None, database=None)


def random_bytes(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def shards_of(data: torch.Tensor, parity: torch.Tensor, lost: set[int]) -> dict[int, torch.Tensor]:
    everything = list(data) + list(parity)
    return {s: t for s, t in enumerate(everything) if s not in lost}


@pytest.mark.parametrize("k, r", [(3, 1), (3, 3), (5, 2)])
def test_encode_matches_reedsolo_oracle(k, r):
    reedsolo.init_tables(prim=0x11D)
    data = random_bytes(k, 37)
    # The oracle builds the coefficients from reedsolo arithmetic too: the Cauchy entry
    # 1 / (j ^ y_i) scaled by y_i = r + i (see gf256.cauchy_matrix).
    coefficients = [
        [reedsolo.gf_mul(reedsolo.gf_inverse(j ^ (r + i)), r + i) for i in range(k)] for j in range(r)
    ]
    expected = torch.zeros(r, 37, dtype=torch.uint8)
    for j, i, b in itertools.product(range(r), range(k), range(37)):
        expected[j, b] ^= reedsolo.gf_mul(coefficients[j][i], int(data[i, b]))
    code = ReedSolomonCode(k, r)
    assert code.coefficients.tolist() == coefficients
    assert torch.equal(code.encode(data), expected)


def test_r1_is_xor():
    data = random_bytes(5, 100)
    code = ReedSolomonCode(5, 1)
    assert (code.coefficients == 1).all()
    expected = data[0] ^ data[1] ^ data[2] ^ data[3] ^ data[4]
    assert torch.equal(code.encode(data)[0], expected)


@pytest.mark.parametrize("k, r", [(4, 2), (3, 3), (1, 2), (2, 1)])
def test_every_erasure_pattern_decodes(k, r):
    code = ReedSolomonCode(k, r)
    data = random_bytes(k, 2, 33)  # shards may have any shape
    parity = code.encode(data)
    everything = torch.cat([data, parity])
    for size in range(r + 1):
        for lost in itertools.combinations(range(k + r), size):
            shards = shards_of(data, parity, set(lost))
            assert torch.equal(code.decode(shards), data)
            if lost:
                assert torch.equal(code.reconstruct(shards, lost), everything[list(lost)])


@st.composite
def code_and_erasures(draw, max_shards=20):
    k = draw(st.integers(1, max_shards - 1))
    r = draw(st.integers(1, max_shards - k))
    lost = draw(st.sets(st.integers(0, k + r - 1), max_size=r))
    n = draw(st.integers(0, 300))
    seed = draw(st.integers(0, 2**16))
    return k, r, sorted(lost), n, seed


@PROPERTY
@given(code_and_erasures())
def test_any_r_erasures_decode_bit_exact(case):
    k, r, lost, n, seed = case
    code = ReedSolomonCode(k, r)
    data = random_bytes(k, n, seed=seed)
    parity = code.encode(data)
    shards = shards_of(data, parity, set(lost))
    assert torch.equal(code.decode(shards), data)
    wanted = lost or [0]
    assert torch.equal(code.reconstruct(shards, wanted), torch.cat([data, parity])[wanted])


@PROPERTY
@given(code_and_erasures(), st.lists(st.integers(0, 255), min_size=1, max_size=5))
def test_updates_then_decode_equal_reencode(case, shard_choices):
    k, r, lost, n, seed = case
    code = ReedSolomonCode(k, r)
    data = random_bytes(k, n, seed=seed)
    parity = code.encode(data)
    for step, choice in enumerate(shard_choices):
        i = choice % k
        new = random_bytes(n, seed=seed + step + 1)
        code.update(parity, i, data[i] ^ new)
        data[i] = new
    assert torch.equal(parity, code.encode(data))
    assert torch.equal(code.decode(shards_of(data, parity, set(lost))), data)


@PROPERTY
@given(
    code_and_erasures(max_shards=10),
    st.integers(1, 70),
    st.integers(1, 40),
    st.integers(0, 60),
)
def test_update_rows_then_decode_equal_reencode(case, row_bytes, num_rows, m):
    k, r, lost, _, seed = case
    code = ReedSolomonCode(k, r)
    data = random_bytes(k, num_rows, row_bytes, seed=seed)
    parity = code.encode(data).view(r, -1)  # the parity may be kept flat
    generator = torch.Generator().manual_seed(seed)
    i = seed % k
    rows = torch.randint(0, num_rows, (m,), generator=generator)  # repeats included
    delta = random_bytes(m, row_bytes, seed=seed + 1)
    code.update_rows(parity, i, rows, delta)
    for t in range(m):
        data[i, rows[t]] ^= delta[t]
    assert torch.equal(parity, code.encode(data).view(r, -1))
    shards = shards_of(data, parity.view(r, num_rows, row_bytes), set(lost))
    assert torch.equal(code.decode(shards), data)


def test_parity_ids_select_parity_shards():
    code = ReedSolomonCode(4, 3)
    data = random_bytes(4, 64)
    full = code.encode(data)
    mine = code.encode(list(data), parity_ids=[6, 4])
    assert torch.equal(mine, full[[2, 0]])
    delta = random_bytes(64, seed=1)
    one = full[1].clone().unsqueeze(0)
    code.update(one, 2, delta, parity_ids=[5])
    code.update(full, 2, delta)
    assert torch.equal(one[0], full[1])
    rows = torch.tensor([3, 0, 3])
    delta_rows = random_bytes(3, 16, seed=2)
    code.update_rows(one, 1, rows, delta_rows, parity_ids=[5])
    code.update_rows(full, 1, rows, delta_rows)
    assert torch.equal(one[0], full[1])


def test_incremental_encode_from_zero_parity():
    code = ReedSolomonCode(3, 2)
    data = random_bytes(3, 200)
    parity = torch.zeros(2, 200, dtype=torch.uint8)
    for i in range(3):
        code.update(parity, i, data[i])
    assert torch.equal(parity, code.encode(data))


def test_out_arguments_are_written():
    code = ReedSolomonCode(3, 2)
    data = random_bytes(3, 50)
    out = torch.empty(2, 50, dtype=torch.uint8)
    assert code.encode(data, out=out) is out
    lost = torch.empty(50, dtype=torch.uint8)
    code.reconstruct({1: data[1], 2: data[2], 3: out[0]}, [0], out=lost.unsqueeze(0))
    assert torch.equal(lost, data[0])


def test_near_256_shards():
    k, r = 250, 6
    code = ReedSolomonCode(k, r)
    data = random_bytes(k, 96)
    parity = code.encode(data)
    lost = {0, 7, 100, 249, 250, 255}
    assert torch.equal(code.decode(shards_of(data, parity, lost)), data)
    lost = {3, 17, 64, 128, 200, 222}
    assert torch.equal(code.decode(shards_of(data, parity, lost)), data)


def _float_rows(dtype: torch.dtype, seed: int) -> torch.Tensor:
    values = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)
    values[0, :3] = torch.tensor([-0.0, float("inf"), float("-inf")]).to(dtype)
    bits = as_bytes(values)
    # NaNs with payloads: all exponent bits set, distinct mantissas.
    nan_patterns = {
        torch.float32: [0x7FC00001, 0xFFBADBAD, 0x7F800123],
        torch.bfloat16: [0x7FC1, 0xFFAB, 0x7F81],
        torch.float16: [0x7E01, 0xFDAB, 0x7C11],
    }[dtype]
    size = values.element_size()
    for col, pattern in enumerate(nan_patterns):
        bits[1, col * size : (col + 1) * size] = torch.tensor(
            list(pattern.to_bytes(size, "little")), dtype=torch.uint8
        )
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_shards_round_trip_bit_exact(dtype):
    code = ReedSolomonCode(3, 2)
    tables = [_float_rows(dtype, seed) for seed in range(3)]
    originals = [as_bytes(t).clone() for t in tables]
    data = [as_bytes(t) for t in tables]
    parity = code.encode(data)
    # Change some rows of table 1 (NaN payload row included) and fold them in by rows.
    rows = torch.tensor([1, 4])
    new_rows = _float_rows(dtype, seed=9)[[1, 5]]
    code.update_rows(parity, 1, rows, as_bytes(tables[1][rows]) ^ as_bytes(new_rows))
    tables[1][rows] = new_rows
    assert not torch.equal(as_bytes(tables[1]), originals[1])
    decoded = code.decode({0: data[0], 3: parity[0], 4: parity[1]})
    for i in range(3):
        assert torch.equal(decoded[i], as_bytes(tables[i]))
        restored = decoded[i].view(dtype)
        assert torch.equal(as_bytes(restored), as_bytes(tables[i]))
    assert torch.signbit(decoded[0].view(dtype)[0, 0]) and decoded[0].view(dtype)[0, 0] == 0


def test_as_bytes_views_without_copy():
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    b = as_bytes(t)
    assert b.shape == (3, 16) and b.dtype == torch.uint8
    assert b.data_ptr() == t.data_ptr()
    b[0, :4] = torch.tensor([0, 0, 0x80, 0x3F], dtype=torch.uint8)  # 1.0f
    assert t[0, 0] == 1.0
    assert as_bytes(torch.tensor(1.5, dtype=torch.bfloat16)).shape == (2,)
    u = torch.zeros(5, dtype=torch.uint8)
    assert as_bytes(u) is u


# ------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "k, r, error, message",
    [
        (0, 2, ValueError, "k >= 1"),
        (4, 0, ValueError, "r >= 1"),
        (250, 7, ValueError, "k \\+ r = 257 shards exceed"),
        (4.0, 2, TypeError, "k must be an int"),
        (4, True, TypeError, "r must be an int"),
    ],
)
def test_bad_code_sizes(k, r, error, message):
    with pytest.raises(error, match=message):
        ReedSolomonCode(k, r)


@pytest.fixture
def code():
    return ReedSolomonCode(4, 2)


def test_encode_rejects_bad_data(code):
    with pytest.raises(TypeError, match="uint8 tensor, got torch.float32.*as_bytes"):
        code.encode(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="contiguous.*call .contiguous\\(\\)"):
        code.encode(torch.zeros(8, 4, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="must be \\[4, \\*S\\]"):
        code.encode(torch.zeros(3, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must hold 4 shards, got 2"):
        code.encode([torch.zeros(8, dtype=torch.uint8)] * 2)
    with pytest.raises(ValueError, match="data\\[2\\] has shape \\(9,\\), expected \\(8,\\)"):
        code.encode([torch.zeros(8, dtype=torch.uint8)] * 2 + [torch.zeros(9, dtype=torch.uint8)] * 2)
    with pytest.raises(TypeError, match="data\\[0\\] must be a torch.Tensor"):
        code.encode([np.zeros(8, dtype=np.uint8)] * 4)
    with pytest.raises(ValueError, match="out has shape \\(2, 7\\), expected \\(2, 8\\)"):
        code.encode(torch.zeros(4, 8, dtype=torch.uint8), out=torch.empty(2, 7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="parity_ids\\[0\\] = 3 is out of range \\[4, 6\\)"):
        code.encode(torch.zeros(4, 8, dtype=torch.uint8), parity_ids=[3])
    with pytest.raises(ValueError, match="without repeats"):
        code.encode(torch.zeros(4, 8, dtype=torch.uint8), parity_ids=[4, 4])


def test_decode_rejects_bad_shards(code):
    s = [torch.zeros(8, dtype=torch.uint8) for _ in range(6)]
    with pytest.raises(ValueError, match="need at least k = 4 shards to decode, got 3 \\(ids \\[0, 2, 5\\]\\)"):
        code.decode({0: s[0], 2: s[2], 5: s[5]})
    with pytest.raises(ValueError, match="shards\\[3\\] has shape \\(9,\\), expected \\(8,\\)"):
        code.decode({0: s[0], 1: s[1], 2: s[2], 3: torch.zeros(9, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="shards\\[3\\] is on meta but shards\\[0\\] is on cpu"):
        code.decode({0: s[0], 1: s[1], 2: s[2], 3: torch.empty(8, dtype=torch.uint8, device="meta")})
    with pytest.raises(TypeError, match="shards\\[1\\] must be a uint8 tensor"):
        code.decode({0: s[0], 1: s[1].float(), 2: s[2], 3: s[3]})
    with pytest.raises(ValueError, match="shard id = 6 is out of range \\[0, 6\\)"):
        code.decode({0: s[0], 1: s[1], 2: s[2], 6: s[3]})
    with pytest.raises(TypeError, match="mapping"):
        code.decode(s)
    full = {i: s[i] for i in range(4)}
    with pytest.raises(ValueError, match="ids must not repeat"):
        code.reconstruct(full, [4, 4])
    with pytest.raises(ValueError, match="ids\\[1\\] = 9 is out of range"):
        code.reconstruct(full, [4, 9])


def test_update_rejects_bad_input(code):
    parity = torch.zeros(2, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="i = 4 is out of range \\[0, 4\\)"):
        code.update(parity, 4, torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="parity has shape \\(2, 8\\), expected \\(2, 9\\)"):
        code.update(parity, 0, torch.zeros(9, dtype=torch.uint8))
    with pytest.raises(TypeError, match="delta must be a uint8 tensor, got torch.bfloat16"):
        code.update(parity, 0, torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="delta must be contiguous"):
        code.update(parity, 0, torch.zeros(16, dtype=torch.uint8)[::2])


def test_update_rows_rejects_bad_input(code):
    parity = torch.zeros(2, 10, 4, dtype=torch.uint8)
    delta = torch.ones(3, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="rows\\[1\\] = 10 is out of range: the parity has 10 rows of 4 bytes"):
        code.update_rows(parity, 0, torch.tensor([2, 10, 3]), delta)
    with pytest.raises(ValueError, match="rows\\[2\\] = -1 is out of range"):
        code.update_rows(parity, 0, torch.tensor([2, 3, -1]), delta)
    assert not parity.any()  # a bad row changes nothing
    with pytest.raises(TypeError, match="rows must be an int64 tensor, got torch.int32: convert with rows.long\\(\\)"):
        code.update_rows(parity, 0, torch.tensor([1, 2, 3], dtype=torch.int32), delta)
    with pytest.raises(TypeError, match="rows must be an int64 tensor, got list"):
        code.update_rows(parity, 0, [1, 2, 3], delta)
    with pytest.raises(ValueError, match="rows must be 1-D"):
        code.update_rows(parity, 0, torch.tensor([[1, 2, 3]]), delta)
    with pytest.raises(ValueError, match="delta_rows must be \\[m, row_bytes\\] with m = len\\(rows\\) = 2"):
        code.update_rows(parity, 0, torch.tensor([1, 2]), delta)
    with pytest.raises(ValueError, match="40 bytes, not a whole number of rows of row_bytes = delta_rows.shape\\[1\\] = 3"):
        code.update_rows(parity, 0, torch.tensor([1, 2, 3]), torch.ones(3, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="parity must be \\[P, \\*S\\] with P = 1"):
        code.update_rows(parity, 0, torch.tensor([1, 2, 3]), delta, parity_ids=[5])
    with pytest.raises(ValueError, match="rows is on meta but parity is on cpu"):
        code.update_rows(parity, 0, torch.tensor([1, 2, 3], device="meta"), delta)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        code.update_rows(parity, 0, torch.tensor([1, 0, 2, 0, 3])[::2], delta)


def test_as_bytes_rejects_non_contiguous():
    with pytest.raises(ValueError, match="as_bytes needs a contiguous tensor.*call .contiguous\\(\\)"):
        as_bytes(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="as_bytes expects a torch.Tensor"):
        as_bytes(np.zeros(4))
