"""In-process recovery under ``lightning-dlrover launch``: a rank (or a whole machine) is SIGKILLed, the survivors
stay in ``fit`` (same processes), a hot spare (or a process started cold) takes the lost rank, and the job ends
with the digest of the same job run without a fault (and a split vote, in process and under ``torchrun``). A user's own model (tests/scripts/user_model.py: Dropout, BatchNorm, exact Adagrad
tables, Adam and SGD with momentum, an LR schedule, a StatefulDataLoader) on 2 ranks with k=1, r=1.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest

from lightning_dlrover.cli.chaos import STORE_ENV
from lightning_dlrover.fault.injector import FAULT_ENV
from lightning_dlrover.monitor.events import read_events
from tests.conftest import REPO, run, start

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "tests" / "scripts" / "user_model.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, name: str, *launch_args: str, fault: str | None = None, steps: int = 12, script_args=(),
           nproc: int = 2, env: dict[str, str] | None = None):
    """Runs the user model under the launcher (``env`` added to its environment); returns (digest, events, output)."""
    workdir = tmp_path / name
    workdir.mkdir()
    events = workdir / "events.jsonl"
    env = {"LIGHTNING_DLROVER_EVENTS": str(events), "LIGHTNING_DLROVER_PLAN_TIMEOUT": "20", **(env or {})}
    if fault:
        env["LIGHTNING_DLROVER_FAULT"] = fault
    proc = run(["-m", "lightning_dlrover", "launch", "--nproc-per-node", str(nproc), "--master", f"127.0.0.1:{free_port()}",
                *launch_args, "--", SCRIPT, "--steps", str(steps), "--root", str(workdir), *script_args], workdir, timeout=400, env=env)
    digest = re.findall(r"state digest: ([0-9a-f]{64})", proc.stdout)
    assert digest, proc.stdout[-4000:]
    return digest[-1], read_events([events]), proc.stdout


def fault_free(workdir, nproc: int = 2, script_args=(), steps: int = 12) -> str:
    """The digest of the same job without a fault, under ``lightning-dlrover launch`` with no spare (it changes
    nothing without a fault). Not under Lightning's own launcher: there rank 0 waits for the others' processes only
    the job's 20 s process-group timeout, and on a loaded machine their imports took longer (the fixture failed
    with ``DistStoreError: Timed out after 21 seconds waiting for clients``)."""
    workdir.mkdir()
    proc = run(["-m", "lightning_dlrover", "launch", "--nproc-per-node", str(nproc), "--spares", "0",
                "--master", f"127.0.0.1:{free_port()}", "--", SCRIPT, "--steps", str(steps), "--root", str(workdir),
                *script_args], workdir, timeout=400)
    digest = re.findall(r"state digest: ([0-9a-f]{64})", proc.stdout)
    assert digest, proc.stdout[-4000:]
    return digest[-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return fault_free(tmp_path_factory.mktemp("reference") / "run")


def assert_recovered_in_process(events, digest, reference, step):
    kinds = [e.kind for e in events]
    assert "restarting_all" not in kinds and "stopped" not in kinds, kinds
    recovered = [e for e in events if e.kind == "recovered_in_process"]
    assert {e.fields["survivor"] for e in recovered} == {True, False}
    assert all(e.step == step for e in recovered)
    survivor = next(e for e in recovered if e.fields["survivor"])
    final = next(e for e in events if e.kind == "digest" and e.fields["final"])
    if final.rank == survivor.rank:
        assert final.pid == survivor.pid  # the survivor trained on in the same process
    started = {(e.rank, e.pid) for e in events if e.kind == "fault_injected"}
    assert started and all(pid != survivor.pid for _, pid in started)
    assert digest == reference


def test_cold_replacement_during_the_parity_commit(tmp_path, reference):
    run_id = f"cold-{os.getpid()}-{free_port()}"
    spills = Path("/dev/shm") / f"lightning_dlrover-{os.getuid()}" / run_id  # the launch's default spill directory
    digest, events, _ = launch(tmp_path, "cold", "--spares", "0", "--run-id", run_id,
                               fault="rank=0,step=6,phase=during_parity_commit")
    leftovers = sorted(p.name for p in spills.glob("progress*"))
    shutil.rmtree(spills, ignore_errors=True)
    # The replacement took over rank 0's progress record (so a later loss of every rank knows the step it failed
    # at) and, the job done, removed it like every rank: nothing of the job is left to resume.
    assert leftovers == [], leftovers
    assert_recovered_in_process(events, digest, reference, step=6)  # the step in flight is rolled back
    planned = next(e for e in events if e.kind == "replacement_planned")
    assert planned.fields["cold"] == [0]


def test_a_checkpoint_saved_by_a_step_that_is_rolled_back_is_saved_again_by_every_rank(tmp_path, reference):
    """Both ranks save the checkpoint of step 6, then rank 1 dies in step 6's commit: the job rolls back to step 5.
    The survivor's ``ModelCheckpoint`` remembered saving step 6 and skipped the save its replacement then made (a
    collective): both hung until gloo's timeout and the job restarted every worker (found by the planner's drills)."""
    digest, events, _ = launch(tmp_path, "resave", "--spares", "0", script_args=("--ckpt-every", "6"),
                               fault="rank=1,step=5,phase=during_parity_commit")
    assert_recovered_in_process(events, digest, reference, step=5)
    saved = sorted(p.name for p in (tmp_path / "resave" / "checkpoints").iterdir())
    assert any("step=6" in name for name in saved) and any("step=12" in name for name in saved), saved


def test_losing_every_rank_falls_back_to_a_full_restart(tmp_path, reference):
    digest, events, out = launch(tmp_path, "all", "--spares", "1", fault="step=5,phase=after_optimizer,target=all",
                                 script_args=("--ckpt-every", "3"))
    kinds = [e.kind for e in events]
    assert "restarting_all" in kinds and "recovered_in_process" not in kinds, json.dumps(kinds)
    fallback = next(e for e in events if e.kind == "fallback")
    # the step the job failed at is the one every rank had committed when it was killed (measured, not assumed)
    committed = {e.fields["committed_step"] for e in events if e.kind == "fault_injected"}
    assert committed == {5} and fallback.fields["failed_step"] == 5, (committed, fallback.fields)
    assert fallback.step == 3 and fallback.fields["steps_lost"] == 5 - 3  # the checkpoint of step 3; steps 3-4 again
    assert "unknown" not in fallback.fields["why"]
    assert digest == reference  # the replay is exact


def test_a_survivor_lost_during_recovery_falls_back_to_a_full_restart(tmp_path, reference):
    digest, events, _ = launch(tmp_path, "nested", "--spares", "1", "--stop-grace", "5", script_args=("--ckpt-every", "3"),
                               fault="rank=1,step=5,phase=before_forward;rank=0,step=5,phase=during_recovery")
    kinds = [e.kind for e in events]
    assert kinds.count("replacement_planned") == 1 and "recovered_in_process" not in kinds, kinds
    restart = next(e for e in events if e.kind == "restarting_all")
    assert 0 in restart.fields["failed_ranks"] and restart.fields["reason"] == "during_recovery"  # (its replacement may fail too)
    fallback = next(e for e in events if e.kind == "fallback")
    assert fallback.step == 3  # the checkpoint of step 3
    assert digest == reference  # the replay is exact


def test_a_loss_in_the_first_step_restarts_the_job_exactly(tmp_path, reference):
    """Nothing is committed before the first step ends, so there is no state to roll back to in process: the
    survivor refuses and the job starts again (found by 20 random kills, the first at step 0)."""
    digest, events, _ = launch(tmp_path, "first", "--spares", "1", "--stop-grace", "5",
                               fault="rank=1,step=0,phase=after_optimizer")
    refused = next(e for e in events if e.kind == "in_process_refused")
    assert refused.rank == 0 and refused.fields["why"] == "nothing committed yet"
    # the hot spare starts only after the first committed step: the lost rank went to a process started cold
    planned = next(e for e in events if e.kind == "replacement_planned")
    assert planned.fields["cold"] == [1], planned.fields
    started = [e for e in events if e.kind == "spares_started"]
    assert started and all(e.step >= 1 for e in started), started  # (after the full restart)
    kinds = [e.kind for e in events]
    assert "restarting_all" in kinds and "recovered_in_process" not in kinds, kinds
    assert digest == reference


def test_hot_spares_start_after_the_first_commit_and_again_after_a_recovery(tmp_path, reference):
    """Being ready costs nothing before the job trains: the ranks start alone, the launcher starts its hot spare
    once step 1 is committed (at the lowest CPU priority where a promoted spare may leave it), the spare takes the
    lost rank, and the spare replacing it starts after the recovered job's first commit."""
    digest, events, _ = launch(tmp_path, "ready", "--spares", "1", fault="rank=1,step=5,phase=before_forward")
    assert_recovered_in_process(events, digest, reference, step=5)
    started = [e for e in events if e.kind == "spares_started"]
    planned = next(e for e in events if e.kind == "replacement_planned")
    assert [(e.fields["generation"], len(e.fields["pids"])) for e in started] == [(0, 1), (planned.fields["generation"], 1)]
    assert started[0].step >= 1 and started[1].step >= 5, started  # the first step committed in each generation
    assert started[0].fields["priority"] in ("idle", "normal")  # normal where the OS would not let it leave idle
    assert planned.fields["cold"] == []  # the spare started after step 1 was there for the loss at step 5
    replacement = next(e for e in events if e.kind == "recovered_in_process" and not e.fields["survivor"])
    assert replacement.pid == started[0].fields["pids"][0]


THREE = ("--parity", "1,2")  # k=1, r=2 on 3 ranks


@pytest.fixture(scope="module")
def reference3(tmp_path_factory):
    return fault_free(tmp_path_factory.mktemp("reference3") / "run", nproc=3, script_args=THREE)


def test_two_ranks_lost_together_at_r2_are_replaced_in_one_recovery(tmp_path, reference3):
    """k=1, r=2 on 3 ranks: ranks 1 and 2 die at the same point; one hot spare and one cold process replace
    them in one plan, and rank 0, alone, hands them the state."""
    digest, events, _ = launch(tmp_path, "double", "--spares", "1", nproc=3, script_args=THREE,
                               fault="rank=1+2,step=5,phase=before_forward")
    planned = [e for e in events if e.kind == "replacement_planned"]
    assert len(planned) == 1 and planned[0].fields["lost_ranks"] == [1, 2], planned
    assert len(planned[0].fields["cold"]) == 1  # one hot spare, the other started cold
    assert_recovered_in_process(events, digest, reference3, step=5)
    recovered = {e.rank: e.fields["survivor"] for e in events if e.kind == "recovered_in_process"}
    assert recovered == {0: True, 1: False, 2: False}


def test_a_survivor_whose_vote_broke_commits_the_step_the_others_committed(tmp_path, reference3):
    """Rank 1 dies just after the vote on step 6 completed on it; rank 2's all-gather breaks before it returns
    (injected) while rank 0's completes, so rank 0 has committed step 6 and rank 2 has not. A completed vote
    proves every rank had folded in its deltas: rank 2 commits step 6 too and the job resumes there, exactly
    (rolling rank 2 back instead would leave the ranks on different steps)."""
    digest, events, _ = launch(tmp_path, "vote", "--spares", "1", nproc=3, script_args=THREE,
                               fault="rank=1,step=5,phase=during_vote;rank=2,step=5,phase=during_vote,signal=error")
    kinds = [e.kind for e in events]
    assert "restarting_all" not in kinds and "stopped" not in kinds, kinds
    assert [(e.rank, e.step) for e in events if e.kind == "vote_completed_elsewhere"] == [(2, 6)]
    recovered = {e.rank: (e.fields["survivor"], e.step) for e in events if e.kind == "recovered_in_process"}
    assert recovered == {0: (True, 6), 1: (False, 6), 2: (True, 6)}, recovered
    assert digest == reference3


def test_a_split_vote_under_torchrun_resumes_from_the_tentative_spill(tmp_path, reference3):
    """The same split vote under ``torchrun`` (no in-process recovery): rank 2 spills its committed step 5 and,
    beside it, its state at step 6 as tentative; rank 0 spills step 6. The restarted job restores step 6 with
    only rank 1 lost (k=1, r=1: had rank 2 counted as lost too, the job would have fallen back to a checkpoint)."""
    workdir = tmp_path / "torchrun"
    workdir.mkdir()
    events = workdir / "events.jsonl"
    env = {"LIGHTNING_DLROVER_EVENTS": str(events), "LIGHTNING_DLROVER_SPILL_DIR": str(tmp_path / "spills"),
           FAULT_ENV: "rank=1,step=5,phase=during_vote;rank=2,step=5,phase=during_vote,signal=error",
           **STORE_ENV}
    proc = run(["-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=3", "--max-restarts=1",
                "--monitor-interval=0.2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                "--rdzv-id=split-vote", SCRIPT, "--steps", "12", "--root", str(workdir), "--parity", "1,1"],
               workdir, timeout=400, env=env)
    found = read_events([events])
    stopped = {e.rank: (e.step, e.fields["tentative_step"]) for e in found if e.kind == "stopped"}
    assert stopped[2] == (5, 6) and stopped[0] == (6, None), stopped
    restored = [(e.step, e.fields["lost_ranks"]) for e in found if e.kind == "restored"]
    assert restored == [(6, [1])], [e.kind for e in found]
    assert re.findall(r"state digest: ([0-9a-f]{64})", proc.stdout)[-1] == reference3


def two_machines(tmp_path, name: str, fault: str | None = None, spares: int = 1) -> tuple[str, list, int]:
    """Runs the user model under two launchers (machines) with one rank and ``spares`` hot spares each, ``fault``
    set on machine 1 only; returns (digest, events, machine 1's exit code)."""
    workdir = tmp_path / name
    workdir.mkdir()
    events = workdir / "events.jsonl"
    env = {"LIGHTNING_DLROVER_EVENTS": str(events), "LIGHTNING_DLROVER_PLAN_TIMEOUT": "20"}
    launcher = [sys.executable, "-m", "lightning_dlrover", "launch", "--nnodes", "2", "--nproc-per-node", "1",
                "--master", f"127.0.0.1:{free_port()}", "--run-id", name, "--spares", str(spares)]
    program = ["--", SCRIPT, "--steps", "12", "--root", str(workdir)]
    machine0 = start([*launcher, "--node-rank", "0", *program], workdir, env)
    machine1 = start([*launcher, "--node-rank", "1", *program], workdir, {**env, **({FAULT_ENV: fault} if fault else {})})
    try:
        out, _ = machine0.communicate(timeout=400)
        assert machine0.returncode == 0, out[-4000:]
        code = machine1.wait(timeout=60)
    finally:
        for proc in (machine0, machine1):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return re.findall(r"state digest: ([0-9a-f]{64})", out)[-1], read_events([events]), code


@pytest.fixture(scope="module")
def machines_reference(tmp_path_factory):
    # One rank per machine shards differently from two ranks on one machine; spares change nothing without a fault.
    digest, _, code = two_machines(tmp_path_factory.mktemp("machines"), "reference", spares=0)
    assert code == 0
    return digest


def test_hot_spare_on_the_lost_ranks_machine_takes_it_before_forward(tmp_path, machines_reference):
    """Two machines with one rank each: rank 1 dies, and machine 1's launcher (whose only rank it was) hands it to
    its own hot spare; rank 0 on machine 0 survives."""
    digest, events, code = two_machines(tmp_path, "hot", fault="rank=1,step=5,phase=before_forward")
    assert code == 0
    assert_recovered_in_process(events, digest, machines_reference, step=5)
    planned = next(e for e in events if e.kind == "replacement_planned")
    assert planned.fields["lost_ranks"] == [1] and planned.fields["cold"] == []


def test_a_machine_lost_with_its_launcher_is_replaced_by_machine_0(tmp_path, machines_reference):
    """Machine 1 dies whole (its launcher, rank and spare, as ``target=node`` does); machine 0's launcher notices
    the silent heartbeat and replaces rank 1 with its own hot spare."""
    reference = machines_reference
    digest, events, code = two_machines(tmp_path, "lost", fault="step=5,phase=before_forward,target=node")
    assert code == -signal.SIGKILL  # the whole machine went down
    lost = next(e for e in events if e.kind == "node_lost")
    assert lost.fields["node"] == 1 and lost.fields["ranks"] == [1]
    planned = next(e for e in events if e.kind == "replacement_planned")
    assert planned.fields["lost_ranks"] == [1] and planned.fields["cold"] == []  # machine 0's hot spare
    assert_recovered_in_process(events, digest, reference, step=5)
