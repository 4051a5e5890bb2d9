"""GF(2^8) arithmetic against reedsolo, and the code's coefficient matrix."""

import itertools

import numpy as np
import pytest
import reedsolo

from lightning_dlrover.parity import gf256


@pytest.fixture(scope="module", autouse=True)
def reedsolo_field():
    reedsolo.init_tables(prim=0x11D)


def test_mul_matches_reedsolo_for_all_pairs():
    expected = np.array(
        [[reedsolo.gf_mul(a, b) for b in range(256)] for a in range(256)], dtype=np.uint8
    )
    np.testing.assert_array_equal(gf256.MUL_TABLE, expected)
    assert gf256.mul(0x53, 0xCA) == reedsolo.gf_mul(0x53, 0xCA)


def test_inverse_matches_reedsolo():
    for a in range(1, 256):
        assert gf256.inverse(a) == reedsolo.gf_inverse(a)
        assert gf256.mul(a, gf256.inverse(a)) == 1
    with pytest.raises(ZeroDivisionError, match="0 has no inverse"):
        gf256.inverse(0)


def test_inverse_matrix_round_trip_and_singular():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 40):
        while True:
            a = rng.integers(0, 256, (n, n), dtype=np.uint8)
            try:
                inv = gf256.inverse_matrix(a)
                break
            except ValueError:
                continue
        np.testing.assert_array_equal(gf256.matmul(a, inv), np.eye(n, dtype=np.uint8))
        np.testing.assert_array_equal(gf256.matmul(inv, a), np.eye(n, dtype=np.uint8))
    singular = np.array([[1, 2], [2, 4]], dtype=np.uint8)  # row 1 = 2 * row 0
    with pytest.raises(ValueError, match="singular"):
        gf256.inverse_matrix(singular)
    with pytest.raises(ValueError, match="square"):
        gf256.inverse_matrix(np.zeros((2, 3), dtype=np.uint8))


def test_matmul_matches_reedsolo():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (3, 5), dtype=np.uint8)
    b = rng.integers(0, 256, (5, 4), dtype=np.uint8)
    expected = np.zeros((3, 4), dtype=np.uint8)
    for i, j, t in itertools.product(range(3), range(4), range(5)):
        expected[i, j] ^= reedsolo.gf_mul(int(a[i, t]), int(b[t, j]))
    np.testing.assert_array_equal(gf256.matmul(a, b), expected)


def test_cauchy_matrix_formula_first_row_ones():
    r, k = 3, 5
    c = gf256.cauchy_matrix(r, k)
    for j, i in itertools.product(range(r), range(k)):
        y = r + i
        assert c[j, i] == reedsolo.gf_mul(reedsolo.gf_inverse(j ^ y), y)
    assert (c[0] == 1).all()
    assert (gf256.cauchy_matrix(1, 255) == 1).all()


def _all_square_submatrices_invertible(c: np.ndarray) -> bool:
    r, k = c.shape
    for size in range(1, min(r, k) + 1):
        for rows in itertools.combinations(range(r), size):
            for cols in itertools.combinations(range(k), size):
                try:
                    gf256.inverse_matrix(c[np.ix_(rows, cols)])
                except ValueError:
                    return False
    return True


@pytest.mark.parametrize("r, k", [(2, 2), (3, 6), (4, 6), (6, 4)])
def test_every_square_submatrix_invertible(r, k):
    assert _all_square_submatrices_invertible(gf256.cauchy_matrix(r, k))


def test_square_submatrices_invertible_near_256():
    c = gf256.cauchy_matrix(6, 250)
    rng = np.random.default_rng(2)
    for _ in range(50):
        size = int(rng.integers(1, 7))
        rows = rng.choice(6, size, replace=False)
        cols = rng.choice(250, size, replace=False)
        gf256.inverse_matrix(c[np.ix_(rows, cols)])


@pytest.mark.parametrize("r, k", [(0, 4), (2, 0), (1, 256), (200, 57)])
def test_cauchy_matrix_rejects_bad_sizes(r, k):
    with pytest.raises(ValueError, match="k \\+ r <= 256"):
        gf256.cauchy_matrix(r, k)


def test_bit_products():
    products = gf256.bit_products(np.array([[0, 1], [2, 0x8E]], dtype=np.uint8))
    assert products.shape == (2, 2, 8)
    for c in (0, 1, 2, 0x8E, 0xFF):
        assert gf256.bit_products(c).tolist() == [reedsolo.gf_mul(c, 1 << b) for b in range(8)]
