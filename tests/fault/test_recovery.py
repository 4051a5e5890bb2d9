"""Spill files: atomic write, each worker's share of a node's spills, unreadable files skipped."""

import torch

from lightning_dlrover.fault.coded_state import SegmentSpec
from lightning_dlrover.fault.recovery import Spill, read_spills, write_spill


def spill(rank: int) -> Spill:
    layouts = [[SegmentSpec("model/t.weight", (rank * 4, 0), (4, 2), (8, 2), 8)] for _ in range(2)]
    chunks = torch.arange(16, dtype=torch.uint8).view(2, 8) + rank
    meta = {"global_step": 3, "loops": {"fit_loop": {}}}
    return Spill(rank, 2, 3, 2, 1, 1, 8, layouts, chunks, torch.full((1, 8), rank, dtype=torch.uint8), meta)


def test_spills_round_trip_and_are_shared_out_by_local_rank(tmp_path):
    for rank in (0, 1, 2, 10):
        assert write_spill(tmp_path, spill(rank)).name == f"rank{rank}.pt"
    assert not list(tmp_path.glob("*.partial"))
    first, second = read_spills(tmp_path, 0, 2), read_spills(tmp_path, 1, 2)
    assert [s.rank for s in first] == [0, 2] and [s.rank for s in second] == [1, 10]
    got, want = first[1], spill(2)
    assert torch.equal(got.chunks, want.chunks) and torch.equal(got.parity, want.parity)
    assert got.layouts == want.layouts and got.meta == want.meta and got.generation == (2, 3, 2, 1, 1)
    assert got.path == tmp_path / "rank2.pt"


def test_missing_directory_and_unreadable_spills_are_skipped(tmp_path):
    assert read_spills(None, 0, 1) == [] and read_spills(tmp_path / "absent", 0, 1) == []
    write_spill(tmp_path, spill(0))
    (tmp_path / "rank1.pt").write_bytes(b"truncated")
    assert [s.rank for s in read_spills(tmp_path, 0, 1)] == [0]
