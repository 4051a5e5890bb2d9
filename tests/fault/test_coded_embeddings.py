"""Erasure-coded embeddings in real multi-process training: every lost rank (every pair at r=2) is
decoded byte-for-byte, and training then ends exactly where a run without parity or loss ends."""

import pytest

from tests.conftest import digests, train

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("devices", "parity", "drill", "batch", "compare"),
    [(3, "2,1", "0 1 2", "96", True), (4, "2,2", "0,1 1,2 2,3 0,3 0,2 1,3", "64", False)],
)
def test_every_loss_pattern_decodes_exactly(tmp_path, devices, parity, drill, batch, compare):
    common = ["--devices", str(devices), "--batch", batch, "--steps", "10"]
    out = train(tmp_path, *common, "--parity", parity, "--drill-at", "5", "--drill", drill).stdout
    k, r = map(int, parity.split(","))
    assert f"DLRoverStrategy parity k={k} r={r}" in out
    for lost in drill.split():
        assert f"drill after_batch lost=[{lost.replace(',', ', ')}]: recovered state matches" in out
    assert "DIFFERS" not in out
    if compare:  # one world size is enough to show it (a job without parity costs a run)
        plain = digests(train(tmp_path, *common).stdout)
        assert digests(out)["end"] == plain["end"], "parity and recovery do not change training"


def test_parity_needs_enough_ranks(tmp_path):
    proc = train(tmp_path, "--devices", "2", "--steps", "2", "--parity", "2,1", check=False)
    assert proc.returncode != 0
    assert "ParityConfig(k=2, r=1) needs k + r = 3 distinct ranks per parity group, but the world size is 2" in proc.stdout


@pytest.mark.parametrize(("phase", "parity"), [("before_forward", "2,1"), ("after_optimizer", "2,1,1,0"),
                                               ("during_parity_commit", "2,1")])
def test_loss_mid_step_recovers_the_committed_step(tmp_path, phase, parity):
    """A loss inside step 5 (after its embedding and dense updates, or after some parity deltas were
    applied) recovers every rank to exactly the state committed at the end of step 4. Commits overlap the
    next step's data fetch (the default: the commit of step 5 is decided at step 6's start), except in the
    ``after_optimizer`` case, which commits at the end of the step (``overlap=False``)."""
    out = train(tmp_path, "--devices", "3", "--steps", "7", "--parity", parity,
                "--drill-at", "4", "--drill", "1 0", "--drill-phase", phase).stdout
    assert f"drill {phase} lost=[1]: recovered state matches" in out
    assert f"drill {phase} lost=[0]: recovered state matches" in out
    assert "DIFFERS" not in out


@pytest.mark.parametrize("phase", ["after_optimizer", "during_parity_commit"])
def test_coalesced_commits_recover_the_last_commit(tmp_path, phase):
    """Commits every 4 steps: a loss inside the window (in step index 6, or in the commit of index 7) recovers
    every rank to exactly the state committed at step 4; the start-up message states the recovery point."""
    loss_at = "6" if phase == "after_optimizer" else "7"
    out = train(tmp_path, "--devices", "3", "--steps", "9", "--parity", "2,1,4",
                "--drill-at", "4", "--drill-loss-at", loss_at, "--drill", "2", "--drill-phase", phase).stdout
    assert "the recovery point is committed every 4 steps (a failure trains at most 3 steps again)" in out
    assert f"drill {phase} lost=[2]: recovered state matches" in out
    assert "DIFFERS" not in out
