"""Asynchronous checkpoints (``DLRoverStrategy(async_checkpoint=True)``) in real 2-rank jobs: the checkpoint holds
the state of the step it was taken at although training goes on while it is written, a second save waits for the
one in flight, a rank killed in the middle of a background write leaves the previous checkpoint the newest and a
resume from it continues exactly, a failed write (disk full, an unwritable directory) is an event and training
goes on, and a save after ``fit`` is complete when the process exits.

The background writer is slowed or failed through its real hook (``$LIGHTNING_DLROVER_CHECKPOINT_WRITE_HOOK``: a
sleep or an ``OSError`` inside the writer thread, after the shards are written and before ``meta.pt`` and the commit).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lightning_dlrover.checkpoint.directory import latest_checkpoint
from lightning_dlrover.monitor.events import read_events
from lightning_dlrover.strategy.checkpointing import WRITE_HOOK_ENV
from tests.conftest import REPO, TRAIN_SCRIPT, digests, forked, run, start, train_forked

pytestmark = pytest.mark.slow
USER_MODEL = REPO / "tests" / "scripts" / "user_model.py"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[str, str]:
    """Digests (every 4 steps and at the end) of an uninterrupted 16-step run with blocking checkpoints."""
    tmp = tmp_path_factory.mktemp("straight")
    return digests(train_forked(tmp, "--steps", "16", "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", "4",
                         "--digest-every", "4").stdout)


def names(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def elsewhere(tmp_path):
    """A fresh working directory for a second job of the same test."""
    (tmp_path / "again").mkdir()
    return tmp_path / "again"


def test_slow_background_write_holds_its_step_and_the_next_save_waits(tmp_path, straight):
    """While the step-8 checkpoint is still being written (its writer sleeps), training goes on to step 12, whose
    save waits for it; the step-8 checkpoint holds the state of step 8 (a resume from it continues exactly) and the
    run ends with the digest of a run with blocking checkpoints."""
    ckpt = tmp_path / "ckpt"
    out = run(forked(TRAIN_SCRIPT, "--steps", "16", "--ckpt-dir", ckpt, "--ckpt-every", "4", "--digest-every", "4",
               "--async-ckpt"), tmp_path, env={WRITE_HOOK_ENV: "sleep=8,step=8"}).stdout
    assert digests(out) == straight, "asynchronous saves change nothing in training"
    assert names(ckpt) == [f"epoch=0-step={s}.ckpt" for s in (12, 16, 4, 8)], "every save committed, none partial"
    events = read_events([tmp_path / "dlrover_events.jsonl"])
    waited = [e for e in events if e.kind == "checkpoint_waited"]
    assert {(e.rank, e.step, os.path.basename(e["path"])) for e in waited} == {
        (0, 8, "epoch=0-step=12.ckpt"), (1, 8, "epoch=0-step=12.ckpt")}, "the step-12 save waited for step 8's"
    assert {e.step for e in events if e.kind == "checkpoint_saved"} == {4, 8, 12, 16}
    staging = [e for e in events if e.kind == "checkpoint_staging"]
    assert len(staging) == 2 and all(e["bytes"] > 0 for e in staging), "staging memory reported up front"

    resumed = digests(train_forked(elsewhere(tmp_path), "--steps", "16", "--digest-every", "4", "--async-ckpt",
                            "--resume", str(ckpt / "epoch=0-step=8.ckpt")).stdout)
    assert resumed["8"] == straight["8"], "the checkpoint holds the state of its step, not of a later one"
    assert resumed["end"] == straight["end"]


def test_rank_killed_during_background_write_keeps_the_previous_checkpoint(tmp_path, straight):
    """Rank 1 is SIGKILLed while its writer is inside the step-8 save (shards written, no commit): the step-8
    checkpoint never counts, the step-4 one is the newest, and a resume from it continues exactly. ``ModelCheckpoint``
    keeps one checkpoint (``save_top_k=1``), so it asks for step 4's removal right after asking for step 8: the
    removal waits for step 8's commit, which never comes."""
    ckpt = tmp_path / "ckpt"
    job = start([sys.executable, str(TRAIN_SCRIPT), "--steps", "16", "--ckpt-dir", str(ckpt), "--ckpt-every", "4",
                 "--async-ckpt", "--pg-timeout", "60", "--save-top-k", "1"], tmp_path,
                env={WRITE_HOOK_ENV: "sleep=120,step=8,rank=1"})
    try:
        shards = ckpt / "epoch=0-step=8.ckpt.partial" / "sharded" / ".metadata"
        deadline = time.monotonic() + 150
        while not shards.exists():  # every rank's shards of step 8 are written; rank 1's writer sleeps now
            if job.poll() is not None or time.monotonic() > deadline:
                os.killpg(job.pid, signal.SIGKILL)
                out = job.communicate()[0]
                pytest.fail(f"the job ended or hung before its step-8 shards were written:\n{out[-4000:]}")
            time.sleep(0.2)
        rank1 = {e.pid for e in read_events([tmp_path / "dlrover_events.jsonl"]) if e.rank == 1}
        assert len(rank1) == 1
        os.kill(rank1.pop(), signal.SIGKILL)
        try:
            job.wait(timeout=60)  # rank 0 fails on the dead peer (or is killed below)
        except subprocess.TimeoutExpired:
            pass
    finally:
        if not job.stdout.closed:
            try:
                os.killpg(job.pid, signal.SIGKILL)  # what is left of the job
            except ProcessLookupError:
                pass
            job.communicate()
    assert latest_checkpoint(ckpt).name == "epoch=0-step=4.ckpt", "the interrupted save does not count"
    assert not (ckpt / "epoch=0-step=8.ckpt").exists()

    resumed = digests(train_forked(elsewhere(tmp_path), "--steps", "16", "--digest-every", "4",
                            "--resume", str(latest_checkpoint(ckpt))).stdout)
    assert resumed["4"] == straight["4"]
    assert resumed["end"] == straight["end"], "the resumed run continues exactly"


def test_failed_background_write_is_an_event_and_training_goes_on(tmp_path, straight):
    """Rank 1's write of the step-8 checkpoint fails with ENOSPC (disk full): both ranks record
    ``checkpoint_failed``, a warning names the newest complete checkpoint, nothing of step 8 is left, and training
    goes on (later saves commit and hold their step's state, the run ends as one without the failure)."""
    ckpt = tmp_path / "ckpt"
    out = run(forked(TRAIN_SCRIPT, "--steps", "16", "--ckpt-dir", ckpt, "--ckpt-every", "4", "--digest-every", "4",
               "--async-ckpt"), tmp_path, env={WRITE_HOOK_ENV: "fail=ENOSPC,step=8,rank=1"}).stdout
    assert digests(out)["end"] == straight["end"]
    assert names(ckpt) == [f"epoch=0-step={s}.ckpt" for s in (12, 16, 4)]
    failed = [e for e in read_events([tmp_path / "dlrover_events.jsonl"]) if e.kind == "checkpoint_failed"]
    assert sorted((e.rank, e.step) for e in failed) == [(0, 8), (1, 8)]
    by_rank = {e.rank: e for e in failed}
    assert by_rank[1]["error_type"] == "OSError" and "No space left on device" in by_rank[1]["error"]
    assert os.path.basename(by_rank[0]["kept"]) == "epoch=0-step=4.ckpt"
    assert "was not saved" in out and "No space left on device" in out
    # the step-12 save copied into the staging memory of the failed one: it holds the state of step 12
    resumed = digests(train_forked(elsewhere(tmp_path), "--steps", "16", "--digest-every", "4",
                            "--resume", str(ckpt / "epoch=0-step=12.ckpt")).stdout)
    assert resumed["12"] == straight["12"] and resumed["end"] == straight["end"]


def test_user_model_async_resume_and_saves_after_fit(tmp_path):
    """A user's own model (BatchNorm, Dropout, exact Adagrad, Adam, a StatefulDataLoader) with asynchronous saves:
    a resume from the step-6 checkpoint ends where the run that wrote it ends; after ``fit``, a save into an
    unwritable place (under a regular file) is a ``checkpoint_failed`` event, and a good save right before the
    process exits is complete."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    first = run([USER_MODEL, "--steps", "12", "--ckpt-every", "6", "--parity", "none", "--async-ckpt", "--root",
                 tmp_path, "--save-after", blocker / "x.ckpt", "--save-after", tmp_path / "after.ckpt"], tmp_path)
    failed = [e for e in read_events([tmp_path / "dlrover_events.jsonl"]) if e.kind == "checkpoint_failed"]
    assert failed and {e["error_type"] for e in failed} == {"NotADirectoryError"}
    assert latest_checkpoint(tmp_path).name == "after.ckpt", "the save before exit is complete"
    assert sorted(p.name for p in tmp_path.glob("*.partial")) == []
    resumed = run([USER_MODEL, "--steps", "12", "--parity", "none", "--async-ckpt", "--root", tmp_path / "again",
                   "--resume", tmp_path / "checkpoints" / "epoch=0-step=6.ckpt"], tmp_path)
    assert digests(resumed.stdout)["end"] == digests(first.stdout)["end"]
