"""Shared helpers: run the package's real multi-process jobs as subprocesses and read what they print."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "tests" / "scripts" / "train.py"
FORKED_RANKS = REPO / "tests" / "scripts" / "forked_ranks.py"
T = TypeVar("T")
DIGEST = re.compile(r"^state digest(?: at step (\d+))?: ([0-9a-f]{64})$", re.MULTILINE)

# Every job of the suite runs with the control plane (lightning_dlrover.control_plane) in a gloo group of its own,
# apart from the default group, as on GPUs where the default group is NCCL: a collective of ours left on the default
# group, or one issued on different groups by different ranks, fails the job instead of passing unnoticed.
os.environ.setdefault("LIGHTNING_DLROVER_CONTROL_GROUP", "separate")


def start(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts ``command`` in ``cwd`` in a new session (so ``os.killpg(proc.pid, ...)`` ends all of it), the
    repository importable, no launcher variables inherited, ``env`` added; stdout+stderr as text in ``.stdout``."""
    dropped = ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LIGHTNING_DLROVER_FAULT")
    full_env = {k: v for k, v in os.environ.items() if k not in dropped}
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.Popen(command, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def run(
    args: list[str],
    cwd: Path,
    timeout: int = 300,
    check: bool = True,
    env: dict[str, str] | None = None,
    program: list[str] | None = None,
) -> subprocess.CompletedProcess:
    """Runs ``program + args`` (default ``python *args``) in ``cwd`` with the repository importable, in a new
    session; returns stdout+stderr as ``.stdout``.

    Every process of the job (the launcher and the ranks it starts) is killed when it returns or after
    ``timeout`` seconds, so a hung rank never outlives its test. ``env`` adds environment variables.
    """
    command = [*(program or [sys.executable]), *map(str, args)]
    proc = start(command, cwd, env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"`{' '.join(command)}` ran over {timeout}s:\n{out[-6000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if check and proc.returncode != 0:
        pytest.fail(f"`{' '.join(command)}` exited {proc.returncode}:\n{out[-6000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out)


def forked(script: str | Path, *args: object) -> list[str]:
    """``run``'s arguments for ``script *args`` with its ranks forked from one process that imported the libraries
    once (``tests/scripts/forked_ranks.py``): the ranks start together and the imports are paid once, not once per
    rank one after another as under the strategy's default ``popen`` launcher. The ranks run the externally-launched
    path (``torchrun``'s); ``--devices N`` in ``args`` (default 2) gives their number. For tests whose promise is not
    the launch itself; a test of the default launch path (its up-front checks included) runs the script plainly."""
    words = [str(a) for a in args]
    nproc = int(words[words.index("--devices") + 1]) if "--devices" in words else 2
    return [str(FORKED_RANKS), "--nproc", str(nproc), str(script), *words]


def train(cwd: Path, *args: str, check: bool = True, fork: bool = False) -> subprocess.CompletedProcess:
    """Runs ``tests/scripts/train.py`` (a multi-process DLRoverStrategy job); ``fork``: its ranks as :func:`forked`
    runs them."""
    return run(forked(TRAIN_SCRIPT, *args) if fork else [str(TRAIN_SCRIPT), *args], cwd, check=check)


def train_forked(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """:func:`train` with ``fork=True``: the ranks forked from one process that imported the libraries once."""
    return train(cwd, *args, check=check, fork=True)


def together(*jobs: Callable[[], T]) -> list[T]:
    """Calls ``jobs`` (independent jobs of one test, e.g. ``lambda: run(...)``) at the same time; returns their results
    in the order given (the first exception raised, once all have ended). A job's processes start one after another
    at first (imports), which leaves a core idle that another job's start-up uses."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(job) for job in jobs]
    return [future.result() for future in futures]


def train_together(cwd: Path, *jobs: list[str], fork: bool = False) -> list[subprocess.CompletedProcess]:
    """Runs independent ``tests/scripts/train.py`` jobs at the same time, each as :func:`train` runs one (checked,
    its processes killed when it returns) in a directory of its own, ``cwd/job<i>``; returns their results in the
    order given; ``fork`` as for :func:`train`.

    A job's ranks import torch one after another at first (the launcher's rank 0, then the others), which leaves a
    core idle that the other job's start-up uses."""
    dirs = [cwd / f"job{i}" for i in range(len(jobs))]
    for path in dirs:
        path.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(train, path, *args, fork=fork) for path, args in zip(dirs, jobs)]
    return [future.result() for future in futures]


def digests(output: str) -> dict[str, str]:
    """``{"end": hex}`` for the strategy's final digest and ``{"<step>": hex}`` for StateDigest lines."""
    return {step or "end": value for step, value in DIGEST.findall(output)}


def reap(processes: list[multiprocessing.process.BaseProcess], grace: float = 5.0) -> None:
    """Terminates (then kills) every process in ``processes`` still alive and waits for it."""
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(grace)
        if proc.is_alive():
            proc.kill()
            proc.join()


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    """A child a test started with ``multiprocessing`` never outlives it: at interpreter exit multiprocessing
    joins every live non-daemon child, so one hung rank would keep pytest from exiting after its summary."""
    yield
    reap(multiprocessing.active_children())


_session_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    reap(multiprocessing.active_children())
    _session_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Ends pytest with the session's status once its summary is written, without interpreter shutdown.

    CI hung twice after pytest's summary until its time limit. What shutdown waits on is outside the tests'
    reach: a non-daemon thread a library left running, a multiprocessing child, or a C++ static destructor
    of torch/gloo in this process (the same hang ``lightning_dlrover/strategy/process_exit.py`` avoids in
    real ranks). Whatever would still be waited on is named on stderr first.
    """
    if not _session_status:
        return  # no session ran (a usage error): exit as pytest would
    stuck = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if stuck:
        print(f"non-daemon threads alive at the end of the session (not waited for): {stuck}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    os._exit(_session_status[-1])


def exit_rank() -> None:
    """Ends a spawned test rank at once once its work is done: a C++ static destructor sometimes hangs or aborts
    a finished torch process at exit (see ``lightning_dlrover/strategy/process_exit.py``), and a rank that never
    exits hangs its test."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
