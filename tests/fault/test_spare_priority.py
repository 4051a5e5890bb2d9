"""Under ``lightning-dlrover launch`` a hot spare starts only once the ranks committed a step, waits at the lowest CPU
priority (``SCHED_IDLE``), and trains at normal priority once it takes a lost rank.

The supervisor runs for real (its store, its worker processes); the rank is a plain ``python -c`` sleep and the spare
runs the real spare side (:func:`lightning_dlrover.fault.inplace.protocol.take_rank_if_spare`). A spare forked from the
zygote waits before its program runs: its waiting priority is read from ``/proc``; once handed a rank, its program
writes its threads' scheduling policies to a file.
"""

import dataclasses
import json
import os
import socket
import time

import pytest

from lightning_dlrover.fault.inplace import membership, priority
from lightning_dlrover.fault.inplace.supervisor import Supervisor, SupervisorConfig, serve_store
from lightning_dlrover.monitor.events import read_events

PROGRAM = """
import json, os, sys, time
if not os.environ.get("LIGHTNING_DLROVER_SPARE"):
    time.sleep(30)
    sys.exit(0)
def policies():
    return sorted({os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")})
out = sys.argv[1]
def group_nice():  # the nice value of this session's autogroup (None without autogroups)
    try:
        return int(open("/proc/self/autogroup").read().split("nice")[1])
    except (OSError, IndexError, ValueError):
        return None
with open(out + ".group", "w") as f:
    json.dump({"sid": os.getsid(0), "waiting": group_nice()}, f)
with open(out + ".waiting", "w") as f:
    json.dump(policies(), f)
from lightning_dlrover.fault.inplace.protocol import take_rank_if_spare
assignment = take_rank_if_spare()
with open(out + ".group_promoted", "w") as f:
    json.dump(group_nice(), f)
with open(out + ".promoted", "w") as f:
    json.dump({"rank": assignment.rank, "policies": policies()}, f)
"""


def wait_for(path, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.1)
    time.sleep(0.1)  # (written in one call; let it close)
    return json.loads(path.read_text())


@pytest.fixture
def supervisor(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DLROVER_EVENTS", str(tmp_path / "events.jsonl"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store, sock = serve_store(f"127.0.0.1:{port}")
    config = SupervisorConfig(program=["-c", PROGRAM, str(tmp_path / "spare")], nproc_per_node=1, spares=1,
                              master=f"127.0.0.1:{port}")
    machine = Supervisor(config, store, "test-priority")
    try:
        yield machine
    finally:
        machine.stop()
        sock.close()


def test_a_spare_starts_after_the_first_commit_waits_idle_and_trains_at_normal_priority(supervisor, tmp_path):
    supervisor.start()
    supervisor.start_spares()
    assert [w.rank for w in supervisor.workers] == [0]  # nothing committed yet: no spare
    membership.publish_committed(supervisor.store, 0, 0, 1)  # what the ranks do after their first commit
    supervisor.start_spares()
    (spare,) = [w for w in supervisor.workers if w.rank is None]
    (started,) = [e for e in read_events([tmp_path / "events.jsonl"]) if e.kind == "spares_started"]
    assert started.step == 1 and started.fields["pids"] == [spare.process.pid]
    refused = priority.can_restore()
    assert started.fields["priority"] == ("normal" if refused else "idle"), refused
    # a spare forked from the zygote waits before its program runs (fault/inplace/spare.py): seen from outside
    deadline = time.monotonic() + 600  # an idle-priority process beside busy ones may get ~1% of a core
    while not membership.is_waiting(supervisor.store, 0, spare.spare):
        assert time.monotonic() < deadline and spare.process.poll() is None, "the spare never reached its wait"
        time.sleep(0.05)
    pid = spare.process.pid
    if refused is None:
        assert {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")} == {os.SCHED_IDLE}
    # in a session of its own, as every worker: SCHED_IDLE ranks it only inside its session's autogroup, so the
    # group itself waits at the lowest weight and trains at the ranks' (where the kernel has autogroups)
    assert os.getsid(pid) == pid
    waiting_group = priority.group_nice(pid)
    supervisor.replace([0])  # the rank is "lost": the spare takes it
    promoted = wait_for(tmp_path / "spare.promoted")
    assert promoted["rank"] == 0 and promoted["policies"] == [os.SCHED_OTHER], promoted
    if waiting_group is not None:
        assert waiting_group == priority.IDLE_GROUP_NICE
        assert wait_for(tmp_path / "spare.group_promoted") == 0
    assert spare.process.wait(timeout=60) == 0
    # the spare that refills the pool waits for the recovered generation's first commit
    assert not [w for w in supervisor.workers if w.rank is None and w.process.poll() is None]
    membership.publish_committed(supervisor.store, 0, 1, 6)
    supervisor.start_spares()
    assert len([w for w in supervisor.workers if w.rank is None]) == 1


def test_workers_get_torchruns_thread_count(supervisor, monkeypatch):
    """``torchrun`` sets ``OMP_NUM_THREADS=1`` for more than one rank per machine unless the user set it; so does
    ``launch`` (its ranks used to run one OpenMP thread per core each, oversubscribing the cores)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    two = Supervisor(dataclasses.replace(supervisor.args, nproc_per_node=2), supervisor.store, "test-threads")
    assert two.env(0, 0, None)["OMP_NUM_THREADS"] == "1" and two.env(None, 0, 0)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in supervisor.env(0, 0, None)  # one rank per machine: torchrun leaves it too
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert two.env(0, 0, None)["OMP_NUM_THREADS"] == "4"


STILL_STARTING = """
import json, os, sys, time
if not os.environ.get("LIGHTNING_DLROVER_SPARE"):
    time.sleep(30)
    sys.exit(0)
out = sys.argv[1]
def policies():
    return sorted({os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")})
with open(out + ".starting", "w") as f:  # its imports would run now, at the priority it was started with
    json.dump(policies(), f)
while not os.path.exists(out + ".go"):
    time.sleep(0.05)
with open(out + ".started", "w") as f:
    json.dump(policies(), f)
"""


def test_a_spare_handed_a_rank_while_still_starting_finishes_its_start_at_normal_priority(tmp_path, monkeypatch):
    """The launcher hands the lost rank to a spare that has not finished starting: it promotes the spare itself, so
    the rest of the start-up (imports) does not wait at ``SCHED_IDLE`` for cores other programs keep busy."""
    refused = priority.can_restore()
    if refused is not None:
        pytest.skip(f"spares start at normal priority here: {refused}")
    monkeypatch.setenv("LIGHTNING_DLROVER_EVENTS", str(tmp_path / "events.jsonl"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store, sock = serve_store(f"127.0.0.1:{port}")
    # (a spare started as a fresh interpreter: one forked from the zygote waits before its program, see test_spare_wait)
    config = SupervisorConfig(program=["-c", STILL_STARTING, str(tmp_path / "spare")], nproc_per_node=1, spares=1,
                              master=f"127.0.0.1:{port}", zygote=False)
    machine = Supervisor(config, store, "test-still-starting")
    try:
        machine.start()
        membership.publish_committed(machine.store, 0, 0, 1)
        machine.start_spares()
        assert wait_for(tmp_path / "spare.starting") == [os.SCHED_IDLE]
        machine.replace([0])  # the rank is lost while the spare is still starting
        (tmp_path / "spare.go").write_text("")
        assert wait_for(tmp_path / "spare.started") == [os.SCHED_OTHER]
    finally:
        machine.stop()
        sock.close()
