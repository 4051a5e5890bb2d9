"""Sharded checkpoints: exact resume, restore into another world size, both backends."""

import pytest

from tests.conftest import digests, train

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", ["dcp", "torchsnapshot"])
def test_resume_continues_exactly(tmp_path, backend):
    straight = digests(train(tmp_path, "--steps", "16", "--batch", "64").stdout)
    ckpt = tmp_path / "ckpt"
    saved = digests(
        train(tmp_path, "--steps", "8", "--batch", "64", "--ckpt-dir", str(ckpt), "--ckpt-every", "8",
              "--backend", backend).stdout
    )
    resumed = digests(
        train(tmp_path, "--steps", "16", "--batch", "64", "--resume", str(ckpt / "epoch=0-step=8.ckpt")).stdout
    )
    assert resumed["8"] == saved["end"], "the restored state is the saved state"
    assert resumed["end"] == straight["end"], "a resumed run ends where an uninterrupted one does"
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=8.ckpt"], "no partial checkpoint left behind"


@pytest.mark.parametrize(
    ("backend", "save_ws", "load_ws"), [("dcp", 2, 3), ("dcp", 3, 2), ("torchsnapshot", 3, 2)]
)
def test_restore_into_other_world_size(tmp_path, backend, save_ws, load_ws):
    ckpt = tmp_path / "ckpt"
    saved = digests(
        train(tmp_path, "--devices", str(save_ws), "--steps", "6", "--ckpt-dir", str(ckpt), "--ckpt-every", "6",
              "--backend", backend).stdout
    )
    loaded = digests(
        train(tmp_path, "--devices", str(load_ws), "--steps", "7", "--resume", str(ckpt / "epoch=0-step=6.ckpt")).stdout
    )
    assert loaded["6"] == saved["end"]


def test_torchsnapshot_refuses_to_grow(tmp_path):
    ckpt = tmp_path / "ckpt"
    train(tmp_path, "--steps", "4", "--ckpt-dir", str(ckpt), "--ckpt-every", "4", "--backend", "torchsnapshot")
    proc = train(tmp_path, "--devices", "3", "--steps", "5", "--resume", str(ckpt / "epoch=0-step=4.ckpt"), check=False)
    assert proc.returncode != 0
    assert "cannot restore shards onto the new ranks of world size 3" in proc.stdout
    assert "checkpoint_backend='dcp'" in proc.stdout
