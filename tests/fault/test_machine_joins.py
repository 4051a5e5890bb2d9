"""A machine joining a running job: ``lightning-dlrover launch --node-rank K`` with ``--nnodes <= K < --max-nnodes``,
started while the job trains (``fault/inplace/join.py``). Its ranks join at a commit boundary and no running rank
restarts; what a grow promises is checked on the whole training state: its digest after the grow equals the committed
state's before it.

Real processes: two launchers on 127.0.0.1 (machine 0 with its store, then machine 1), the user's own model
(tests/scripts/user_model.py: Dropout, BatchNorm, exact Adagrad tables, Adam, its own StatefulDataLoader; k=1 r=1).
The refusals run the supervisors for real on a real store, with plain ``python -c`` sleeps as their workers."""

import contextlib
import os
import re
import signal
import socket
import sys
import time

import pytest

from lightning_dlrover import worker_env
from lightning_dlrover.cli.launch import parse
from lightning_dlrover.fault.inplace import join, membership
from lightning_dlrover.fault.inplace.store import PREFIX
from lightning_dlrover.fault.inplace.supervisor import Supervisor, SupervisorConfig, serve_store
from lightning_dlrover.monitor.events import read_events
from tests.conftest import start
from tests.fault.test_in_process import SCRIPT, free_port


def grown_rank(events, rank: int):
    """The ``grown_in_process`` event of ``rank`` once it is written, else ``None``."""
    found = read_events([events]) if events.exists() else []
    return next((e for e in found if e.kind == "grown_in_process" and e.rank == rank), None)


def check_reported(events) -> bool:
    """Whether rank 0 reported the state check after the grow (``resize_verified``)."""
    return any(e.kind == "resize_verified" for e in read_events([events]))


@pytest.mark.slow
def test_a_machine_started_later_joins_the_running_job_in_process_and_its_lost_rank_is_replaced(tmp_path):
    """Machine 0 runs 2 ranks with room for a second machine (``--max-nnodes 2``); once the job committed its first
    step, machine 1's launcher starts (``--node-rank 1``, one rank): its process sets up beside training, and joins as
    rank 2 at a commit boundary, while ranks 0 and 1 grow in their own processes with the state the job committed.
    Then rank 2's process is killed: machine 1's launcher replaces it in process, as any machine's."""
    events = tmp_path / "events.jsonl"
    env = {"LIGHTNING_DLROVER_EVENTS": str(events), "LIGHTNING_DLROVER_PLAN_TIMEOUT": "20",
           "LIGHTNING_DLROVER_VERIFY_RESIZE": "1"}
    address = f"127.0.0.1:{free_port()}"
    launcher = [sys.executable, "-m", "lightning_dlrover", "launch", "--max-nnodes", "2", "--master", address,
                "--run-id", "joined", "--spares", "0"]
    # 3 s a step while short: the job outlasts the new machine's set-up (imports and all) on a loaded machine; 1 s
    # after, until the test killed the joined rank: the kill lands before the end
    killed = tmp_path / "killed"
    program = ["--", SCRIPT, "--steps", "24", "--root", str(tmp_path), "--slow-while-short", "3",
               "--slow-until-world", "3", "--slow-after", "1", "--slow-after-until", str(killed)]
    machine0 = start([*launcher, "--nproc-per-node", "2", *program], tmp_path, env)
    machine1 = None
    try:
        store = membership.connect(address, timeout=300)
        deadline = time.monotonic() + 300
        while membership.committed(store, 0, 0) is None:  # the job trains: a machine is added to it now
            assert time.monotonic() < deadline and machine0.poll() is None, "the job never committed a step"
            time.sleep(0.2)
        machine1 = start([*launcher, "--node-rank", "1", "--nproc-per-node", "1", *program], tmp_path, env)
        # the kill comes once rank 0 reported the check of the grown state: a loss during that check is recovered
        # from as well (the repeated recovery of tests/strategy/test_rerun_fit_loop.py), but is then never reported
        while (joined := grown_rank(events, 2)) is None or not check_reported(events):
            assert time.monotonic() < deadline and machine0.poll() is None, "machine 1's rank never joined"
            time.sleep(0.1)
        os.kill(joined.pid, signal.SIGKILL)
        killed.touch()
        out0, _ = machine0.communicate(timeout=400)
        out1, _ = machine1.communicate(timeout=60)
    finally:
        for proc in (machine0, machine1):
            with contextlib.suppress(ProcessLookupError, AttributeError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert (machine0.returncode, machine1.returncode) == (0, 0), (out0[-4000:], out1[-4000:])
    found = read_events([events])
    kinds = [e.kind for e in found]
    assert not {"restarting_all", "in_process_refused", "grow_failed", "join_refused"} & set(kinds), out0[-4000:]
    (offered,) = [e for e in found if e.kind == "join_offered"]
    assert offered.fields["node"] == 1 and len(offered.fields["spares"]) == 1
    (planned,) = [e for e in found if e.kind == "grow_planned"]
    assert (planned.fields["node"], planned.fields["joined_ranks"], planned.fields["world_size"]) == (1, [2], 3)
    grown = [e for e in found if e.kind == "grown_in_process"]
    assert sorted((e.rank, e.fields["survivor"], e.fields["world_size"]) for e in grown) == [
        (0, True, 3), (1, True, 3), (2, False, 3)]
    assert len({e.step for e in grown}) == 1  # one commit boundary
    assert joined.pid == offered.fields["pids"][0]  # the process machine 1 started
    verified = next(e for e in found if e.kind == "resize_verified")
    assert verified.fields["equal"] and verified.fields["world_size"] == 3 and verified.step == grown[0].step
    (replaced,) = [e for e in found if e.kind == "replacement_planned"]
    assert replaced.pid == machine1.pid and replaced.fields["lost_ranks"] == [2]  # by machine 1's launcher
    recovered = [e for e in found if e.kind == "recovered_in_process"]
    assert sorted((e.rank, e.fields["survivor"]) for e in recovered) == [(0, True), (1, True), (2, False)]
    survivors = {e.rank: e.pid for e in grown if e.fields["survivor"]}
    assert {e.rank: e.pid for e in recovered if e.fields["survivor"]} == survivors  # the same processes throughout
    final = next(e for e in found if e.kind == "digest" and e.fields["final"])
    digest = re.findall(r"state digest: ([0-9a-f]{64})", out0)
    assert digest and (final.step, final.pid, final.fields["digest"]) == (24, survivors[0], digest[-1])


SLEEP = "import time; time.sleep(30)"


@pytest.fixture
def job(tmp_path, monkeypatch):
    """Machine 0's supervisor of a 2-rank job (sleeps) with room for ``--max-nnodes 2`` machines of 1 rank each:
    2 ranks in all, so no machine's rank fits beside the running ones. Yields (machine 0, a new machine's config)."""
    monkeypatch.setenv("LIGHTNING_DLROVER_EVENTS", str(tmp_path / "events.jsonl"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store, sock = serve_store(f"127.0.0.1:{port}")
    common = dict(program=["-c", SLEEP], nnodes=1, nproc_per_node=1, spares=0, max_nnodes=2, zygote=False,
                  master=f"127.0.0.1:{port}")
    machine0 = Supervisor(SupervisorConfig(node_rank=0, **common), store, "test-join")
    machine0.start()
    machine0.live_world = 2  # (as after a grow by the job's own request: the room is used up)
    try:
        yield machine0, SupervisorConfig(node_rank=1, **common)
    finally:
        machine0.stop()
        sock.close()


def test_a_machine_past_the_jobs_room_is_refused_and_its_launcher_stops(job, tmp_path, monkeypatch):
    machine0, config1 = job
    told = machine0.job_env()  # what its workers read: the room, and what a new machine's launcher needs (the advisor)
    monkeypatch.setenv(worker_env.JOIN_ENV, told[worker_env.JOIN_ENV])
    assert worker_env.join_room() == {"max_nnodes": 2, "nproc_per_node": 1, "master": config1.master}
    machine1 = Supervisor(config1, membership.connect(config1.master), "test-join")
    try:
        assert join.offer(machine1) is None and machine1.capacity == 2
        (spare,) = machine1.offered
        assert join.admit(machine0, None) is None  # its process has not said it waits yet
        machine0.store.add(PREFIX + f"0/waiting/{spare}", 1)  # (what the process says once set up)
        assert join.admit(machine0, recovering=4) is None  # a recovery in progress: the join waits for it
        assert join.admit(machine0, None) is None and 1 in machine0.joined  # refused: no generation published
        assert join.taken(machine1) == join.CAPACITY
    finally:
        machine1.stop()
    refused = [e for e in read_events([tmp_path / "events.jsonl"]) if e.kind == "join_refused"]
    assert [(e.fields["node"], e.fields["why"]) for e in refused] == [(1, "capacity")] * 2
    assert "launch every machine with a larger --max-nnodes" in refused[0].fields["reason"]
    assert membership.is_done(machine0.store, 0, 1)  # machine 0 does not wait for it at the end
    assert machine0.others_finished()


def test_a_machine_whose_job_ended_before_it_joined_leaves(job, tmp_path):
    machine0, config1 = job
    machine1 = Supervisor(config1, membership.connect(config1.master), "test-join")
    try:
        assert join.offer(machine1) is None
        assert join.taken(machine1) is None  # offered, waiting for its turn
        membership.mark_done(machine0.store, 0, 0)
        assert join.taken(machine1) == join.JOB_ENDED
    finally:
        machine1.stop()
    (refused,) = [e for e in read_events([tmp_path / "events.jsonl"]) if e.kind == "join_refused"]
    assert refused.fields["why"] == "job_ended" and "start this launcher again" in refused.fields["reason"]


def test_a_joined_machine_leaves_when_the_job_restarts_every_worker(job, tmp_path):
    """Machine 1's process took rank 1 of a job grown to 2 ranks (machine 0 at 1 rank, as after a shrink); then machine
    0 restarts every worker (its next launch beats): machine 1's ranks are not in the new launch, and its launcher
    leaves, saying so."""
    machine0, config1 = job
    machine0.live_world = 1
    machine1 = Supervisor(config1, membership.connect(config1.master), "test-join")
    try:
        assert join.offer(machine1) is None
        (spare,) = machine1.offered
        machine0.store.add(PREFIX + f"0/waiting/{spare}", 1)
        generation = join.admit(machine0, None)
        assert generation is not None and machine0.live_world == 2
        assert join.taken(machine1) is None  # its process took its rank
        assert [w.rank for w in machine1.workers] == [1] and machine1.live_world == 2
        assert membership.node_ranks(machine0.store, 0, 1) == [1]
        assert join.taken(machine1) is None  # a member of the job
        membership.heartbeat(machine0.store, 1, 0)  # machine 0's launcher in its next launch
        assert join.taken(machine1) == join.JOB_ENDED
        machine0.stop(grace=0.0)  # machine 0's full restart, as run() does it: machine 1 is not waited for at the end
        machine0.restarts += 1
        machine0.start()
        assert machine0.others_finished()
    finally:
        machine1.stop()
    (refused,) = [e for e in read_events([tmp_path / "events.jsonl"]) if e.kind == "join_refused"]
    assert refused.fields["why"] == "job_ended" and "restarted every worker" in refused.fields["reason"]


def test_room_for_more_machines_is_checked_up_front():
    for extra in (["--max-nnodes", "1", "--nnodes", "2"], ["--max-nnodes", "2", "--node-rank", "2"],
                  ["--max-nnodes", "2", "--no-in-process"]):
        with pytest.raises(SystemExit):
            parse(["--nproc-per-node", "2", *extra, "--", "train.py"])
    assert parse(["--nproc-per-node", "2", "--", "train.py"]).max_nnodes == 1
    assert parse(["--max-nnodes", "3", "--node-rank", "2", "--", "train.py"]).node_rank == 2
