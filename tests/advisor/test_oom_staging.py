"""The advisor's OOM forecast counts the memory a rank will allocate at its next checkpoint save (the staging copy
of ``DLRoverStrategy(async_checkpoint=True)`` before its first save) as used."""

from __future__ import annotations

import pytest

from lightning_dlrover.advisor.detectors import OOMForecaster, RankWindow
from tests.advisor.test_jobs import job

GIB = 2**30


def windows(rss: float, growth: float, staging: float, first: int = 1) -> list[RankWindow]:
    """Two ranks of one node, each ``rss`` bytes growing by ``growth`` per step, each to stage ``staging`` bytes."""
    return [RankWindow(rank, 0, first, first + 9, 0.1, 0.0, 0.1,
                       tuple((s, rss + growth * (s - first)) for s in range(first, first + 10)), staging_bytes=staging)
            for rank in range(2)]


def test_staging_that_does_not_fit_is_forecast_without_growth():
    """3 GiB in use, 1.5 GiB to stage on a 4 GiB node: no growth, yet the first save will not fit."""
    [forecast] = OOMForecaster(limit_bytes=4 * GIB).update(windows(1.5 * GIB, 0.0, 0.75 * GIB), step_s=0.1)
    assert forecast.staging_bytes == 1.5 * GIB and forecast.steps_to_oom == 0
    assert "staging copy of the first asynchronous checkpoint" in forecast.message()
    assert "async_checkpoint=False" in forecast.message()
    assert OOMForecaster(limit_bytes=4 * GIB).update(windows(1.5 * GIB, 0.0, 0.0), step_s=0.1) == [], \
        "without the staging copy nothing is forecast"


def test_staging_brings_the_forecast_closer():
    """With growth, the steps left shrink by the staging bytes over the growth per step."""
    growth = 8 * 2**20
    plain = OOMForecaster(limit_bytes=4 * GIB, horizon_steps=10**6).update(windows(GIB, growth, 0.0), 0.1)[0]
    staged = OOMForecaster(limit_bytes=4 * GIB, horizon_steps=10**6).update(windows(GIB, growth, 0.25 * GIB), 0.1)[0]
    assert staged.staging_bytes == 0.5 * GIB
    assert plain.steps_to_oom - staged.steps_to_oom == pytest.approx(0.5 * GIB / (2 * growth), rel=1e-6)


@pytest.mark.slow
def test_advisor_forecasts_the_first_asynchronous_save(tmp_path):
    """A real 2-rank job with asynchronous checkpoints and the advisor, whose node limit leaves 16 MiB of headroom (no
    growth to speak of): the staging copy of the first save (~85 MiB of tables and their state) does not fit, and the
    forecast says so at the first check, before any save; the same job with blocking saves gets no staging forecast."""
    common = ["--devices", "2", "--advisor", "--profile-steps", "0", "--check-every", "5", "--steps", "20",
              "--rows", "50000", "--leak-mb", "0.001", "--leak-from", "3", "--headroom-mb", "16"]
    out, events = job(tmp_path / "async", *common, "--async-ckpt")
    forecasts = [e for e in events if e.kind == "oom_forecast"]
    assert len(forecasts) == 1, "said once: out of memory now is not said again"
    forecast = forecasts[0]
    assert forecast.step == 5 and forecast["staging_bytes"] > 32 * 2**20 and forecast["steps_to_oom"] == 0, forecast
    assert "staging copy of the first asynchronous checkpoint" in out
    _, blocking = job(tmp_path / "blocking", *common)
    # (the blocking job may still see a growth forecast: 16 MiB of headroom is within what a loaded machine's
    # allocator takes over a few steps; what it must not see is a staging copy, which blocking saves never make)
    assert [e for e in blocking if e.kind == "oom_forecast" and e["staging_bytes"]] == []
