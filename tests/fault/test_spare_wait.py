"""A hot spare forked from the launcher's zygote waits for a rank right after the fork, before any of its program runs
(``fault/inplace/spare.py``): waiting costs nothing (no CPU, none of the program's set-up), and once handed a rank it
runs its program as that rank.

The supervisor runs for real (its store, its zygote, its forked workers); the program is a plain ``python -c`` that
records when and as which rank it started.
"""

import json
import os
import socket
import time

import pytest

from lightning_dlrover.fault.inplace import membership, priority, spare, zygote
from lightning_dlrover.fault.inplace.supervisor import Supervisor, SupervisorConfig, serve_store
from lightning_dlrover.monitor.events import read_events

PROGRAM = """
import json, os, sys, time
started = {"rank": os.environ.get("RANK"), "time": time.time(), "spare": os.environ.get("LIGHTNING_DLROVER_SPARE")}
if not started["spare"]:
    time.sleep(60)
    sys.exit(0)
with open(sys.argv[1] + ".started", "w") as f:  # the program's first line ran: its set-up would run now
    json.dump(started, f)
from lightning_dlrover.fault.inplace.protocol import take_rank_if_spare
assignment = take_rank_if_spare()
with open(sys.argv[1] + ".took", "w") as f:
    json.dump({"rank": assignment.rank, "time": time.time()}, f)
"""


def wait_for(path, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.05)
    time.sleep(0.05)
    return json.loads(path.read_text())


def cpu_ticks(pid: int) -> int:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.fixture
def supervisor(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DLROVER_EVENTS", str(tmp_path / "events.jsonl"))
    # what the spare's wait needs, imported once in the zygote (what is tested is the wait, not torch's import time)
    monkeypatch.setenv(zygote.PRELOAD_ENV, "lightning_dlrover.fault.inplace.spare")
    monkeypatch.setenv(spare.SETUP_ENV, "late")  # (what `auto` picks where the ranks take every core, as on CI)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store, sock = serve_store(f"127.0.0.1:{port}")
    config = SupervisorConfig(program=["-c", PROGRAM, str(tmp_path / "spare")], nproc_per_node=2, spares=1,
                              master=f"127.0.0.1:{port}")
    machine = Supervisor(config, store, "test-spare-wait")
    try:
        yield machine
    finally:
        machine.stop()
        sock.close()


def test_a_forked_spare_waits_before_its_program_and_runs_it_as_the_rank_it_takes(supervisor, tmp_path):
    supervisor.start()
    membership.publish_committed(supervisor.store, 0, 0, 1)  # what the ranks do after their first commit
    supervisor.start_spares()
    (spare,) = [w for w in supervisor.workers if w.rank is None]
    assert spare.forked
    deadline = time.monotonic() + 600  # an idle-priority process beside busy ones may get ~1% of a core
    while not membership.is_waiting(supervisor.store, 0, spare.spare):
        assert time.monotonic() < deadline and spare.process.poll() is None, "the spare never reached its wait"
        time.sleep(0.05)
    ticks = cpu_ticks(spare.process.pid)
    time.sleep(2.0)
    # waiting: none of the program ran (its set-up comes once it holds a rank), and the wait itself uses no CPU
    assert not (tmp_path / "spare.started").exists()
    assert cpu_ticks(spare.process.pid) - ticks <= 2
    if priority.can_restore() is None:
        assert os.sched_getscheduler(spare.process.pid) == os.SCHED_IDLE
    (old,) = [w for w in supervisor.workers if w.rank == 1]
    supervisor.replace([1])  # rank 1 is "lost": the spare takes it
    old.process.kill()
    old.process.wait()
    (planned,) = [e for e in read_events([tmp_path / "events.jsonl"]) if e.kind == "replacement_planned"]
    assert planned.fields["readiness"] == {"1": "waiting"}, planned.fields
    started = wait_for(tmp_path / "spare.started")
    assert started["rank"] == "1", started  # the program starts as the rank it took (not as the spare's placeholder)
    assert wait_for(tmp_path / "spare.took")["rank"] == 1
    assert spare.process.wait(timeout=60) == 0
    ready = [e for e in read_events([tmp_path / "events.jsonl"]) if e.kind == "spare_ready"]
    assert [e.fields["spare"] for e in ready] == [spare.spare] and ready[0].time < started["time"], ready


def test_a_spare_sets_up_late_only_where_the_ranks_take_every_core(monkeypatch):
    """``auto``: late where this machine's ranks take every core (a set-up beside them takes steps from training),
    early where a core is free (the set-up then costs nothing, and a recovery is only the join); the variable wins."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv(spare.SETUP_ENV, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert spare.sets_up_late()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores - 1))
    assert not spare.sets_up_late()  # a core left free: early
    monkeypatch.setenv(spare.SETUP_ENV, "late")
    assert spare.sets_up_late()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    monkeypatch.setenv(spare.SETUP_ENV, "early")
    assert not spare.sets_up_late()
