"""The control plane (``lightning_dlrover.control_plane``): a gloo group of its own beside the default group when
asked (the suite asks for it: tests/conftest.py) or when the default group is not gloo; the default group itself
otherwise. Real processes, real gloo groups."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_dlrover import control_plane
from lightning_dlrover.fault import rank_state
from lightning_dlrover.monitor import state_digest
from tests.conftest import exit_rank


def _worker(rank: int, path: str, choice: str, world: int) -> None:
    os.environ[control_plane.CONTROL_GROUP_ENV] = choice
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    control_plane.init()
    group = control_plane.group()
    if choice == "separate":
        assert group is not None and group is not dist.group.WORLD
        assert dist.get_process_group_ranks(group) == list(range(world))
        assert dist.get_backend(group) == "gloo"
    else:
        assert group is None
    assert control_plane.group() is group, "made once per default group"
    # what the package sends over it: every rank's generators and buffers, and a digest of a rank-sharded tensor
    torch.manual_seed(rank)
    buffers = [torch.full((3,), float(rank))]
    mine = rank_state.capture_rank(buffers)
    states = rank_state.gather_ranks(buffers)
    assert states.shape[0] == world and torch.equal(states[rank, : mine.numel()], mine)
    assert not torch.equal(states[0], states[1]), "each rank's own row"
    digest = state_digest({"w": torch.arange(12, dtype=torch.float32).view(3, 4)})
    box = [digest]
    dist.broadcast_object_list(box, src=0)  # the default group still works beside it
    assert box[0] == digest
    dist.destroy_process_group()
    exit_rank()


@pytest.mark.parametrize("choice", ["separate", "shared"])
def test_control_plane_beside_the_default_group(tmp_path, choice):
    mp.spawn(_worker, args=(str(tmp_path / "store"), choice, 2), nprocs=2, join=True)


def test_an_unknown_choice_is_refused(monkeypatch):
    monkeypatch.setenv(control_plane.CONTROL_GROUP_ENV, "nccl")
    with pytest.raises(ValueError, match="LIGHTNING_DLROVER_CONTROL_GROUP='nccl': use one of"):
        control_plane._separate("gloo")


def test_a_non_gloo_default_group_always_gets_a_gloo_control_group(monkeypatch):
    monkeypatch.setenv(control_plane.CONTROL_GROUP_ENV, "shared")
    assert control_plane._separate("nccl") and not control_plane._separate("gloo")
    assert not control_plane._separate("dlrover_gloo"), "the reconfigurable world group is its own control plane"
