"""The resource-performance model: NNLS recovers known coefficients; bad input fails clearly."""

import itertools

import numpy as np
import pytest

from lightning_dlrover.advisor.model import (
    JobShape, Observation, PerformanceModel, TRAIN_TERMS, fit_nnls, greedy_share, train_features,
)
from lightning_dlrover.advisor.resources import ResourceConfig

SHAPES = [JobShape(tuple([16.0] * 26), 30_000, 26 * 1000 * 16 * 4),
          JobShape(tuple([64.0] * 8 + [16.0] * 18), 90_000, 10**8)]


def truth() -> PerformanceModel:
    model = PerformanceModel()
    model.train = np.array([2e-3, 4e-5, 3e-8, 1e-5, 2e-5, 1e-9, 1e-3, 2e-9, 5e-3])
    model.make = np.array([1e-3, 5e-6, 2e-6])
    model.wait = np.array([3e-6])
    model.memory = np.array([2e8, 1.5, 1e4])
    return model


def grid(model: PerformanceModel, noise: float = 0.0, seed: int = 0) -> list[Observation]:
    rng = np.random.default_rng(seed)
    out = []
    for shape, n, g, t, d, b in itertools.product(SHAPES, [1, 2], [1, 2, 4], [1, 2], [0, 1, 2], [64, 256, 1024]):
        c = ResourceConfig(n, g, t, d, b)
        p = model.predict(c, shape, 2)
        f = 1 + noise * rng.standard_normal()
        out.append(Observation(c, shape, 2, p.step_s * f, p.data_wait_s * f, p.rss_bytes))
    return out


def test_nnls_recovers_known_coefficients_exactly_without_noise():
    model = PerformanceModel(ridge=1e-10).fit(grid(truth()))
    for part in ("train", "make", "wait", "memory"):
        np.testing.assert_allclose(getattr(model, part), getattr(truth(), part), rtol=1e-3, atol=0)
    assert model.mape(grid(truth())) < 0.01


def test_fit_with_noise_predicts_held_out_configurations():
    observations = grid(truth(), noise=0.05)
    train, held_out = observations[::2], observations[1::2]
    model = PerformanceModel().fit(train)
    assert model.mape(held_out) < 10  # 5% noise per point
    assert all(v >= 0 for v in model.train)


def test_nnls_keeps_coefficients_non_negative():
    x = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([3.0, 2.0, 1.0])  # falls with the second feature: least squares would go negative
    theta = fit_nnls(x, y, np.ones(3), ridge=0.0)
    assert (theta >= 0).all() and theta[1] == 0


def test_features_saturate_with_threads_and_do_not_promise_free_speed():
    shape = SHAPES[0]
    one, two, four = (train_features(ResourceConfig(1, 2, t, 0, 256), shape, 2) for t in (1, 2, 4))
    dense = TRAIN_TERMS.index("dense")
    assert one[dense] == two[dense] == four[dense]  # 2 ranks x 1 thread already use both cores
    assert four[TRAIN_TERMS.index("oversubscription")] > two[TRAIN_TERMS.index("oversubscription")] > 0


def test_greedy_share_and_planned_share():
    assert greedy_share([1.0] * 4, 2) == 0.5
    assert greedy_share([3.0, 1.0], 2) == 0.75
    assert greedy_share([1.0], 1) == 1.0
    shape = JobShape((1.0, 1.0), 0, planned_shares=((2, 0.9),))
    assert shape.share(2) == 0.9 and shape.share(1) == 1.0


def test_round_trip_and_support():
    model = PerformanceModel().fit(grid(truth()))
    again = PerformanceModel.from_dict(model.to_dict())
    c = ResourceConfig(1, 2, 1, 1, 256)
    assert again.predict(c, SHAPES[0], 2).step_s == pytest.approx(model.predict(c, SHAPES[0], 2).step_s)
    assert model.supports(ResourceConfig(1, 4, 1, 0, 64)) and not model.supports(ResourceConfig(4, 4, 1, 0, 64))


def test_bad_input_fails_clearly():
    with pytest.raises(ValueError, match="at least one measured configuration"):
        PerformanceModel().fit([])
    with pytest.raises(ValueError, match="threads_per_rank=0 must be at least 1"):
        ResourceConfig(threads_per_rank=0)
    with pytest.raises(ValueError, match="data_workers=-1"):
        ResourceConfig(data_workers=-1)
