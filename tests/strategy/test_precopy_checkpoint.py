"""Pre-copied full saves (``DLRoverStrategy(async_checkpoint="precopy")``) in real 2-rank jobs: the embedding tables
are copied in the background while training goes on, and the checkpoint still holds the state of its step, bit for
bit (our DLRM with row-wise Adagrad, a user's own model with exact Adagrad), also onto another world size.

The copy is slowed through the writer's real hook (``$LIGHTNING_DLROVER_CHECKPOINT_WRITE_HOOK``: small chunks and a
sleep after each), so that training steps certainly run during it and look up rows it has not reached yet: the
``checkpoint_saved`` event counts them (``precopy_rows``), and the tests require some. ``skip_hooks=1`` turns the
steps' copy-before-write off: the same check then fails, which shows the tests see a broken pre-copy.
"""

from __future__ import annotations

import pytest

from lightning_dlrover.monitor.events import KINDS, read_events
from lightning_dlrover.strategy.checkpointing import WRITE_HOOK_ENV
from tests.conftest import REPO, TRAIN_SCRIPT, digests, forked, run, train_forked, train_together

pytestmark = pytest.mark.slow
USER_MODEL = REPO / "tests" / "scripts" / "user_model.py"
SLOW_COPY = "copy_sleep=0.01,chunk_bytes=2048"


@pytest.fixture(scope="module")
def blocking(tmp_path_factory) -> tuple[dict[str, str], list]:
    """Digests (every 4 steps and at the end) and ``checkpoint_saved`` events of an uninterrupted 12-step run with
    blocking checkpoints."""
    tmp = tmp_path_factory.mktemp("straight")
    out = train_forked(tmp, "--steps", "12", "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", "4", "--digest-every",
                       "4")
    return digests(out.stdout), [e for e in read_events([tmp / "dlrover_events.jsonl"]) if e.kind == "checkpoint_saved"]


@pytest.fixture(scope="module")
def straight(blocking) -> dict[str, str]:
    return blocking[0]


def precopied(tmp_path, hook: str) -> tuple[dict[str, str], list]:
    """Digests and ``checkpoint_saved`` events of a 12-step DLRM run pre-copying a full save every 4 steps."""
    out = run(forked(TRAIN_SCRIPT, "--steps", "12", "--ckpt-dir", tmp_path / "ckpt", "--ckpt-every", "4",
                     "--digest-every",
               "4", "--async-ckpt", "precopy"), tmp_path, env={WRITE_HOOK_ENV: hook}).stdout
    saved = [e for e in read_events([tmp_path / "dlrover_events.jsonl"]) if e.kind == "checkpoint_saved"]
    return digests(out), saved


def elsewhere(tmp_path, name: str = "again"):
    (tmp_path / name).mkdir()
    return tmp_path / name


def test_precopied_checkpoint_holds_its_step_while_steps_write_rows_during_the_copy(tmp_path, straight):
    """Steps run during each copy and update rows it had not reached (``precopy_rows > 0``); the step-4 and step-8
    checkpoints restore the digests of their steps exactly, on 2 ranks and on 3."""
    saved_digests, saved = precopied(tmp_path, SLOW_COPY)
    assert saved_digests == straight, "pre-copied saves change nothing in training"
    assert {(e.step, e.rank) for e in saved} == {(s, r) for s in (4, 8, 12) for r in (0, 1)}
    assert {e["mode"] for e in saved} == {"precopy"}
    for step in (4, 8):
        assert sum(e["precopy_rows"] for e in saved if e.step == step) > 0, \
            f"no step looked up a row the step-{step} copy had not reached: the test proves nothing"
    ckpt = tmp_path / "ckpt"
    resumed4, resumed8, onto3 = (digests(job.stdout) for job in train_together(
        tmp_path, ["--steps", "12", "--digest-every", "4", "--resume", str(ckpt / "epoch=0-step=4.ckpt")],
        ["--steps", "12", "--digest-every", "4", "--resume", str(ckpt / "epoch=0-step=8.ckpt")],
        ["--devices", "3", "--steps", "9", "--resume", str(ckpt / "epoch=0-step=8.ckpt")], fork=True))
    for step, resumed in ((4, resumed4), (8, resumed8)):
        assert resumed[str(step)] == straight[str(step)], f"the step-{step} checkpoint holds the state of its step"
        assert resumed["end"] == straight["end"]
    assert onto3["8"] == straight["8"], "a pre-copied checkpoint restores onto another world size"


def test_every_committed_save_emits_checkpoint_saved_with_the_same_fields(tmp_path, blocking):
    """Blocking saves without incremental ones emit ``checkpoint_saved`` too, once per rank and save, with every field
    a pre-copied save's event has."""
    _, saved = blocking
    assert sorted((e.step, e.rank) for e in saved) == [(s, r) for s in (4, 8, 12) for r in (0, 1)]
    assert {e["mode"] for e in saved} == {"blocking"}
    assert all(e["bytes"] is not None and e["blocked_s"] > 0 for e in saved)
    assert all(set(e.fields) == set(KINDS["checkpoint_saved"]) for e in saved)


def test_without_copy_before_write_the_checkpoint_is_not_its_step(tmp_path, straight):
    """The same run with the steps' copy-before-write off (``skip_hooks=1``): rows written during the background copy
    reach the checkpoint with a later step's values, so it does not restore its step's digest. This is what the test
    above rules out."""
    _, saved = precopied(tmp_path, SLOW_COPY + ",skip_hooks=1,step=8")
    assert {e["precopy_rows"] for e in saved if e.step == 8} == {0}
    resumed = digests(train_forked(elsewhere(tmp_path), "--steps", "9", "--resume",
                            str(tmp_path / "ckpt" / "epoch=0-step=8.ckpt")).stdout)
    assert resumed["8"] != straight["8"]


def test_user_model_precopied_checkpoint_resumes_exactly(tmp_path):
    """A user's own model (exact Adagrad: a ``[rows, dim]`` optimizer state per table, BatchNorm, Adam, a
    StatefulDataLoader) pre-copying its step-6 save while steps run: a resume from it ends where the run ends."""
    first = run(forked(USER_MODEL, "--steps", "12", "--ckpt-every", "6", "--parity", "none", "--async-ckpt", "precopy",
                 "--root", tmp_path), tmp_path, env={WRITE_HOOK_ENV: "copy_sleep=0.02,chunk_bytes=256"})
    saved = [e for e in read_events([tmp_path / "dlrover_events.jsonl"]) if e.kind == "checkpoint_saved"]
    assert sum(e["precopy_rows"] for e in saved if e.step == 6) > 0
    resumed = run(forked(USER_MODEL, "--steps", "12", "--parity", "none", "--root", tmp_path / "again",
                   "--resume", tmp_path / "checkpoints" / "epoch=0-step=6.ckpt"), tmp_path)
    assert digests(resumed.stdout)["end"] == digests(first.stdout)["end"]
