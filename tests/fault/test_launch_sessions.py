"""Under ``lightning-dlrover launch`` every worker runs in a session of its own, as under ``torchrun``, and dies with its
launcher.

Linux's autogroup scheduler shares the CPU equally among sessions: ranks left in the launcher's session trained on one
session's share between them all, while ``torchrun``'s ranks get one share each (issue #29: launch's ranks reached
their first step later on a machine running anything else). A worker in a session of its own is no longer taken along
when the launcher's process group is killed, so the launcher takes it along itself.

The launcher runs for real (``python -m lightning_dlrover launch``); its workers are a plain ``python -c`` that writes
its pid, session and process group to a file and sleeps.
"""

import json
import os
import signal
import sys
import time

import psutil

from tests.conftest import REPO, start

WORKER = """
import json, os, sys, time
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w") as f:
    json.dump({"pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0), "ppid": os.getppid()}, f)
time.sleep(120)
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, ranks: int = 2):
    """A launcher with ``ranks`` sleeping workers (no spares); returns it and what each worker wrote."""
    command = [sys.executable, "-m", "lightning_dlrover", "launch", "--nproc-per-node", str(ranks), "--spares", "0",
               "--master", f"127.0.0.1:{free_port()}", "--", "-c", WORKER, str(tmp_path)]
    launcher = start(command, REPO)
    deadline = time.monotonic() + 120
    files = [tmp_path / f"rank{r}" for r in range(ranks)]
    while not all(f.exists() and f.read_text() for f in files):
        if launcher.poll() is not None or time.monotonic() > deadline:
            os.killpg(launcher.pid, signal.SIGKILL)
            raise AssertionError(f"the workers did not start:\n{launcher.communicate()[0][-3000:]}")
        time.sleep(0.1)
    time.sleep(0.1)  # (each file is written in one call; let it close)
    return launcher, [json.loads(f.read_text()) for f in files]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], timeout: float = 60.0) -> list[int]:
    """The ``pids`` still running after ``timeout`` seconds (at most)."""
    deadline = time.monotonic() + timeout
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


def cleanup(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_each_worker_runs_in_a_session_of_its_own_and_dies_when_the_launcher_is_killed(tmp_path):
    launcher, workers = launch(tmp_path)
    pids = [w["pid"] for w in workers]
    try:
        for worker in workers:
            assert worker["ppid"] == launcher.pid
            assert worker["sid"] == worker["pid"], f"worker {worker} shares a session (as torchrun's do not)"
            assert worker["sid"] != os.getsid(launcher.pid)
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone: its workers are in sessions of their own
        launcher.wait()
        assert wait_gone(pids) == [], "workers outlived their launcher"
    finally:
        cleanup(pids)


def test_a_launcher_stopped_by_sigterm_stops_its_workers_and_exits(tmp_path):
    launcher, workers = launch(tmp_path)
    pids = [w["pid"] for w in workers]
    try:
        os.kill(launcher.pid, signal.SIGTERM)
        launcher.wait(timeout=60)
        assert launcher.returncode == 128 + signal.SIGTERM
        assert wait_gone(pids) == [], "workers outlived their launcher"
    finally:
        cleanup(pids)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
