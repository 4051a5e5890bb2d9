"""Workers forked from a warm process (the launcher's zygote, ``fault/inplace/zygote.py``) under ``lightning-dlrover
launch``: a spare needs no imports of its own, so a rank lost right after the spares were requested is taken by a
process that has the libraries already (``readiness`` ``forked`` or ``waiting`` in ``replacement_planned``, where a
fresh interpreter is ``importing``); the job recovers in process with the fault-free digest; a zygote that dies loses
no worker, and later workers start as fresh interpreters (``zygote_lost``).

Real processes throughout: the zygote, its forks, the launcher's store, training jobs of the user model
(tests/scripts/user_model.py) on 2 ranks.
"""

import json
import os
import signal
import sys
import time

import psutil
import pytest

from lightning_dlrover.fault.inplace import membership, zygote
from lightning_dlrover.fault.inplace.supervisor import Supervisor, SupervisorConfig, serve_store
from lightning_dlrover.monitor.events import read_events
from tests.conftest import REPO, start
from tests.fault.test_in_process import SCRIPT, assert_recovered_in_process, fault_free, free_port, launch

REPORT = """
import json, os, sys
with open(sys.argv[1], "w") as f:
    json.dump({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "argv": sys.argv, "name": __name__,
               "rank": os.environ.get("RANK"), "preloaded": "json" in sys.modules and "email" in sys.modules}, f)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def wait_for(path, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.05)
    time.sleep(0.05)
    return json.loads(path.read_text())


def test_a_forked_worker_is_the_launchers_child_in_a_session_of_its_own_with_its_program_and_exit_status(
        tmp_path, monkeypatch):
    """Script, ``-m`` and ``-c`` programs run as ``__main__`` with their ``sys.argv`` and environment; the worker is
    re-parented to the launcher (this process), leads its own session, and its exit status (a code, an uncaught
    exception, a signal) is read with ``waitpid`` as a ``Popen``'s would be."""
    monkeypatch.setenv(zygote.PRELOAD_ENV, "json,email")  # light modules: what is tested is the fork, not torch
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    (tmp_path / "reportmod.py").write_text(REPORT)
    warm = zygote.Zygote.start(dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"))
    try:
        env = dict(os.environ, RANK="1", EXIT="3")
        forks = {
            "script": warm.fork([str(script), str(tmp_path / "script.json")], env, False, 120),
            "module": warm.fork(["-m", "reportmod", str(tmp_path / "module.json")], dict(env, EXIT="0"), False, 120),
            "code": warm.fork(["-c", REPORT, str(tmp_path / "code.json")], dict(env, EXIT="0"), False, 120),
        }
        assert warm.ready["preloaded"] == ["json", "email"] and warm.ready["failed"] == {}
        for name, process in forks.items():
            got = wait_for(tmp_path / f"{name}.json")
            assert got["pid"] == process.pid and got["ppid"] == os.getpid() and got["sid"] == process.pid, got
            assert got["name"] == "__main__" and got["rank"] == "1" and got["preloaded"], got
            assert got["argv"][1:] == [str(tmp_path / f"{name}.json")], got
        assert [forks[n].wait(timeout=60) for n in forks] == [3, 0, 0]
        raising = warm.fork(["-c", "raise ValueError('boom')"], env, False, 120)
        assert raising.wait(timeout=60) == 1
        sleeping = warm.fork(["-c", "import time; time.sleep(60)"], env, False, 120)
        sleeping.kill()
        assert sleeping.wait(timeout=60) == -signal.SIGKILL
    finally:
        warm.close()


SPARE = """
import json, os, sys
started = {"torch": "torch" in sys.modules, "ppid": os.getppid()}  # before this program imports anything
if not os.environ.get("LIGHTNING_DLROVER_SPARE"):
    import time
    time.sleep(30)
    sys.exit(0)
from lightning_dlrover.fault.inplace.protocol import take_rank_if_spare
assignment = take_rank_if_spare()
with open(sys.argv[1], "w") as f:
    json.dump({**started, "rank": assignment.rank}, f)
"""


@pytest.fixture
def supervisor(tmp_path, monkeypatch, request):
    """A one-rank supervisor with one spare; ``request.param``: whether it forks from a zygote."""
    monkeypatch.setenv("LIGHTNING_DLROVER_EVENTS", str(tmp_path / "events.jsonl"))
    port = free_port()
    store, sock = serve_store(f"127.0.0.1:{port}")
    config = SupervisorConfig(program=["-c", SPARE, str(tmp_path / "spare.json")], nproc_per_node=1, spares=1,
                              master=f"127.0.0.1:{port}", zygote=request.param)
    machine = Supervisor(config, store, "test-zygote")
    try:
        yield machine
    finally:
        machine.stop()
        sock.close()


@pytest.mark.parametrize("supervisor", [True, False], ids=["zygote", "no-zygote"], indirect=True)
def test_a_rank_lost_right_after_the_spares_were_requested_goes_to_a_spare_with_everything_imported(supervisor, tmp_path):
    """The rank is lost the moment its spare is started: forked from the zygote, the spare has torch imported before
    its program runs (``readiness`` ``forked``); started as a fresh interpreter (``--no-zygote``, what every spare was
    before), it still has to import everything (``importing``: a cold start)."""
    supervisor.start()
    membership.publish_committed(supervisor.store, 0, 0, 1)  # what the ranks do after their first commit
    supervisor.start_spares()
    supervisor.replace([0])  # lost at once: no spare could have imported anything on its own by now
    events = read_events([tmp_path / "events.jsonl"])
    (started,) = [e for e in events if e.kind == "spares_started"]
    (planned,) = [e for e in events if e.kind == "replacement_planned"]
    forked = supervisor.args.zygote
    assert started.fields["forked"] is forked and planned.fields["cold"] == []
    # (a forked spare waits right after the fork, before its program: it may be waiting already)
    assert planned.fields["readiness"]["0"] in (("forked", "waiting") if forked else ("importing",)), planned.fields
    got = wait_for(tmp_path / "spare.json")
    assert got["rank"] == 0 and got["torch"] is forked and got["ppid"] == os.getpid(), got
    (spare,) = [w for w in supervisor.workers if w.rank == 0]
    assert spare.process.wait(timeout=120) == 0
    assert [e.kind for e in events if e.kind.startswith("zygote")] == (["zygote_ready"] if forked else [])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return fault_free(tmp_path_factory.mktemp("reference") / "run")


@pytest.mark.slow
def test_a_kill_right_after_the_first_commit_is_recovered_in_process_by_a_forked_process(tmp_path, reference):
    """Rank 1 is SIGKILLed at step 2, as the launcher starts its spare after step 1's commit: the replacement (the
    spare, or a process started for the rank if the kill came first) is forked from the zygote and had nothing to
    import, and the job ends with the fault-free digest."""
    digest, events, _ = launch(tmp_path, "early", "--spares", "1", fault="rank=1,step=2,phase=before_forward")
    assert_recovered_in_process(events, digest, reference, step=2)
    (ready,) = [e for e in events if e.kind == "zygote_ready"]
    assert "torch" in ready.fields["preloaded"] and "zygote_lost" not in [e.kind for e in events]
    planned = next(e for e in events if e.kind == "replacement_planned")
    assert planned.fields["readiness"]["1"] in ("forked", "waiting"), planned.fields
    assert all(e.fields["forked"] for e in events if e.kind == "spares_started")


@pytest.mark.slow
def test_a_killed_zygote_loses_no_worker_and_later_spares_start_as_fresh_interpreters(tmp_path, reference):
    """The zygote is SIGKILLed once it has forked both ranks: they train on (they are the launcher's children, not
    its), the launcher says once that it lost it, the spare started after the first commit is a fresh interpreter,
    and the job still recovers in process with the fault-free digest."""
    workdir = tmp_path / "lost"
    workdir.mkdir()
    events_file = workdir / "events.jsonl"
    # (no waiting for a hot spare: on a loaded machine an idle-priority spare importing on its own may starve for
    # minutes; the launcher promotes the one it hands the rank, which then imports at the ranks' priority)
    env = {"LIGHTNING_DLROVER_EVENTS": str(events_file), "LIGHTNING_DLROVER_PLAN_TIMEOUT": "20",
           "LIGHTNING_DLROVER_FAULT": "rank=1,step=8,phase=before_forward"}
    launcher = start([sys.executable, "-m", "lightning_dlrover", "launch", "--nproc-per-node", "2", "--spares", "1",
                      "--master", f"127.0.0.1:{free_port()}", "--", SCRIPT, "--steps", "12", "--root", str(workdir)],
                     workdir, env)
    try:
        deadline, killed, ranks = time.monotonic() + 300, None, []
        while killed is None:
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.stdout.read()[-4000:]
            ready = [e for e in read_events([events_file]) if e.kind == "zygote_ready"]
            # (a forked worker shows the zygote's command line: tell them apart by the pid the launcher reported)
            ranks = [c.pid for c in psutil.Process(launcher.pid).children() if ready and c.pid != ready[0]["zygote_pid"]]
            if len(ranks) >= 2:
                os.kill(ready[0]["zygote_pid"], signal.SIGKILL)
                killed = ready[0]["zygote_pid"]
            time.sleep(0.05)
        out, _ = launcher.communicate(timeout=900)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, out[-4000:]
    events = read_events([events_file])
    (lost,) = [e for e in events if e.kind == "zygote_lost"]
    assert str(-signal.SIGKILL) in lost.fields["why"]
    started = [e for e in events if e.kind == "spares_started"]
    assert not any(e.fields["forked"] for e in started), started
    planned = next(e for e in events if e.kind == "replacement_planned")
    assert planned.fields["readiness"]["1"] in ("importing", "waiting"), planned.fields  # a fresh interpreter
    digest = [line.split()[-1] for line in out.splitlines() if line.startswith("state digest: ")][-1]
    assert_recovered_in_process(events, digest, reference, step=8)
    survivor = next(e for e in events if e.kind == "recovered_in_process" and e.fields["survivor"])
    assert survivor.pid in ranks  # a rank forked before the zygote died trained to the end
