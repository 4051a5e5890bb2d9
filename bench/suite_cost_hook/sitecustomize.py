"""Start-up hook for ``bench/suite_cost.py``: with ``$SUITE_COST_LOG`` set, every Python interpreter that starts with
this folder on its path appends one JSON line when it starts and one when it ends (``atexit`` or ``os._exit``; a forked
child writes only the end line): its pid, parent, the test that was running (``$PYTEST_CURRENT_TEST``, which pytest
sets and child processes inherit), its own CPU seconds (``os.times``; a forked child's count from its fork) and whether
torch / TorchRec / Lightning were imported. A process killed by a signal writes no end line. Without
``$SUITE_COST_LOG`` it does nothing. It starts no thread (the launcher's zygote refuses to fork with one running)."""

import atexit
import json
import os
import sys
import time

_LOG = os.environ.get("SUITE_COST_LOG")


def _write(kind: str) -> None:
    cpu = os.times()
    mods = sys.modules
    line = {
        "kind": kind, "pid": os.getpid(), "ppid": os.getppid(), "t": time.time(),
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
        "argv": " ".join(getattr(sys, "orig_argv", sys.argv)[1:4])[:200], "cpu": round(cpu.user + cpu.system, 3),
        "torch": "torch" in mods, "torchrec": "torchrec" in mods, "lightning": "lightning.pytorch" in mods,
    }
    fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())  # one write on O_APPEND: lines of processes do not mix
    finally:
        os.close(fd)


if _LOG:
    _START_PID = os.getpid()
    _real_exit = os._exit
    _done: set[int] = set()

    def _end(kind: str) -> None:
        if os.getpid() in _done:
            return
        _done.add(os.getpid())
        try:
            _write(kind if os.getpid() == _START_PID else kind + "-fork")
        except Exception:  # noqa: BLE001 - measuring never breaks the measured process
            pass

    def _exit(code: int) -> None:
        _end("end")
        _real_exit(code)

    os._exit = _exit
    atexit.register(_end, "end")
    try:
        _write("start")
    except Exception:  # noqa: BLE001
        pass
