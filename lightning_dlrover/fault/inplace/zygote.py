"""A warm process to fork workers from (a zygote): spares and replacements ready at once under ``lightning-dlrover launch``.

A worker started as a fresh ``python <program>`` imports torch, TorchRec and Lightning first: seconds of CPU (about
8 s on a 2-core machine), during which a hot spare is not hot and a replacement started cold keeps the survivors
waiting. The launcher instead starts one helper per machine that imports those libraries once (:data:`PRELOAD`) and
then waits for requests; each worker (rank, hot spare or replacement) is ``os.fork()``\\ ed from it and runs the user's
program (``runpy``, as ``__main__``) with the environment, ``sys.argv``, session and parent-death signal that
:meth:`~lightning_dlrover.fault.inplace.supervisor.Supervisor.spawn` gives an ``exec``\\ ed worker. A hot spare
first waits for a rank, right after the fork and before any of its program runs (:mod:`.spare`): waiting costs nothing,
and its program starts as the rank it takes.

**Why forking after the imports is safe here.** ``fork`` copies only the calling thread, so a lock another thread held
at the fork stays locked forever in the child. The zygote runs no thread of its own, imports nothing that starts a
Python thread, initialises no CUDA context (the CUDA driver cannot be used again in a forked child) and creates no
process group or store connection; its only native threads are thread pools that reset themselves in the child
(OpenBLAS's and torch's, through ``pthread_atfork``; with ``OMP_NUM_THREADS=1``, what ``launch`` sets for more than one
rank per machine, OpenBLAS starts none). Before every fork it checks this again (:func:`unsafe`) and refuses the fork
if a Python thread runs or CUDA (or the CUDA driver library) is loaded: the launcher then starts that worker, and every
later one, the old way. What would make it unsafe: preloading a module that starts a thread at import, or one that
initialises CUDA (e.g. a ``torch.cuda.is_available()`` at import on a GPU machine), or running anything in the
zygote after its imports.

**The launcher still owns each worker.** The zygote forks twice and the middle process exits at once: the worker is
re-parented to the launcher, which marks itself a child subreaper (``PR_SET_CHILD_SUBREAPER``, Linux) before it starts
the zygote. So a forked worker is the launcher's own child, as an ``exec``\\ ed one: the launcher polls, signals and
reaps it with ``waitpid`` (:class:`ForkedProcess`, the part of ``subprocess.Popen`` the supervisor uses), it dies with
the launcher (``PR_SET_PDEATHSIG``, set once re-parented) and not with the zygote. Unlike ``multiprocessing.
forkserver``, whose children stay the server's and whose exit codes the server reports over a pipe, nothing then
depends on the zygote after the fork: a zygote that dies loses no worker.

**If it cannot work** (no subreaper, the zygote dies, a fork is refused, a program the zygote cannot run, such as
``python -u ...``), the launcher says so once (the ``zygote_lost`` event and a warning) and ``exec``\\ s every later
worker as before. ``launch --no-zygote`` does that from the start.

A worker forked from the zygote differs from an ``exec``\\ ed one only in what it inherits: the modules already imported
(imported with the launcher's environment, not the worker's: :func:`_become` re-reads the one import-time setting
that depends on the rank, Lightning's ``rank_zero_only.rank``), Python's hash seed (the zygote's, the same for every
worker) and the state of random generators, which it re-seeds from the OS as a fresh interpreter would.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

#: Modules the zygote imports before it forks anything (comma-separated override: ``$LIGHTNING_DLROVER_ZYGOTE_PRELOAD``).
PRELOAD = ("torch", "torch.distributed", "torchrec", "lightning.pytorch", "lightning_dlrover.strategy.dlrover",
           "lightning_dlrover.cli.fit")
PRELOAD_ENV = "LIGHTNING_DLROVER_ZYGOTE_PRELOAD"
#: Seconds the launcher waits for a forked worker's pid once the zygote is ready.
FORK_TIMEOUT_S = 60.0

_PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies (Linux)
_PR_SET_CHILD_SUBREAPER = 36  # prctl(2): orphaned descendants are re-parented to this process (Linux >= 3.4)
_SIGKILL = int(signal.SIGKILL)
# Looked up here, in the launcher: the child between fork and exec then runs no symbol lookup (the dynamic loader's
# lock may be held by another thread of the launcher at fork), only the call.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


class ZygoteError(RuntimeError):
    """The zygote could not fork a worker (it is gone, it refused, or it did not answer)."""


def die_with_launcher(launcher: int) -> Callable[[], None]:
    """What a worker runs between ``fork`` and ``exec`` (or its program): it is SIGKILLed when the launcher ``launcher``
    dies (its own session no longer takes it along when the launcher's process group is killed)."""

    def set_parent_death_signal() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, _SIGKILL)
        if os.getppid() != launcher:  # the launcher died before the line above
            os.kill(os.getpid(), signal.SIGKILL)

    return set_parent_death_signal


def forkable(program: list[str]) -> bool:
    """Whether the zygote can run ``program`` (``script.py args``, ``-m module args`` or ``-c code args``; not one
    with interpreter options such as ``-u``)."""
    return bool(program) and (program[0] in ("-m", "-c") and len(program) > 1 or not program[0].startswith("-"))


# ------------------------------------------------------------------------------------------ launcher side
class ForkedProcess:
    """A worker forked by the zygote and re-parented to this process: the part of ``subprocess.Popen`` the supervisor
    uses (``pid``, ``returncode``, ``poll``, ``wait``, ``terminate``, ``kill``), on ``waitpid``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def _reaped(self, flags: int) -> int | None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped elsewhere (never by the supervisor): its status is lost
            self.returncode = 255
        else:
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode if self.returncode is not None else self._reaped(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                self._reaped(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not reaped: the pid is still this worker's (a zombie keeps it)
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's handle on its zygote: starts it, asks it for workers, notices when it is gone."""

    def __init__(self, process: subprocess.Popen, sock: socket.socket) -> None:
        self.process, self._sock = process, sock
        self._lines = sock.makefile("rb")
        self.ready: dict[str, Any] | None = None  # the zygote's ready message: import_s, preloaded, failed

    @classmethod
    def start(cls, env: dict[str, str]) -> Zygote:
        """Starts the zygote with ``env`` (the workers' environment less what differs per worker); raises
        ``ZygoteError`` where this process cannot own forked workers."""
        if _PRCTL is None or _PRCTL(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise ZygoteError("this OS cannot re-parent forked workers to the launcher (prctl PR_SET_CHILD_SUBREAPER)")
        ours, theirs = socket.socketpair()
        code = "from lightning_dlrover.fault.inplace.zygote import main; main()"
        try:
            process = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno()), str(os.getpid())], env=env,
                                       pass_fds=[theirs.fileno()], start_new_session=True,
                                       preexec_fn=die_with_launcher(os.getpid()))
        except OSError as err:
            ours.close()
            raise ZygoteError(f"could not start it ({err})") from err
        finally:
            theirs.close()
        return cls(process, ours)

    def alive(self) -> bool:
        return self.process.poll() is None

    def _answer(self, timeout: float) -> dict[str, Any]:
        self._sock.settimeout(timeout)
        try:
            line = self._lines.readline()
        except OSError as err:  # (socket.timeout is one)
            raise ZygoteError(f"no answer within {timeout:.0f} s ({type(err).__name__})") from err
        if not line:
            code = self.process.poll()
            raise ZygoteError(f"it exited{f' with code {code}' if code is not None else ''}")
        return json.loads(line)

    def fork(self, program: list[str], env: dict[str, str], idle: bool, ready_timeout: float) -> ForkedProcess:
        """A worker running ``program`` with environment ``env`` (``idle``: at the lowest CPU priority from its first
        instruction), forked from the zygote; waits up to ``ready_timeout`` seconds for the zygote's imports."""
        if self.ready is None:
            self.ready = self._answer(ready_timeout)
        request = {"program": program, "env": env, "cwd": os.getcwd(), "idle": idle}
        try:
            self._sock.sendall(json.dumps(request).encode() + b"\n")
        except OSError as err:
            raise ZygoteError(f"it is gone ({err})") from err
        answer = self._answer(FORK_TIMEOUT_S)
        if "pid" not in answer:
            raise ZygoteError(answer.get("error", f"unexpected answer {answer}"))
        return ForkedProcess(int(answer["pid"]))

    def close(self) -> None:
        """Stops the zygote (its forked workers are not its children: they live on) and stops re-parenting orphans."""
        self._lines.close()
        self._sock.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if _PRCTL is not None:
            _PRCTL(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def reap_orphans(known: set[int]) -> list[int]:
    """Reaps this process's exited children that it did not start (orphans of its workers, e.g. a killed rank's data
    loader processes, re-parented here because it is a subreaper); returns their pids."""
    reaped = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return reaped
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                children = [int(pid) for pid in f.read().split()]
        except OSError:
            continue
        for pid in set(children) - known:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    reaped.append(pid)
            except ChildProcessError:
                continue
    return reaped


# ------------------------------------------------------------------------------------------- zygote side
def unsafe() -> str | None:
    """Why forking this process now would hand a child a broken copy; ``None`` when it is safe (see the module)."""
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:
        return f"Python threads run in the zygote ({', '.join(threads)}): a fork would copy the locks they hold"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the zygote: a forked child cannot use it"
    try:
        with open("/proc/self/maps") as maps:
            if any("libcuda.so" in line for line in maps):
                return "the CUDA driver is loaded in the zygote: a forked child may not be able to use it"
    except OSError:
        pass
    return None


def _preload() -> tuple[list[str], dict[str, str]]:
    names = [n.strip() for n in os.environ.get(PRELOAD_ENV, ",".join(PRELOAD)).split(",") if n.strip()]
    loaded, failed = [], {}
    for name in names:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as err:  # noqa: BLE001 - a program that does not need it imports it (or fails) itself
            failed[name] = f"{type(err).__name__}: {err}"[:200]
    return loaded, failed


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def serve(sock: socket.socket, launcher: int) -> dict[str, Any]:
    """The zygote's loop: imports :data:`PRELOAD`, says it is ready, then forks a worker per request. Returns only
    in a forked worker (its request); the zygote itself exits when the launcher closes the connection."""
    started = time.monotonic()
    loaded, failed = _preload()
    _send(sock, {"ready": True, "pid": os.getpid(), "import_s": round(time.monotonic() - started, 3),
                 "preloaded": loaded, "failed": failed})
    lines = sock.makefile("rb")
    for line in lines:
        request = json.loads(line)
        if (why := unsafe()) is not None:
            _send(sock, {"error": why})
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        middle = os.fork()
        if middle == 0:  # the middle process: forks the worker and exits, so the worker is re-parented to the launcher
            os.close(read)
            if os.fork() == 0:
                lines.close()
                sock.close()
                _settle(launcher, request)
                os.write(write, str(os.getpid()).encode())  # settled: the launcher may now promote or signal it
                os.close(write)
                return request
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            pid = pipe.read()  # (until the worker closes its end: it has settled, or died trying)
        os.waitpid(middle, 0)
        _send(sock, {"pid": int(pid)} if pid else {"error": "the forked worker died before it settled"})
    sys.exit(0)


def _settle(launcher: int, request: dict[str, Any]) -> None:
    """In a forked worker: waits to be re-parented to the launcher, then dies with the launcher, takes a session of
    its own and, for an idle spare, lowers its own priority (its new session's autogroup and ``SCHED_IDLE``), all
    before its pid reaches the launcher: the launcher never lowers a forked worker itself (done before ``setsid`` it
    would lower the zygote's session), and a promotion it sends comes after the lowering, not before."""
    deadline = time.monotonic() + 10.0
    while os.getppid() != launcher:
        if time.monotonic() > deadline or os.getppid() == 1:  # the launcher is gone (or is no subreaper)
            os._exit(1)
        time.sleep(0.001)
    die_with_launcher(launcher)()
    os.setsid()
    if request.get("idle"):
        from lightning_dlrover.fault.inplace import priority

        priority.lower(os.getpid())


def _become(request: dict[str, Any]) -> None:
    """Makes this forked worker look like ``python <program>`` started with the request's environment."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    random.seed()  # a fresh interpreter seeds from the OS; the zygote's state is every worker's otherwise
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    _reread_rank()


def _reread_rank() -> None:
    """Sets Lightning's ``rank_zero_only.rank`` from this process's environment (Lightning reads it when it is
    imported: in the zygote, with no rank)."""
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    if rank_zero is not None:
        rank = next((os.environ[k] for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
                     if k in os.environ), "0")
        rank_zero.rank_zero_only.rank = int(rank)


def _run(program: list[str]) -> None:
    """Runs ``program`` as ``python`` would run it (``sys.argv``, ``sys.path[0]``, ``__main__``)."""
    import runpy

    if program[0] == "-m":
        sys.argv = [program[1], *program[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    elif program[0] == "-c":
        sys.argv = ["-c", *program[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(program[1], "<string>", "exec"), main.__dict__)  # noqa: S102 - the user's own program
    else:
        sys.argv = list(program)
        sys.path[0] = os.path.dirname(os.path.realpath(program[0]))
        runpy.run_path(program[0], run_name="__main__")


def main() -> None:
    """The zygote's entry point (``python -c 'from ...zygote import main; main()' <socket fd> <launcher pid>``)."""
    fd, launcher = int(sys.argv[1]), int(sys.argv[2])
    request = serve(socket.socket(fileno=fd), launcher)
    _become(request)
    from lightning_dlrover.fault.inplace import spare

    if spare.wait_before_program() is not None:  # a hot spare waits here, before its program: see .spare
        _reread_rank()
    _run(request["program"])
