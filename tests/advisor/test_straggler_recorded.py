"""The straggler rule on windows recorded in real runs of ``bench/bench_detectors.py`` (2 ranks, gloo on CPU, two CPU
busy loops beside the job and other jobs on the 2 shared cores; recorded with ``--record``): every window the
advisor's detector judged, replayed through a fresh detector with the advisor's defaults.

In ``clean`` runs nothing is slowed: naming a rank is a false alarm. In ``idle`` and ``cpu`` runs rank 1 from step 20
sleeps 200 ms or burns 100 ms of CPU inside each step: it must be named within 10 steps (at the check of step 30)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_dlrover.advisor.detectors import RankWindow, StragglerDetector, clear_of_noise

RUNS = json.loads((Path(__file__).parent / "straggler_windows.json").read_text())
SLOW_FROM = 20


def replay(run: dict) -> list:
    detector = StragglerDetector()  # the ResourceAdvisor's defaults
    found = []
    for check in run["checks"]:
        found += detector.update([RankWindow(**{**w, "own_steps": tuple(w["own_steps"])}) for w in check])
    return found


@pytest.mark.parametrize("run", [r for r in RUNS if r["kind"] == "clean"], ids=lambda r: r["run"])
def test_clean_runs_under_load_name_no_straggler(run):
    assert [s.message() for s in replay(run)] == []


@pytest.mark.parametrize("run", [r for r in RUNS if r["kind"] != "clean"], ids=lambda r: r["run"])
def test_slow_rank_under_load_is_named_within_10_steps_with_its_cause(run):
    [named] = replay(run)
    assert (named.rank, named.cause) == (1, "idle" if run["kind"] == "idle" else "compute")
    assert named.named_at_step - SLOW_FROM <= 10


def test_a_median_pushed_up_by_a_few_slow_steps_is_noise():
    """Rank 0's median own time 1.7x rank 1's, but two of its five steps are faster than rank 1's slower steps."""
    rank0 = RankWindow(0, 0, 36, 40, 0.5, 0.0, 0.3, own_wall_s=0.355, collective_s=0.1,
                       own_steps=(0.217, 0.355, 0.193, 0.421, 0.380))
    rank1 = RankWindow(1, 0, 36, 40, 0.5, 0.0, 0.2, own_wall_s=0.210, collective_s=0.2,
                       own_steps=(0.143, 0.304, 0.210, 0.133, 0.255))
    assert not clear_of_noise(rank0, [rank1])
    # An idle rank (200 ms sleep per step) and its peer: every step of it slower than most of its peer's.
    slow = RankWindow(1, 0, 31, 35, 0.44, 0.0, 0.16, own_wall_s=0.334, collective_s=0.1,
                      own_steps=(0.334, 0.317, 0.343, 0.329, 0.359))
    peer = RankWindow(0, 0, 31, 35, 0.43, 0.0, 0.15, own_wall_s=0.135, collective_s=0.3,
                      own_steps=(0.135, 0.162, 0.125, 0.124, 0.242))
    assert clear_of_noise(slow, [peer])
    assert clear_of_noise(slow, [RankWindow(0, 0, 31, 35, 0.43, 0.0, 0.15)])  # no per-step times: medians decide
