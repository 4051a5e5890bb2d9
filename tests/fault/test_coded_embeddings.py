"""Erasure-coded embeddings in real multi-process training: every lost rank (every pair at r=2) is
decoded byte-for-byte, and training then ends exactly where a run without parity or loss ends."""

import pytest

from tests.conftest import digests, train, train_forked, train_together

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("devices", "parity", "drill", "batch", "compare"),
    [(3, "2,1", "0 1 2", "96", True), (4, "2,2", "0,1 1,2 2,3 0,3 0,2 1,3", "64", False)],
)
def test_every_loss_pattern_decodes_exactly(tmp_path, devices, parity, drill, batch, compare):
    common = ["--devices", str(devices), "--batch", batch, "--steps", "10"]
    drilled = [*common, "--parity", parity, "--drill-at", "5", "--drill", drill]
    # one world size is enough to show that parity and recovery do not change training: there, the job without
    # parity (the reference) runs beside the drilled one
    jobs = train_together(tmp_path, drilled, common, fork=True) if compare else [train_forked(tmp_path, *drilled)]
    out = jobs[0].stdout
    k, r = map(int, parity.split(","))
    assert f"DLRoverStrategy parity k={k} r={r}" in out
    for lost in drill.split():
        assert f"drill after_batch lost=[{lost.replace(',', ', ')}]: recovered state matches" in out
    assert "DIFFERS" not in out
    if compare:
        assert digests(out)["end"] == digests(jobs[1].stdout)["end"], "parity and recovery do not change training"


def test_parity_needs_enough_ranks(tmp_path):
    proc = train(tmp_path, "--devices", "2", "--steps", "2", "--parity", "2,1", check=False)
    assert proc.returncode != 0
    assert "ParityConfig(k=2, r=1) needs k + r = 3 distinct ranks per parity group, but the world size is 2" in proc.stdout


def test_loss_mid_step_recovers_the_committed_step(tmp_path):
    """A loss inside a step (before its forward, after its embedding and dense updates, or after some parity deltas
    were applied) recovers every rank to exactly the state committed at the end of the step before. One run,
    three drills: in step index 4 before the forward, in 6 after the optimizer, in 8 during the parity commit,
    each losing rank 1 then rank 0 (a drill rolls its step back, so that step commits nothing: drills are two
    steps apart). Commits overlap the next batch's fetch (the default): the commit of step 8 is decided at step
    9's start."""
    phases = ["before_forward", "after_optimizer", "during_parity_commit"]
    out = train_forked(tmp_path, "--devices", "3", "--steps", "10", "--parity", "2,1", "--drill", "1 0",
                "--drill-at", "4", "--drill-phase", phases[0],
                "--drill-more", f"6,6,{phases[1]}", "--drill-more", f"8,8,{phases[2]}").stdout
    for phase in phases:
        assert f"drill {phase} lost=[1]: recovered state matches" in out, out[-4000:]
        assert f"drill {phase} lost=[0]: recovered state matches" in out, out[-4000:]
    assert "DIFFERS" not in out


def test_coalesced_commits_recover_the_last_commit(tmp_path):
    """Commits every 4 steps: a loss inside the window (in step index 6 after the optimizer, window 4-7) or in the
    commit that ends a window (index 11's parity commit, window 8-11) recovers every rank to exactly the state
    committed at the window's start (step 4, step 8); the start-up message states the recovery point. One run,
    with the whole commit at the end of its step (``overlap=False``; tests/fault/test_user_models.py drills
    coalesced commits with overlap)."""
    out = train_forked(tmp_path, "--devices", "3", "--steps", "13", "--parity", "2,1,4,0", "--drill", "2",
                "--drill-at", "4", "--drill-loss-at", "6", "--drill-phase", "after_optimizer",
                "--drill-more", "8,11,during_parity_commit").stdout
    assert "the recovery point is committed every 4 steps (a failure trains at most 3 steps again)" in out
    for phase in ("after_optimizer", "during_parity_commit"):
        assert f"drill {phase} lost=[2]: recovered state matches" in out, out[-4000:]
    assert "DIFFERS" not in out
