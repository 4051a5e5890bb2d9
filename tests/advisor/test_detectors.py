"""Straggler, out-of-memory and hot-rank detectors on constructed windows and per-rank step timings (real jobs:
test_jobs.py), and the node memory of a real process tree."""

import json
import os
import random
import subprocess
import sys
import textwrap

import psutil
import pytest

from lightning_dlrover.advisor.detectors import (
    OOMForecaster,
    RankWindow,
    StepSample,
    StragglerDetector,
    communication_message,
    hot_ranks,
)


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
    # every rank spends >= 32 ms of its 50 ms step in collectives
    busy = [RankWindow(r, 0, 1, 10, 0.050, 0.001, 0.010 + 0.002 * r, collective_s=0.038 - 0.002 * r,
                       own_wall_s=0.012 + 0.002 * r) for r in range(4)]
    assert detector.update(busy) == [] and detector.communication_bound(busy) is None
    assert detector.communication_bound(busy) == pytest.approx(0.032)
    assert detector.communication_bound(busy) is None  # reported once
    fast = [RankWindow(r, 0, 1, 10, 0.011, 0.001, 0.002 if r == 0 else 0.010, collective_s=0.008 if r == 0 else 0.0)
            for r in range(4)]
    assert StragglerDetector(patience=1).communication_bound(fast) is None  # only the fast rank waits
    untimed = [RankWindow(r, 0, 1, 10, 0.050, 0.001, 0.010) for r in range(4)]  # 39 ms blocked: collectives or idle?
    assert StragglerDetector(patience=1).communication_bound(untimed) is None  # no verdict without collective times


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


def recorded(steps: int, seed: int = 0, idle_rank: int | None = None, idle_from: int = 0, idle_s: float = 0.2,
             spike: int | None = None) -> dict[int, list[StepSample]]:
    """Per-rank step timings of a 2-rank job on a loaded machine (the shape of what ThroughputMonitor records: ~60 ms
    steps, 20-40 ms of them in collectives, CPU time and waits for a CPU jittering by tens of percent). With
    ``idle_rank``, that rank sleeps ``idle_s`` inside every step from ``idle_from`` and the other waits for it in
    collectives. With ``spike``, at that step rank 0 alone works 1 s between two steps (the advisor's re-plan, were
    it not left out) and rank 1 waits for it in the broadcast that follows."""
    rng = random.Random(seed)
    out: dict[int, list[StepSample]] = {0: [], 1: []}
    for step in range(1, steps + 1):
        cpu = {r: rng.uniform(0.015, 0.030) for r in (0, 1)}
        wait_cpu = {r: rng.uniform(0.0, 0.020) for r in (0, 1)}
        data = {r: rng.uniform(0.002, 0.008) for r in (0, 1)}
        idle = {r: idle_s if r == idle_rank and step >= idle_from else 0.0 for r in (0, 1)}
        own = {r: data[r] + cpu[r] + wait_cpu[r] + idle[r] for r in (0, 1)}
        transfer = rng.uniform(0.010, 0.030)
        step_s = max(own.values()) + transfer
        for r in (0, 1):
            coll = step_s - own[r]
            busy, d = cpu[r] + wait_cpu[r], data[r]
            data_busy, wall = d * 0.8, step_s
            if spike == step:
                wall += 1.0
                d += 1.0
                if r == 0:
                    data_busy += 1.0
                else:
                    coll += 1.0
            out[r].append(StepSample(step, wall, d, busy, 4e8, data_busy, coll))
    return out


def names(detector: StragglerDetector, timings: dict[int, list[StepSample]], every: int = 5) -> list:
    """Feeds the detector one window per ``every`` steps (as the advisor's checks do); returns every naming."""
    found = []
    steps = len(timings[0])
    for end in range(every, steps + 1, every):
        windows = [RankWindow.from_steps(r, 0, timings[r][end - every:end]) for r in sorted(timings)]
        found += detector.update(windows)
        detector.communication_bound(windows)
    return found


@pytest.mark.parametrize("seed", range(5))
def test_clean_job_with_a_one_off_spike_on_rank_0_is_not_named(seed):
    timings = recorded(60, seed=seed, spike=12)
    detector = StragglerDetector()
    assert names(detector, timings) == []
    assert detector.communication_s is None


@pytest.mark.parametrize("seed", range(5))
def test_rank_idle_inside_its_step_is_named_within_10_steps_with_its_cause(seed):
    timings = recorded(60, seed=seed, idle_rank=1, idle_from=23)
    detector = StragglerDetector()
    [named] = names(detector, timings)
    assert (named.rank, named.cause) == (1, "idle") and 23 <= named.named_at_step <= 33
    assert named.excess_ms > 150
    assert detector.communication_bound([RankWindow.from_steps(r, 0, timings[r][-5:]) for r in (0, 1)]) is None


def test_without_collective_times_an_idle_rank_looks_like_its_waiting_peer():
    timings = recorded(60, idle_rank=1, idle_from=23)
    untimed = {r: [StepSample(s.step, s.step_s, s.data_s, s.busy_s, s.rss, s.data_busy_s) for s in t]
               for r, t in timings.items()}
    assert names(StragglerDetector(), untimed) == []  # the documented limit of busy time alone


def test_one_machine_gets_no_interconnect_advice():
    one = communication_message(0.030, 0.050, nodes=1)
    assert "interconnect" not in one and "network" in one and "one machine" in one
    assert "faster interconnect" in communication_message(0.030, 0.050, nodes=2)


_TREE = textwrap.dedent("""
    import json, os, subprocess, sys
    from lightning_dlrover.advisor.runtime import children_memory
    from lightning_dlrover.monitor.steps import rss_bytes
    ballast = bytearray(int(sys.argv[1]) * 2**20)
    for i in range(0, len(ballast), 4096):  # resident
        ballast[i] = 1
    below = []
    if len(sys.argv) > 2:  # start the next process of the tree, and pass its report(s) up
        child = subprocess.Popen([sys.executable, __file__, *sys.argv[2:]], stdout=subprocess.PIPE, text=True)
        below = json.loads(child.stdout.readline())
    print(json.dumps([[os.getpid(), rss_bytes(), children_memory()], *below]), flush=True)
    sys.stdin.readline()  # hold until the test is done (a child is killed with its parent's session)
""")


def test_node_memory_counts_each_process_once_under_a_parent_child_tree(tmp_path):
    """Lightning's launcher starts rank 1 as a child of rank 0, so rank 0's descendants hold rank 1 and rank 1's
    data worker too. The forecast's node memory is the measured total of the three processes, each counted once."""
    script = tmp_path / "tree.py"
    script.write_text(_TREE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # rank 0 (60 MiB) -> rank 1 (80 MiB) -> rank 1's data worker (40 MiB)
    rank0 = subprocess.Popen([sys.executable, str(script), "60", "80", "40"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        (pid0, own0, children0), (pid1, own1, children1), _ = json.loads(rank0.stdout.readline())
        tree = [psutil.Process(pid0), *psutil.Process(pid0).children(recursive=True)]
        assert len(tree) == 3 and {p.pid for p in tree} >= {pid0, pid1}
        measured = sum(p.memory_info().rss for p in tree)
        windows = [RankWindow(r, 0, 1, 1, 0.1, 0, 0.1, ((1, own),), pid=pid, children=tuple(map(tuple, children)))
                   for r, (pid, own, children) in enumerate([(pid0, own0, children0), (pid1, own1, children1)])]
        forecaster = OOMForecaster(limit_bytes=1e12)
        forecaster.update(windows, step_s=0.1)
        assert forecaster.node_bytes(0) == pytest.approx(measured, rel=0.05), (forecaster.node_bytes(0), measured)
    finally:
        os.killpg(rank0.pid, 9)
        rank0.wait()
