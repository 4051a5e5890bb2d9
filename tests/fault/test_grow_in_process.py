"""Grow in process (``launch --regrow``): after a shrink, the launcher starts a process in the background and, once it
waits set up, the job grows back to its launch size at a step boundary, with no worker restarted.

End to end with a user's own model (tests/scripts/user_model.py: Dropout, BatchNorm, exact Adagrad tables, Adam with
an LR schedule, its own StatefulDataLoader; k=1 r=1) on 3 ranks: rank 0 is SIGKILLed before step 6, ranks 1 and 2
train on as ranks 0 and 1 of 2, then a new process joins as rank 2. What the grow promises is checked on the whole
training state: its digest after the grow (3 ranks) equals the committed state's before it (2 ranks)."""

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_dlrover.cli.launch import parse
from lightning_dlrover.fault.inplace import membership
from lightning_dlrover.fault.coding import reserve
from lightning_dlrover.fault.inplace.grow import GAVE_UP, Regrow, memory_refusal
from lightning_dlrover.fault.inplace.shrink import WOULD_NOT_FIT
from lightning_dlrover.fault.inplace.store import serve_store
from lightning_dlrover.fault.inplace.supervisor import Supervisor
from lightning_dlrover.fault.inplace.workers import SupervisorConfig, Worker
from lightning_dlrover.monitor.events import EVENTS_ENV, read_events
from tests.fault.test_in_process import launch
from tests.fault.test_node_loss import drill


def kill_the_first_grow_spare(events_path, stop: threading.Event) -> list[int]:
    """Watches the launcher's events and SIGKILLs the first process it starts to grow the job, before it is set up."""
    killed: list[int] = []
    while not stop.wait(0.02) and not killed:
        started = [e for e in read_events([events_path]) if e.kind == "grow_started"] if events_path.exists() else []
        if started:
            os.kill(started[0].fields["spare_pid"], signal.SIGKILL)
            killed.append(started[0].fields["spare_pid"])
    return killed


@pytest.mark.slow
def test_the_survivors_of_a_shrink_grow_back_to_the_launch_size_in_their_own_processes(tmp_path):
    """The first process started for the grow is killed while it sets up (as an out-of-memory kill would): the launcher
    starts another, and the job grows with that one."""
    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=lambda: killed.extend(kill_the_first_grow_spare(tmp_path / "grow" / "events.jsonl",
                                                                                       stop)))
    watcher.start()
    try:  # the job sleeps 1 s a step while it runs short: 50 s for the new process to set up on a loaded machine
        digest, events, output = launch(tmp_path, "grow", "--spares", "0", "--no-cold-start", "--regrow", nproc=3,
                                        fault="rank=0,step=6,phase=before_forward", steps=56,
                                        script_args=("--slow-while-short", "1.0"),
                                        env={"LIGHTNING_DLROVER_VERIFY_RESIZE": "1"})
    finally:
        stop.set()
        watcher.join()
    kinds = [e.kind for e in events]
    assert not {"restarting_all", "grow_failed", "grow_abandoned"} & set(kinds), output[-4000:]
    started = [e.fields["spare_pid"] for e in events if e.kind == "grow_started"]
    assert len(killed) == 1 and started == [killed[0], started[1]], (killed, started)
    shrunk = {e.rank: e.pid for e in events if e.kind == "shrunk_in_process"}
    assert len(shrunk) == 2, kinds
    planned = next(e for e in events if e.kind == "grow_planned")
    assert (planned.fields["joined_ranks"], planned.fields["world_size"]) == ([2], 3)
    grown = [e for e in events if e.kind == "grown_in_process"]
    assert len(grown) == 3 and len({e.step for e in grown}) == 1, grown
    # the survivors grew in the processes that shrank; the new rank is the process the launcher started for it
    assert {e.rank: e.pid for e in grown if e.fields["survivor"]} == shrunk
    joined = [e for e in grown if not e.fields["survivor"]]
    assert [(e.rank, e.pid) for e in joined] == [(2, planned.fields["pids"]["2"])] == [(2, started[1])]
    assert all(e.fields["old_world_size"] == 2 and e.fields["world_size"] == 3 for e in grown)
    verified = next(e for e in events if e.kind == "resize_verified")
    assert verified.fields["equal"] and verified.step == grown[0].step, verified.fields
    # the job trained its last steps at 3 ranks, to the end, and rank 0 is still the process that shrank
    final = next(e for e in events if e.kind == "digest" and e.fields["final"])
    assert final.step == 56 and final.pid == shrunk[0] and final.fields["digest"] == digest


def test_regrow_is_refused_up_front_without_a_shrink_to_grow_back_from():
    for extra in ([], ["--no-cold-start", "--nnodes", "2"], ["--no-cold-start", "--no-in-process"]):
        with pytest.raises(SystemExit):
            parse(["--regrow", *extra, "--", "train.py"])
    assert parse(["--regrow", "--no-cold-start", "--spares", "0", "--", "train.py"]).regrow


def test_a_grow_plan_assigns_the_next_rank_and_asks_the_running_generation_to_grow():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    shrink = membership.publish_shrink_plan(store, 0, [0], 3)
    assert not membership.resize_requested(store, 0, shrink.generation)
    index = membership.register_spare(store, 0)
    plan = membership.publish_grow_plan(store, 0, 2, {2: index})
    assert plan.generation == shrink.generation + 1 and plan.grow and not plan.shrinks
    assert membership.resize_requested(store, 0, shrink.generation)
    read = membership.wait_for_plan(store, 0, plan.generation, timeout=1)
    assert read == plan and (read.lost, read.replacements, read.world_size) == ([], {2: index}, 3)
    assignment = membership.wait_for_assignment(store, 0, index, wait_s=1)
    assert (assignment.rank, assignment.world_size, assignment.generation) == (2, 3, plan.generation)


def test_a_job_that_finishes_before_the_new_rank_joined_ends_and_stops_it(tmp_path, monkeypatch):
    monkeypatch.setenv(EVENTS_ENV, str(tmp_path / "events.jsonl"))
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    done.wait()
    running, pending = Worker(done, 0), Worker(waiting, 1, spare=0)
    regrow = Regrow(joining=pending)
    assert regrow.finished_without([running, pending])
    assert waiting.poll() is not None and pending.rank is None and regrow.joining is None
    assert [(e.fields["why"], e.fields["reason"]) for e in read_events([tmp_path / "events.jsonl"])
            if e.kind == "grow_abandoned"] == [(GAVE_UP, "the job finished before the new rank joined it")]
    still = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert not Regrow(joining=pending).finished_without([Worker(still, 0), pending])  # a rank still trains
    finally:
        still.kill()
        still.wait()


SPARE = """
import os
from lightning_dlrover.fault.inplace import membership
store = membership.connect()
membership.wait_for_assignment(store, 0, int(os.environ[membership.SPARE_ENV]))  # (what a set-up spare does)
"""


def test_the_memory_a_grow_needs():
    mib = 2**20
    # a job at 2 ranks of 30 MiB each: the 3 ranks of the larger world build 60 MiB of new shares
    assert memory_refusal(30 * mib, 2, 1000 * mib, 940 * mib, 500 * mib) is None
    message = memory_refusal(30 * mib, 2, 1000 * mib, 941 * mib, 500 * mib)
    assert "allocate 60 MiB" in message and "59 MiB left" in message and "--memory-limit-gb" in message, message
    assert memory_refusal(30 * mib, 2, 1000 * mib, 0, 59 * mib) is not None  # what the machine can still hand out
    assert memory_refusal(0, 2, 1000 * mib, 999 * mib, 0) is None  # nothing published: nothing known


@pytest.mark.parametrize("limit_gb", [0.1, None])
def test_the_launcher_grows_only_what_this_machines_memory_can_take(tmp_path, monkeypatch, limit_gb):
    """The launcher's side of a grow after a shrink from 3 to 2 ranks, with a real store and a real process started
    to join (it waits for its rank as a set-up spare does). Under a job memory limit of 0.1 GB, below what this
    machine's processes already hold, the grow is not published: the process is stopped and the grow given up once
    (``grow_abandoned``, ``would_not_fit``, with the numbers). With no limit, the plan is published for rank 2."""
    monkeypatch.setenv(EVENTS_ENV, str(tmp_path / "events.jsonl"))
    store, sock = serve_store("127.0.0.1:0")
    master = f"127.0.0.1:{sock.getsockname()[1]}"
    args = SupervisorConfig(program=["-c", SPARE], nproc_per_node=3, spares=0, master=master, zygote=False,
                            cold_start=False, regrow=True,
                            memory_limit_bytes=int(limit_gb * 2**30) if limit_gb else None)
    sup = Supervisor(args, store, "grow-memory", live_world=2)
    reserve.publish(store, 0, 30 * 2**20)  # (what the ranks publish: the largest rank's coded state)
    regrow = Regrow()
    try:
        assert regrow.tick(sup, None) is None and regrow.spare is not None  # started the process to join
        spare = regrow.spare
        for _ in range(600):  # until it waits for its rank (importing torch takes seconds on a loaded machine)
            generation = regrow.tick(sup, None)
            if regrow.spare is None:
                break
            time.sleep(0.1)
        events = read_events([tmp_path / "events.jsonl"])
        if limit_gb:
            assert generation is None and spare.process.poll() is not None and regrow.abandoned
            (abandoned,) = [e for e in events if e.kind == "grow_abandoned"]
            assert abandoned.fields["why"] == WOULD_NOT_FIT and "allocate 60 MiB" in abandoned.fields["reason"]
            assert "grow_planned" not in [e.kind for e in events]
            assert regrow.tick(sup, None) is None and regrow.spare is None  # given up: no new process
        else:
            assert generation is not None and regrow.joining is spare and spare.rank == 2 and sup.live_world == 3
            planned = next(e for e in events if e.kind == "grow_planned")
            assert (planned.fields["joined_ranks"], planned.fields["world_size"]) == ([2], 3)
            assignment = membership.wait_for_assignment(store, 0, spare.spare, wait_s=5)
            assert (assignment.rank, assignment.world_size) == (2, 3)
            assert spare.process.wait(timeout=60) == 0  # it was handed its rank
    finally:
        for worker in sup.workers:
            worker.process.kill()
            worker.process.wait()
        sock.close()


def test_the_launchers_grow_target_is_what_the_job_asked_for(tmp_path, monkeypatch):
    """With a real ``Supervisor`` and store: after a shrink the job asked for, ``--regrow`` does not grow it back (the
    asked size is the job's size); without ``--regrow`` nothing grows until the job asks, and a grow it asks for past
    the launch size (room for 4, launched at 3) starts the process that will join (``grow_started``, ``asked``)."""
    monkeypatch.setenv(EVENTS_ENV, str(tmp_path / "events.jsonl"))
    store, sock = serve_store("127.0.0.1:0")
    master = f"127.0.0.1:{sock.getsockname()[1]}"
    args = SupervisorConfig(program=["-c", SPARE], nproc_per_node=3, spares=0, master=master, zygote=False,
                            cold_start=False, regrow=True)
    shrunk = Supervisor(args, store, "asked-shrink", live_world=2)
    shrunk.regrow.ask(shrunk, 2)  # (what the launcher does once it published the shrink the job asked for)
    assert shrunk.regrow.tick(shrunk, None) is None and shrunk.regrow.spare is None
    roomy = Supervisor(SupervisorConfig(program=["-c", SPARE], nproc_per_node=3, max_nproc_per_node=4, spares=0,
                                        master=master, zygote=False), store, "asked-grow", live_world=3)
    try:
        assert roomy.regrow.tick(roomy, None) is None and roomy.regrow.spare is None  # nothing asked, no --regrow
        roomy.regrow.ask(roomy, 4)
        assert roomy.regrow.tick(roomy, None) is None and roomy.regrow.spare is not None
        (started,) = [e for e in read_events([tmp_path / "events.jsonl"]) if e.kind == "grow_started"]
        assert started.fields["asked"] and (started.fields["world_size"], started.fields["target_world_size"]) == (3, 4)
        assert roomy.job_env()["LIGHTNING_DLROVER_MAX_WORLD_SIZE"] == "4"
    finally:
        for worker in roomy.workers:
            worker.process.kill()
            worker.process.wait()
        sock.close()


@pytest.mark.slow
def test_chaos_drills_a_shrink_and_a_grow_back_in_process_with_our_dlrm(tmp_path):
    """``chaos --in-process --shrink --regrow`` on the chaos DLRM (``lightning-dlrover fit``, its data module): rank 0
    killed before step 6 with no spare, the survivors shrink to 2 ranks, a new process joins as rank 2; the report
    says both happened, nothing was lost, and the state after the grow equals the committed state before it."""
    # the shrunk job sleeps 1 s a step until the new process joined: it lasts for the set-up however fast its steps
    slow = '{"class_path": "tests.elastic.elastic_job.SlowWhileShort", "init_args": {"seconds": 1.0, "world_size": 3}}'
    summary = drill(str(tmp_path), "--in-process", "--shrink", "--regrow", "--nodes", "1", "--nproc-per-node", "3",
                    "--kill-rank", "0", "--at-step", "6", "--", "--trainer.max_steps=40", f"--trainer.callbacks+={slow}")
    assert summary["recovered"].startswith("yes, shrunk in process from 3 to 2 ranks"), summary
    assert summary["steps lost"] == "0" and summary["job finished"] == "yes", summary
    assert summary["grown in process"].startswith("from 2 to 3 ranks at step"), summary
    assert summary["state after the grow equals the committed state before it"] == "yes", summary
    assert "grow pause" in summary and "new process set up" in summary
