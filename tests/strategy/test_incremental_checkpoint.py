"""Incremental checkpoints (``DLRoverStrategy(incremental_checkpoint_every=N)``) in real 2-rank jobs: a resume from a
delta in the middle of a chain restores the state of its step exactly (our DLRM and a user's own model), also onto
another world size; a delta whose write was killed never counts and the previous link is used, exactly; a delta
whose write failed gives its rows to the next one; a chain with a missing link restores its newest complete prefix
(an event and a warning say so); links ``ModelCheckpoint`` removes are kept aside while a delta needs them and
deleted once a new chain has started.
"""

from __future__ import annotations

import json
import os
import re
import signal
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
    """Digests (every 4 steps and at the end) of an uninterrupted 16-step run with full blocking checkpoints."""
    tmp = tmp_path_factory.mktemp("straight")
    return digests(train_forked(tmp, "--steps", "16", "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", "4",
                         "--digest-every", "4").stdout)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """``(digests, checkpoint dir, events, output)`` of a 16-step run saving asynchronously every 4 steps, a full
    checkpoint every 4 saves: step 4 full, steps 8, 12 and 16 deltas."""
    tmp = tmp_path_factory.mktemp("chain")
    out = train_forked(tmp, "--steps", "16", "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", "4", "--digest-every",
                       "4",
                "--async-ckpt", "--incremental", "4").stdout
    return digests(out), tmp / "ckpt", read_events([tmp / "dlrover_events.jsonl"]), out


def link(path) -> dict:
    return json.loads((path / "dlrover.json").read_text()).get("incremental")


def size(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def names(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def elsewhere(tmp_path):
    """A fresh working directory for a second job of the same test."""
    (tmp_path / "again").mkdir()
    return tmp_path / "again"


def test_resume_from_a_delta_in_the_middle_of_a_chain(tmp_path, straight, chain):
    """Saving deltas changes nothing in training; the step-8 checkpoint is the first delta of the chain begun at
    step 4, smaller than the full one, and a resume from it continues exactly."""
    saved, ckpt, events, _ = chain
    assert saved == straight
    links = {p.name: link(p) for p in ckpt.iterdir()}
    assert [links[f"epoch=0-step={s}.ckpt"]["link"] for s in (4, 8, 12, 16)] == [0, 1, 2, 3]
    assert len({entry["chain"] for entry in links.values()}) == 1
    assert size(ckpt / "epoch=0-step=8.ckpt") < size(ckpt / "epoch=0-step=4.ckpt")
    saves = sorted((e.step, e.rank, e["link"]) for e in events if e.kind == "checkpoint_saved")
    assert saves == [(s, r, i) for i, s in enumerate((4, 8, 12, 16)) for r in (0, 1)]
    assert all(e["rows"] > 0 for e in events if e.kind == "checkpoint_saved" and e["link"])

    resumed = digests(train_forked(tmp_path, "--steps", "16", "--digest-every", "4", "--incremental", "4",
                            "--resume", str(ckpt / "epoch=0-step=8.ckpt")).stdout)
    assert resumed["8"] == straight["8"], "full + one delta restore the state of step 8 bit for bit"
    assert resumed["end"] == straight["end"]


def test_a_chain_restores_onto_another_world_size(tmp_path, straight, chain):
    """Full + two deltas written by 2 ranks restore onto 3 (rows are stored by global index)."""
    _, ckpt, _, _ = chain
    loaded = digests(train_forked(tmp_path, "--devices", "3", "--steps", "13", "--resume",
                           str(ckpt / "epoch=0-step=12.ckpt")).stdout)
    assert loaded["12"] == straight["12"]


def test_a_missing_link_restores_the_newest_complete_prefix(tmp_path, straight, chain):
    """With the first delta gone, a resume from the second restores the full link (step 4), says so in an event and
    a warning, and still ends where the uninterrupted run ends."""
    _, ckpt, _, _ = chain
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for step in (4, 12):
        os.symlink(ckpt / f"epoch=0-step={step}.ckpt", copy / f"epoch=0-step={step}.ckpt")
    out = train_forked(tmp_path, "--steps", "16", "--digest-every", "4", "--resume",
                       str(copy / "epoch=0-step=12.ckpt")).stdout
    assert "link 1 of the incremental checkpoint chain" in out and "newest complete prefix" in out
    broken = [e for e in read_events([tmp_path / "dlrover_events.jsonl"]) if e.kind == "checkpoint_chain_broken"]
    assert [(e.step, e["missing_link"], os.path.basename(e["used"])) for e in broken] == [(4, 1, "epoch=0-step=4.ckpt")]
    resumed = digests(out)
    assert resumed["4"] == straight["4"] and resumed["end"] == straight["end"]


def test_killed_delta_write_leaves_the_previous_link(tmp_path, straight):
    """The whole job is SIGKILLed while the step-12 delta is being written (every rank's rows and shards are written,
    not committed): the step-8 delta is the newest checkpoint, and a resume from it continues exactly."""
    ckpt = tmp_path / "ckpt"
    job = start([sys.executable, str(TRAIN_SCRIPT), "--steps", "16", "--ckpt-dir", str(ckpt), "--ckpt-every", "4",
                 "--async-ckpt", "--incremental", "4"], tmp_path, env={WRITE_HOOK_ENV: "sleep=120,step=12,rank=1"})
    try:
        written = ckpt / "epoch=0-step=12.ckpt.partial" / "sharded" / ".metadata"
        deadline = time.monotonic() + 150
        while not written.exists():
            if job.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the job ended or hung before its step-12 delta was written")
            time.sleep(0.2)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
    newest = latest_checkpoint(ckpt)
    assert newest.name == "epoch=0-step=8.ckpt" and link(newest)["link"] == 1
    resumed = digests(train_forked(elsewhere(tmp_path), "--steps", "16", "--digest-every", "4", "--resume",
                                   str(newest)).stdout)
    assert resumed["8"] == straight["8"] and resumed["end"] == straight["end"]


def test_failed_delta_gives_its_rows_to_the_next(tmp_path, straight):
    """The step-8 delta's write fails (ENOSPC on rank 1): the step-12 delta follows the full link directly and holds
    the rows changed since step 4, so a resume from it is exact."""
    ckpt = tmp_path / "ckpt"
    out = run(forked(TRAIN_SCRIPT, "--steps", "12", "--ckpt-dir", ckpt, "--ckpt-every", "4", "--async-ckpt",
               "--incremental", "4", "--digest-every", "4"), tmp_path,
              env={WRITE_HOOK_ENV: "fail=ENOSPC,step=8,rank=1"}).stdout
    assert names(ckpt) == ["epoch=0-step=12.ckpt", "epoch=0-step=4.ckpt"]
    assert link(ckpt / "epoch=0-step=12.ckpt")["link"] == 1
    resumed = digests(train_forked(elsewhere(tmp_path), "--steps", "16", "--digest-every", "4",
                            "--resume", str(ckpt / "epoch=0-step=12.ckpt")).stdout)
    assert digests(out)["12"] == straight["12"] == resumed["12"]


def test_removed_links_wait_for_the_next_chain(tmp_path, straight):
    """``ModelCheckpoint(save_top_k=1)`` removes each checkpoint after the next: the links a delta needs are kept
    aside (hidden) and the newest delta restores exactly; once a new chain's full save has committed and the old
    chain's last visible link is removed, the old chain is deleted."""
    ckpt = tmp_path / "ckpt"
    train_forked(tmp_path, "--steps", "12", "--ckpt-dir", str(ckpt), "--ckpt-every", "4", "--incremental", "3",
          "--save-top-k", "1")
    assert [n for n in names(ckpt) if not n.startswith(".")] == ["epoch=0-step=12.ckpt"]
    assert [link(p)["link"] for p in sorted(ckpt.glob(".*"))] == [0, 1], "links 0 and 1 are kept aside"
    resumed = digests(train_forked(elsewhere(tmp_path), "--steps", "13", "--resume",
                                   str(ckpt / "epoch=0-step=12.ckpt")).stdout)
    assert resumed["12"] == straight["12"]

    longer = tmp_path / "longer"
    train_forked(tmp_path, "--steps", "16", "--ckpt-dir", str(longer), "--ckpt-every", "4", "--incremental", "3",
          "--save-top-k", "1")
    assert names(longer) == ["epoch=0-step=16.ckpt"], "the old chain is deleted once nothing needs it"
    assert link(longer / "epoch=0-step=16.ckpt")["link"] == 0


def test_last_ckpt_overwritten_link_by_link(tmp_path, straight):
    """``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` right after each periodic save, over the previous one:
    each ``last.ckpt`` is a link of the chain, and the one it replaces is kept aside for the later links that need it,
    so a resume from ``last.ckpt`` (three deltas down the chain) is exact."""
    ckpt = tmp_path / "ckpt"
    train_forked(tmp_path, "--steps", "12", "--ckpt-dir", str(ckpt), "--ckpt-every", "4", "--incremental", "8",
          "--save-last")
    last = ckpt / "last.ckpt"
    assert link(last)["link"] == 5, "step 4, last, step 8, last, step 12, last: links 0-5"
    assert len(list(ckpt.glob(".dlrover-link-*"))) == 2, "the two earlier last.ckpt kept aside"
    resumed = digests(train_forked(elsewhere(tmp_path), "--steps", "16", "--digest-every", "4", "--resume",
                                   str(last)).stdout)
    assert resumed["12"] == straight["12"] and resumed["end"] == straight["end"]


def test_user_model_with_parity_resumes_from_a_delta(tmp_path):
    """A user's own model (BatchNorm, Dropout, exact Adagrad: a ``[rows, dim]`` optimizer state, a
    StatefulDataLoader) with parity on and blocking saves every 3 steps, a full one every 3 saves: a resume from the
    second delta (step 9) ends where the run that wrote it ends."""
    first = run(forked(USER_MODEL, "--steps", "12", "--ckpt-every", "3", "--incremental", "3", "--root", tmp_path),
                       tmp_path)
    ckpt = tmp_path / "checkpoints"
    assert [link(ckpt / f"epoch=0-step={s}.ckpt")["link"] for s in (3, 6, 9, 12)] == [0, 1, 2, 0]
    resumed = run(forked(USER_MODEL, "--steps", "12", "--incremental", "3", "--root", tmp_path / "again",
                   "--resume", ckpt / "epoch=0-step=9.ckpt"), tmp_path)
    assert digests(resumed.stdout)["end"] == digests(first.stdout)["end"]


def test_export_refuses_a_delta_and_names_what_to_export(tmp_path, chain):
    """``export`` of a delta (it holds only the rows changed since the previous link) is refused with an error naming
    the link and what to export instead; nothing is written."""
    from lightning_dlrover.export import BadCheckpoint, export_checkpoint

    _, ckpt, _, _ = chain
    with pytest.raises(BadCheckpoint, match=r"epoch=0-step=8.ckpt is a delta of an incremental checkpoint chain "
                                            r"\(link 1\).*Export the chain's full checkpoint"):
        export_checkpoint(ckpt / "epoch=0-step=8.ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_staging_memory_is_known_before_the_first_save(chain):
    """Before its first save (after the first step), the strategy tells the advisor's OOM forecast how much staging
    memory the save will allocate (``checkpoint_staging_bytes``): what the first save then reports staging
    (``checkpoint_staging``), within 5% (the trainer state's few small tensors aside: random generator states)."""
    _, _, events, out = chain
    [announced] = re.findall(r"^checkpoint staging bytes: (\d+)$", out, re.MULTILINE)
    [staged] = [e["bytes"] for e in events if e.kind == "checkpoint_staging" and e.rank == 0]
    assert int(announced) == pytest.approx(staged, rel=0.05)
