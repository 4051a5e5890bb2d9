"""Spill files: atomic private writes, each worker's share of a node's spills, and refusal of anything that could
run code, belongs to another launch of the job, or sits in a directory other users can write."""

import os
import pickle
import signal
import stat

import pytest
import torch

from lightning_dlrover.fault.coding.coded_state import SegmentSpec
from lightning_dlrover.fault.manager import sigterm_ignored
from lightning_dlrover.fault.restart.spill import (
    ProgressRecord,
    Spill,
    UnsafeSpillDir,
    ensure_private_dir,
    job_identity,
    last_committed_step,
    read_spills,
    write_spill,
)


def spill(rank: int, identity: dict | None = None) -> Spill:
    layouts = [[SegmentSpec("model/t.weight", (rank * 4, 0), (4, 2), (8, 2), 8)] for _ in range(2)]
    chunks = torch.arange(16, dtype=torch.uint8).view(2, 8) + rank
    meta = {"global_step": 3, "loops": {"fit_loop": {"x": 1}}, "state_dict": {"w": torch.ones(2)},
            "hyper_parameters": {"anything": object()}}
    rng = torch.full((2, 5), rank, dtype=torch.uint8)
    return Spill(rank, 2, 3, 2, 1, 1, 8, layouts, chunks, torch.full((1, 8), rank, dtype=torch.uint8), rng, meta,
                 identity if identity is not None else job_identity())


def test_spills_round_trip_privately_and_are_shared_out_by_local_rank(tmp_path):
    directory = tmp_path / "spills"
    for rank in (0, 1, 2, 10):
        assert write_spill(directory, spill(rank)).name == f"rank{rank}.pt"
    assert not list(directory.glob("*.partial"))
    assert oct(os.stat(directory).st_mode & 0o777) == "0o700"
    assert {oct(os.stat(p).st_mode & 0o777) for p in directory.iterdir()} == {"0o600"}
    (first, refused_a), (second, refused_b) = read_spills(directory, 0, 2), read_spills(directory, 1, 2)
    assert refused_a == refused_b == []
    assert [s.rank for s in first] == [0, 2] and [s.rank for s in second] == [1, 10]
    got, want = first[1], spill(2)
    assert torch.equal(got.chunks, want.chunks) and torch.equal(got.parity, want.parity) and torch.equal(got.rank_states, want.rank_states)
    assert got.layouts == want.layouts and got.generation == (2, 3, 2, 1, 1) and got.identity == job_identity()
    assert got.meta["loops"] == want.meta["loops"] and torch.equal(got.meta["state_dict"]["w"], torch.ones(2))
    assert "hyper_parameters" not in got.meta  # may hold arbitrary objects; not needed to resume
    assert got.path == directory / "rank2.pt"


def test_a_survivor_restarted_in_place_gets_its_own_spill_back(tmp_path):
    # Node of old ranks 2 and 3 restarted as global ranks 2, 3; rank 2 died without spilling. Ranks 0 and 1 (another
    # node's, e.g. a node that went away) are dealt out in turn.
    directory = tmp_path / "spills"
    for rank in (0, 1, 3):
        write_spill(directory, spill(rank))
    ahead = spill(3)
    ahead.step, ahead.meta, ahead.rank_states, ahead.tentative = 4, None, None, True
    write_spill(directory, ahead)
    shares = [read_spills(directory, local, 2, rank=2 + local)[0] for local in (0, 1)]
    assert [(s.rank, s.tentative) for s in shares[0]] == [(0, False)]
    assert [(s.rank, s.tentative) for s in shares[1]] == [(3, True), (3, False), (1, False)]
    # Without the global rank, in turn (what a worker of a node with other ranks gets)
    assert [s.rank for s in read_spills(directory, 1, 2)[0]] == [1, 3]


def test_a_tentative_spill_sits_beside_the_committed_one(tmp_path):
    directory = tmp_path / "spills"
    ahead = spill(2)
    ahead.step, ahead.meta, ahead.rank_states, ahead.tentative = 4, None, None, True
    assert write_spill(directory, ahead).name == "rank2.ahead.pt"
    for rank in (0, 2, 10):
        write_spill(directory, spill(rank))
    shares = [read_spills(directory, local, 2)[0] for local in (0, 1)]
    assert [(s.rank, s.step, s.tentative) for s in shares[0]] == [(0, 3, False), (2, 3, False)]
    assert [(s.rank, s.step, s.tentative) for s in shares[1]] == [(2, 4, True), (10, 3, False)]
    got = shares[1][0]
    assert got.meta is None and got.rank_states is None and torch.equal(got.chunks, ahead.chunks)


class Planted:
    """A pickle that would create a file when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path):
    directory = ensure_private_dir(tmp_path / "spills")
    write_spill(directory, spill(0))
    marker = tmp_path / "pwned"
    with open(directory / "rank1.pt", "wb") as out:
        torch.save({"header": "{}", "chunks": Planted(marker)}, out, pickle_module=pickle)
    spills, refused = read_spills(directory, 0, 1)
    assert [s.rank for s in spills] == [0]
    assert len(refused) == 1 and "rank1.pt" in refused[0] and "arbitrary code" in refused[0]
    assert not marker.exists()
    assert not (directory / "rank1.pt").exists()  # removed, so no later worker tries it


def test_spills_of_another_launch_are_refused(tmp_path):
    directory = tmp_path / "spills"
    write_spill(directory, spill(0))
    stale = {**job_identity(), "agent_pid": 1, "agent_started": 0.0}
    write_spill(directory, spill(1, stale))
    spills, refused = read_spills(directory, 0, 1)
    assert [s.rank for s in spills] == [0]
    assert "written by another launch" in refused[0] and "agent_pid': 1" in refused[0]


def test_a_directory_other_users_can_write_is_refused(tmp_path):
    directory = tmp_path / "spills"
    write_spill(directory, spill(0))
    os.chmod(directory, 0o777)
    spills, refused = read_spills(directory, 0, 1)
    assert spills == [] and "accessible to other users" in refused[0]
    with pytest.raises(UnsafeSpillDir, match="accessible to other users"):
        write_spill(directory, spill(1))
    if os.getuid() == 0:  # root can hand the directory to someone else
        os.chmod(directory, 0o700)
        os.chown(directory, 65534, 65534)
        assert "belongs to uid 65534" in read_spills(directory, 0, 1)[1][0]
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(UnsafeSpillDir, match="not a plain directory"):
        ensure_private_dir(link)


def test_partial_leftovers_and_unreadable_files_are_cleaned_up(tmp_path):
    directory = tmp_path / "spills"
    write_spill(directory, spill(0))
    (directory / "rank0.pt.123.partial").write_bytes(b"half")
    (directory / "rank1.pt").write_bytes(b"truncated")
    spills, refused = read_spills(directory, 0, 1)
    assert [s.rank for s in spills] == [0] and "unreadable" in refused[0]
    assert sorted(p.name for p in directory.iterdir()) == ["rank0.pt"]
    assert read_spills(None, 0, 1) == ([], []) and read_spills(tmp_path / "absent", 0, 1) == ([], [])


def test_progress_records_give_the_last_committed_step_of_this_launch(tmp_path):
    directory = tmp_path / "spills"
    assert last_committed_step(directory) is None
    records = [ProgressRecord(directory, rank) for rank in range(3)]
    for step, record in zip((7, 9, 8), records):
        record.write(step)
    assert last_committed_step(directory) == 9
    (directory / "progress9").write_bytes(b"LDP1" + bytes(28))  # another launch's identity (checksum differs)
    assert last_committed_step(directory) == 9
    for record in records:
        record.close(remove=True)
    assert last_committed_step(directory) is None


def test_a_drills_node_directory_creates_the_default_root_private(tmp_path):
    """A drill's spill directory (``<root>/<run>/node0``) created first on a fresh machine: the root and the run's
    directory are made 0700 too, so a later job's default spill directory under the same root is accepted (they got
    the umask's 755 and every later job refused to record progress)."""
    root = tmp_path / f"lightning_dlrover-{os.getuid()}"
    node = ensure_private_dir(root / "drill-1234" / "node0")
    for directory in (root, root / "drill-1234", node):
        assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700, directory
    assert ensure_private_dir(root / "job-5678") == root / "job-5678"  # a later job's default directory


def test_a_sigterm_while_spilling_neither_interrupts_the_write_nor_outlives_it():
    """The launcher SIGTERMs every worker when it restarts the job, and Lightning's SIGTERM handler broadcasts over the
    world group, which raises with a peer gone: inside a spill write that lost the spill a restart needed (the shrink
    that failed half-way then started over from step 0). A real SIGTERM to this process, with a handler that raises."""
    def broadcast_with_a_peer_gone(signum, frame):
        raise RuntimeError("Connection closed by peer")

    previous = signal.signal(signal.SIGTERM, broadcast_with_a_peer_gone)
    try:
        with sigterm_ignored():
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is broadcast_with_a_peer_gone
        with pytest.raises(RuntimeError, match="closed by peer"):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
