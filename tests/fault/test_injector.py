"""``FaultInjector``: parsing and validation, and real multi-process jobs that lose a rank at each phase."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_dlrover import DLRoverStrategy, ParityConfig
from lightning_dlrover.fault.injector import FAULT_ENV, FaultInjector
from tests.conftest import REPO, TRAIN_SCRIPT, digests, run

# The process-group timeout bounds how long the surviving ranks wait for a killed one (gloo sees a SIGKILLed peer's
# sockets close at once, so only a silent peer waits it out); under Lightning's launcher it also bounds how long the
# ranks wait for each other's processes to start, which on a loaded machine took more than 20 s (the client socket
# "timed out after 20000ms while trying to connect").
KILL_JOB = [str(TRAIN_SCRIPT), "--pg-timeout", "90", "--no-step-digests"]
JOB_TIMEOUT = 400


def run_job(args: list[str], cwd: Path, fault: str | None) -> subprocess.CompletedProcess:
    """Runs ``python *args`` with ``FAULT_ENV=fault`` (when given); fails the test after ``JOB_TIMEOUT`` seconds."""
    return run(args, cwd, timeout=JOB_TIMEOUT, check=False, env={FAULT_ENV: fault} if fault is not None else None)


# --- parsing and validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("rank=1,step=5,phase=after_optimizer", (1, 5, "after_optimizer", "SIGKILL")),
        (" phase=before_forward , step=0, rank=2 ", (2, 0, "before_forward", "SIGKILL")),
        ("rank=0,step=3,phase=during_parity_commit,signal=SIGTERM", (0, 3, "during_parity_commit", "SIGTERM")),
        ("step=3,phase=before_forward,target=node", (0, 3, "before_forward", "SIGKILL", "node")),
        ("rank=2+1,step=3,phase=before_forward", ([1, 2], 3, "before_forward", "SIGKILL")),
    ],
)
def test_parses_env_value(value, expected):
    injector = FaultInjector.from_env(value)
    assert (injector.rank, injector.step, injector.phase, injector.signal, injector.target) == (*expected, "rank")[:5]


def test_several_faults_joined_by_semicolons():
    first, second = FaultInjector.all_from_env("rank=1,step=5,phase=before_forward; rank=0,step=5,phase=during_recovery")
    assert (first.rank, first.phase, second.rank, second.phase) == (1, "before_forward", 0, "during_recovery")
    assert FaultInjector.all_from_env(" ") == []
    with pytest.raises(ValueError, match="missing phase"):
        FaultInjector.all_from_env("rank=1,step=5,phase=before_forward;rank=0,step=5")


def test_reads_environment(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "rank=1,step=4,phase=before_forward")
    assert repr(FaultInjector.from_env()) == (
        "FaultInjector(rank=1, step=4, phase='before_forward', signal='SIGKILL', target='rank')"
    )
    for unset in ("", "  "):
        monkeypatch.setenv(FAULT_ENV, unset)
        assert FaultInjector.from_env() is None
    monkeypatch.delenv(FAULT_ENV)
    assert FaultInjector.from_env() is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("rank=1,step=5", "missing phase; the format is rank=R[+R...],step=S,phase=P"),
        ("rank=1;step=5;phase=before_forward", "is not key=value; the format is rank=R[+R...],step=S,phase=P"),
        ("1,5,before_forward", "'1' is not key=value"),
        ("rank=1,step=5,phase=", "'phase=' is not key=value"),
        ("rank=1,step=5,phase=before_forward,when=now", "unknown key 'when'"),
        ("rank=1,rank=2,step=5,phase=before_forward", "'rank' is given twice"),
        ("rank=one,step=5,phase=before_forward", "rank='one' is not an integer"),
        ("rank=1+x,step=5,phase=before_forward", "rank='1+x' is not an integer"),
        ("rank=1,step=5.5,phase=before_forward", "step='5.5' is not an integer"),
        ("rank=-1,step=5,phase=before_forward", "rank=-1 must be an integer >= 0"),
        ("rank=1,step=-2,phase=before_forward", "step=-2 must be an integer >= 0"),
        ("rank=1,step=5,phase=backward", "phase='backward' is not one of ['before_forward', 'after_optimizer', "
                                         "'during_parity_commit', 'during_vote', 'during_recovery']"),
        ("rank=1,step=5,phase=before_forward,signal=SIGINT", "signal='SIGINT' is not one of ['SIGKILL', 'SIGTERM', 'error']"),
        ("step=5,phase=during_vote,signal=error,target=node", "target='node' needs a real signal"),
        ("step=5,phase=before_forward", "missing rank"),
        ("rank=1,step=5,phase=before_forward,target=rack", "target='rack' is not one of ['rank', 'node', 'all']"),
    ],
)
def test_bad_env_value(value, message):
    with pytest.raises(ValueError) as err:
        FaultInjector.from_env(value)
    assert message in str(err.value)
    assert f"{FAULT_ENV}={value!r}" in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0, "step": 1, "phase": "after_backward"}, "phase='after_backward' is not one of ['before_forward'"),
        ({"rank": -1, "step": 1}, "rank=-1 must be an integer >= 0"),
        ({"rank": 0, "step": 2.0}, "step=2.0 must be an integer >= 0"),
        ({"rank": True, "step": 1}, "rank=True must be an integer >= 0"),
        ({"rank": 0, "step": 1, "signal": "KILL"}, "signal='KILL' is not one of ['SIGKILL', 'SIGTERM', 'error']"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as err:
        FaultInjector(**kwargs)
    assert message in str(err.value)


def trainer(strategy, devices: int = 3, **kwargs) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, **kwargs)


def test_setup_registers_in_the_strategy_once():
    strategy = DLRoverStrategy(parity=ParityConfig(2, 1))
    injector = FaultInjector(2, 3, "during_parity_commit")
    fit = trainer(strategy, max_steps=4)
    for stage in ("fit", "validate"):
        injector.setup(fit, None, stage)
    assert strategy.fault_points == [injector]


def test_setup_needs_dlrover_strategy():
    with pytest.raises(TypeError, match=r"needs DLRoverStrategy, .* the trainer's strategy is DDPStrategy"):
        FaultInjector(0, 1).setup(trainer("ddp"), None, "fit")


@pytest.mark.parametrize("phase", ["during_parity_commit", "during_vote"])
def test_parity_commit_phases_need_parity(phase):
    with pytest.raises(ValueError, match=f"phase '{phase}' is only reached with parity on"):
        FaultInjector(0, 1, phase).setup(trainer(DLRoverStrategy()), None, "fit")


def test_error_signal_raises_in_the_rank_at_its_point_only():
    injector = FaultInjector(0, 3, "during_vote", "error")
    injector("during_parity_commit", 3)
    injector("during_vote", 2)
    with pytest.raises(RuntimeError, match="injected error on rank 0 at step 3, phase during_vote"):
        injector("during_vote", 3)


def test_rank_and_step_must_be_reached():
    with pytest.raises(ValueError, match="there is no rank 3 at world size 3"):
        FaultInjector(3, 1).setup(trainer(DLRoverStrategy()), None, "fit")
    with pytest.raises(ValueError, match=r"would never fire: training stops at Trainer\(max_steps=5\)"):
        FaultInjector(1, 5).setup(trainer(DLRoverStrategy(), max_steps=5), None, "fit")


@pytest.mark.parametrize(("sig", "returncode"), [("SIGKILL", -signal.SIGKILL), ("SIGTERM", -signal.SIGTERM)])
def test_kills_its_process_only_at_its_point(tmp_path, sig, returncode):
    """Without torch.distributed the process is rank 0; other phases, steps and ranks pass."""
    script = textwrap.dedent(
        f"""
        import os
        from lightning_dlrover.fault.injector import FaultInjector
        print(f"pid {{os.getpid()}}", flush=True)
        injector = FaultInjector(0, 3, "after_optimizer", {sig!r})
        for phase, step in [("before_forward", 3), ("after_optimizer", 2), ("during_parity_commit", 3)]:
            injector(phase, step)
        FaultInjector(1, 3, "after_optimizer")("after_optimizer", 3)
        print("passed the other points", flush=True)
        injector("after_optimizer", 3)
        print("still alive", flush=True)
        """
    )
    proc = run_job(["-c", script], tmp_path, fault=None)
    assert proc.returncode == returncode
    assert "passed the other points" in proc.stdout and "still alive" not in proc.stdout
    pid = re.search(r"^pid (\d+)$", proc.stdout, re.MULTILINE).group(1)
    assert f"FaultInjector: killing rank 0 (pid {pid}) at step 3, phase after_optimizer with {sig}\n" in proc.stdout


# --- real multi-process jobs ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("phase", "devices", "parity"),
    [("before_forward", 2, None), ("after_optimizer", 2, None), ("during_parity_commit", 3, "2,1")],
)
def test_env_var_kills_rank_in_a_job(tmp_path, phase, devices, parity):
    args = [*KILL_JOB, "--devices", str(devices), "--steps", "6"] + (["--parity", parity] if parity else [])
    proc = run_job(args, tmp_path, fault=f"rank=1,step=3,phase={phase}")
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert f"at step 3, phase {phase} with SIGKILL" in proc.stdout
    killed = [line for line in proc.stdout.splitlines() if "FaultInjector: killing" in line]  # after "[rank: N] "
    assert len(killed) == 1 and killed[0].startswith("[rank: 1] FaultInjector: killing rank 1 (pid "), killed
    assert not digests(proc.stdout), "training must not finish"


@pytest.mark.slow
def test_job_without_fault_finishes(tmp_path):
    proc = run_job([*KILL_JOB, "--devices", "2", "--steps", "4"], tmp_path, fault=None)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "FaultInjector" not in proc.stdout
    assert "end" in digests(proc.stdout)


@pytest.mark.slow
def test_cli_callback_kills_rank(tmp_path):
    """The injector configured as a LightningCLI callback, as in a YAML config."""
    args = [
        "-m", "lightning_dlrover", "fit",
        "--config", str(REPO / "configs" / "demo.yaml"),
        "--trainer.max_steps=6",
        "--trainer.enable_progress_bar=false",
        "--data.val_batches=0",
        "--trainer.limit_val_batches=0",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=lightning_dlrover.fault.FaultInjector",
        "--trainer.callbacks.rank=2",
        "--trainer.callbacks.step=4",
        "--trainer.callbacks.phase=during_parity_commit",
    ]
    proc = run_job(args, tmp_path, fault=None)
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert "FaultInjector: killing rank 2 (pid " in proc.stdout
    assert "at step 4, phase during_parity_commit with SIGKILL" in proc.stdout
    assert not digests(proc.stdout)



# A rank of a 2-rank gloo job on a test-hosted store; rank 1 reaches the point ``argv[1]`` seconds late (a loaded
# machine) and, just before, leaves a mark in ``argv[2]``. The fault kills both ranks at the point.
TOGETHER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch.distributed as dist
    from lightning_dlrover.fault.injector import FaultInjector
    dist.init_process_group("gloo", init_method="env://")
    rank, mark = dist.get_rank(), Path(sys.argv[2])
    injector = FaultInjector([0, 1], 3, "after_optimizer", "error")
    if rank == 1:
        time.sleep(float(sys.argv[1]))
        mark.write_text("rank 1 reached the point")
    try:
        injector("after_optimizer", 3)
    except RuntimeError as err:
        print(f"rank {rank}: {err}; rank 1 had reached the point: {mark.exists()}", flush=True)
        os._exit(0)
    """
)


def test_ranks_killed_together_each_wait_for_the_others_at_the_point(tmp_path):
    """``rank=0+1``: rank 0 does not leave the point (die, here raise) before rank 1 reached it, so that a peer
    still finishing the step never sees it gone (it would fail or recover instead of dying at the point)."""
    import socket

    from tests.conftest import start

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    mark = tmp_path / "rank1-arrived"
    procs = [start([sys.executable, "-c", TOGETHER, "4", str(mark)], tmp_path, {**env, "RANK": str(r)}) for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "rank 0: FaultInjector: injected error on rank 0 at step 3, phase after_optimizer; rank 1 had reached the " \
        "point: True" in outs[0], outs[0][-3000:]
    assert "rank 1 had reached the point: True" in outs[1]


# --- the node kill's target -------------------------------------------------------------------------------------

_REAPER = textwrap.dedent("""
    import ctypes, os, signal, subprocess, sys
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans below come here, as to init or a CI runner
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    agent = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    worker = int(agent.stdout.readline())
    agent.wait()  # the agent is gone (as when a sibling worker killed it): its worker is re-parented to this process
    _, status = os.waitpid(worker, 0)
    print("worker", "SIGKILL" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL else status)
    print("bystander", "alive" if bystander.poll() is None else bystander.returncode)
    bystander.kill()
""")
_AGENT = textwrap.dedent("""
    import subprocess, sys
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline() == "ready\\n"
    print(worker.pid, flush=True)
    # exits now: the worker outlives it
""")
_WORKER = textwrap.dedent("""
    import os, sys, time
    agent = os.getppid()
    from lightning_dlrover.fault.injector import kill_node
    print("ready", flush=True)
    while os.getppid() == agent:
        time.sleep(0.01)
    kill_node(agent)
    print("kill_node returned", flush=True)
""")


def test_a_node_kill_whose_agent_is_already_gone_kills_only_its_own_worker(tmp_path):
    """The workers of a node fire its kill together; one kills the agent first, and the others, now re-parented to a
    reaper (init, or the process that runs a CI machine's jobs), must not take that reaper for their agent."""
    agent = f"import sys; sys.argv[1:] = [{_WORKER!r}]\n" + _AGENT
    done = subprocess.run([sys.executable, "-c", _REAPER, agent], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["worker SIGKILL", "bystander alive"], done.stdout + done.stderr[-3000:]
