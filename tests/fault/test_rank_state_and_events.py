"""Per-rank state (generators, buffers), the events file, and the launcher facts the strategy checks at start-up."""

import random

import numpy as np
import pytest
import torch

from lightning_dlrover.fault import rank_state
from lightning_dlrover.worker_env import MIN_NODES_ENV, node_range
from lightning_dlrover.monitor.events import EVENTS_ENV, emit, read_events
from lightning_dlrover.strategy.sharding import check_elastic_sizes


def draws():
    return torch.rand(3), np.random.randn(2), random.random(), random.gauss(0, 1), np.random.randn()


def test_rank_state_restores_every_generator_and_the_buffers():
    torch.manual_seed(3), np.random.seed(4), random.seed(5), np.random.randn(), random.gauss(0, 1)
    buffers = [torch.arange(4.0), torch.tensor(7)]
    state = rank_state.capture_rank(buffers)
    expected = draws()
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    live = [torch.zeros(4), torch.tensor(0)]
    rank_state.restore_rank(rank_state.pad(state, state.numel() + 64), live)
    got = draws()
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1]) and expected[2:] == got[2:]
    assert torch.equal(live[0], buffers[0]) and int(live[1]) == 7


def test_events_are_schema_checked_json_lines(tmp_path, monkeypatch):
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(EVENTS_ENV, str(path))
    emit("restored", step=12, old_world_size=4, world_size=4, lost_ranks=[0, 1], decode_s=0.01, reshard_s=0.02)
    emit("digest", step=13, digest="ab" * 32, final=True)
    events = read_events([path, tmp_path / "missing.jsonl"])
    assert [e.kind for e in events] == ["restored", "digest"]
    assert events[0].step == 12 and events[0]["lost_ranks"] == [0, 1] and events[1]["final"] is True
    with pytest.raises(ValueError, match="unknown event kind"):
        emit("exploded")
    with pytest.raises(ValueError, match="has no fields"):
        emit("resumed", colour="red")
    path.write_text('{"schema": 99, "kind": "resumed"}\n')
    with pytest.raises(ValueError, match="schema 99"):
        read_events([path])


def test_node_range_from_the_environment(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert node_range() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("PET_NNODES", "1:3")
    assert node_range() == (1, 3)  # this process's parent is no torchrun agent: the variable is used
    monkeypatch.setenv(MIN_NODES_ENV, "2")
    assert node_range() == (2, 2)


def test_elastic_sizes_are_checked_against_every_world_size():
    check_elastic_sizes([4, 8], 480, (2, 1))
    with pytest.raises(ValueError, match=r"k \+ r = 2 \+ 2 needs 4 ranks, but the job may shrink to 2 ranks"):
        check_elastic_sizes([2, 4], 480, (2, 2))
    with pytest.raises(ValueError, match=r"not divisible by the world sizes \[9\].*multiple of 18"):
        check_elastic_sizes([3, 6, 9], 480, None)
