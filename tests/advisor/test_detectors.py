"""Straggler, out-of-memory and hot-rank detectors on constructed windows (real jobs: test_jobs.py)."""

import pytest

from lightning_dlrover.advisor.detectors import OOMForecaster, RankWindow, StragglerDetector, hot_ranks


def windows(first: int, slow: dict[int, tuple[float, float, float]], ranks: int = 4, last: int | None = None):
    """Ranks' windows: (data wait, data busy, busy) seconds per step; others (1 ms, 1 ms, 10 ms)."""
    last = last or first + 9
    parts = {r: slow.get(r, (0.001, 0.001, 0.010)) for r in range(ranks)}
    step = max(d + b for d, _, b in parts.values())
    return [RankWindow(r, 0, first, last, step, d, b, data_busy_s=db) for r, (d, db, b) in parts.items()]


def test_compute_straggler_named_after_patience_windows_not_the_waiting_ranks():
    detector = StragglerDetector(threshold=1.5, patience=2)
    assert detector.update(windows(1, {})) == []
    assert detector.update(windows(11, {2: (0.001, 0.001, 0.030)})) == []  # first slow window
    [named] = detector.update(windows(21, {2: (0.001, 0.001, 0.030)}))
    assert (named.rank, named.cause, named.since_step, named.named_at_step) == (2, "compute", 11, 30)
    assert named.ratio == pytest.approx(31 / 11) and named.excess_ms == pytest.approx(20)  # busy + data busy
    assert detector.update(windows(31, {2: (0.001, 0.001, 0.030)})) == []  # named once
    detector.update(windows(41, {}))
    assert 2 not in detector.named  # recovered


def test_data_wait_straggler_and_two_ranks():
    detector = StragglerDetector(patience=1)
    [named] = detector.update(windows(1, {1: (0.040, 0.030, 0.010)}, ranks=2))  # making batches itself
    assert (named.rank, named.cause) == (1, "data wait")
    [named] = StragglerDetector(patience=1).update(windows(1, {1: (0.040, 0.001, 0.010)}, ranks=2))  # storage
    assert (named.rank, named.cause, round(named.excess_ms)) == (1, "data wait", 39)
    waiting = windows(1, {r: (0.040, 0.001, 0.010) for r in range(4)})  # all wait alike (e.g. for a late rank)
    assert StragglerDetector(patience=1).update(waiting) == []


def test_communication_bound_job_reported_once_not_blamed_on_a_rank():
    detector = StragglerDetector(patience=2)
    busy = [RankWindow(r, 0, 1, 10, 0.050, 0.001, 0.010 + 0.002 * r) for r in range(4)]  # >= 32 ms blocked on all
    assert detector.update(busy) == [] and detector.communication_bound(busy) is None
    assert detector.communication_bound(busy) == pytest.approx(0.050 - 0.001 - 0.016)
    assert detector.communication_bound(busy) is None  # reported once
    fast = [RankWindow(r, 0, 1, 10, 0.011, 0.001, 0.002 if r == 0 else 0.010) for r in range(4)]
    assert StragglerDetector(patience=1).communication_bound(fast) is None  # only the fast rank waits


def test_noise_below_the_floor_is_not_named():
    detector = StragglerDetector(patience=1, min_excess_s=0.002)
    w = [RankWindow(r, 0, 1, 10, 0.004, 0.0005, 0.0034 if r == 0 else 0.0015) for r in range(3)]
    assert detector.update(w) == []  # 1.95x the median rank but only +1.9 ms: below the floor
    fast = [RankWindow(r, 0, 1, 10, 0.011, 0.001, 0.002 if r == 0 else 0.010) for r in range(3)]
    assert StragglerDetector(patience=1).update(fast) == []  # one fast rank makes no one else a straggler


def test_oom_forecast_from_linear_growth():
    forecaster = OOMForecaster(limit_bytes=2e9, horizon_steps=1000, window=50)
    mib = 2**20
    first = [RankWindow(r, 0, 1, 10, 0.1, 0, 0.1, tuple((s, 4e8 + r * 1e8 + 5 * mib * s) for s in range(1, 11)))
             for r in range(2)]
    [forecast] = forecaster.update(first, step_s=0.1)
    now = 8e8 + 100 * mib + 100 * mib / 10 * 10 / 10  # two ranks, 10 MiB/step together, at step 10
    assert forecast.growth_bytes_per_step == pytest.approx(10 * mib, rel=1e-6)
    assert forecast.steps_to_oom == pytest.approx((2e9 - (9e8 + 100 * mib)) / (10 * mib), rel=1e-3)
    assert forecast.seconds_to_oom == pytest.approx(forecast.steps_to_oom * 0.1)
    assert "out of memory in ~" in forecast.message()
    flat = [RankWindow(0, 0, 11, 20, 0.1, 0, 0.1, tuple((s, 4e8) for s in range(11, 21)))]
    assert OOMForecaster(2e9).update(flat, 0.1) == []


def test_hot_ranks():
    [hot] = hot_ranks({0: 30.0, 1: 10.0, 2: 10.0, 3: 10.0}, {0: [("t_a", 20.0), ("t_b", 10.0)]}, factor=1.5)
    assert hot.rank == 0 and hot.share == 0.5 and hot.ratio == 2.0 and hot.tables == ("t_a", "t_b")
    assert hot_ranks({0: 1.0, 1: 1.1}) == []


def test_bad_settings():
    with pytest.raises(ValueError, match="threshold=1.0 must be above 1"):
        StragglerDetector(threshold=1.0)
    with pytest.raises(ValueError, match="patience=0"):
        StragglerDetector(patience=0)
    with pytest.raises(ValueError, match="must be positive"):
        OOMForecaster(limit_bytes=0)
