"""Sharded checkpoints: exact resume, restore into another world size, both backends."""

import pytest

from lightning_dlrover.monitor.events import read_events
from tests.conftest import digests, train_forked

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``backend -> (digests, checkpoint dir)`` of one uninterrupted 2-rank run of 16 steps that saves a checkpoint
    at steps 8 and 16 with ``backend`` and prints the digest at steps 8 and 16 (run once per backend, read by
    several tests)."""
    runs = {}

    def get(backend: str):
        if backend not in runs:
            tmp = tmp_path_factory.mktemp(f"uninterrupted-{backend}")
            ckpt = tmp / "ckpt"
            out = train_forked(tmp, "--steps", "16", "--ckpt-dir", str(ckpt), "--ckpt-every", "8", "--digest-every",
                               "8", "--backend", backend).stdout
            runs[backend] = digests(out), ckpt
        return runs[backend]

    return get


@pytest.mark.parametrize("backend", ["dcp", "torchsnapshot"])
def test_resume_continues_exactly(tmp_path, uninterrupted, backend):
    """A run resumed from the checkpoint of step 8 starts from exactly the state saved at step 8 and ends where the
    uninterrupted run ends; the checkpoint directory holds only the complete checkpoints (no partial one)."""
    straight, ckpt = uninterrupted(backend)
    resumed = digests(train_forked(tmp_path, "--steps", "16", "--resume", str(ckpt / "epoch=0-step=8.ckpt")).stdout)
    assert resumed["8"] == straight["8"], "the restored state is the saved state"
    assert resumed["end"] == straight["end"], "a resumed run ends where an uninterrupted one does"
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=16.ckpt", "epoch=0-step=8.ckpt"], \
        "no partial checkpoint left behind"


def test_a_run_resumed_at_its_last_step_ends_as_a_finished_one(tmp_path, uninterrupted):
    """Resumed from the checkpoint of its last step (what a restart after the final commit also is), Lightning skips the
    done fit loop and with it the strategy's ``on_train_end``; the strategy's teardown runs it instead: the final digest
    is the uninterrupted run's (before: none was printed, and a chaos drill killed there reported a mismatch)."""
    straight, ckpt = uninterrupted("dcp")
    resumed = digests(train_forked(tmp_path, "--steps", "16", "--resume", str(ckpt / "epoch=0-step=16.ckpt")).stdout)
    assert resumed.get("end") == straight["end"], resumed


def test_dcp_restores_into_a_larger_world_size(tmp_path, uninterrupted):
    """A dcp checkpoint saved by 2 ranks restores exactly onto 3. The pooled embeddings' key order moved with the plan:
    the job records it, without a warning, since the DLRM reads them by key (a model reading them by position would
    see its features permuted)."""
    saved, ckpt = uninterrupted("dcp")
    proc = train_forked(tmp_path, "--devices", "3", "--steps", "9", "--resume", str(ckpt / "epoch=0-step=8.ckpt"))
    assert digests(proc.stdout)["8"] == saved["8"]
    [moved] = [e for e in read_events([tmp_path / "dlrover_events.jsonl"]) if e.kind == "feature_order_changed"]
    assert moved.fields["how"].startswith("loaded") and moved.fields["before"] != moved.fields["after"]
    assert "orders the pooled embeddings anew" not in proc.stdout


@pytest.mark.parametrize(("backend", "save_ws", "load_ws"), [("dcp", 3, 2), ("torchsnapshot", 3, 2)])
def test_restore_into_other_world_size(tmp_path, backend, save_ws, load_ws):
    ckpt = tmp_path / "ckpt"
    saved = digests(
        train_forked(tmp_path, "--devices", str(save_ws), "--steps", "6", "--ckpt-dir", str(ckpt), "--ckpt-every", "6",
              "--backend", backend).stdout
    )
    loaded = digests(
        train_forked(tmp_path, "--devices", str(load_ws), "--steps", "7", "--resume",
                     str(ckpt / "epoch=0-step=6.ckpt")).stdout
    )
    assert loaded["6"] == saved["end"]


def test_torchsnapshot_refuses_to_grow(tmp_path, uninterrupted):
    """A torchsnapshot checkpoint of 2 ranks does not restore onto 3: the error names the fix (dcp)."""
    _, ckpt = uninterrupted("torchsnapshot")
    proc = train_forked(tmp_path, "--devices", "3", "--steps", "9", "--resume", str(ckpt / "epoch=0-step=8.ckpt"),
                        check=False)
    assert proc.returncode != 0
    assert "cannot restore shards onto the new ranks of world size 3" in proc.stdout
    assert "checkpoint_backend='dcp'" in proc.stdout
