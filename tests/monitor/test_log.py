"""``lightning_dlrover.log``: a rank's lines on stderr with ``[rank: N]``, rank 0's reports on stdout as they are,
the level from ``$LIGHTNING_DLROVER_LOG_LEVEL``, one handler, no Lightning; ``emit``'s message through it."""

import subprocess
import sys

import pytest

from lightning_dlrover.log import get_logger, global_rank, rank_zero_report
from lightning_dlrover.monitor.events import emit
from tests.conftest import REPO


def test_rank_lines_go_to_stderr_with_the_rank_and_reports_to_stdout_as_they_are(capsys, monkeypatch):
    log = get_logger("tests.log")
    assert log.name == "lightning_dlrover.tests.log" and get_logger("lightning_dlrover.x").name == "lightning_dlrover.x"
    monkeypatch.delenv("RANK", raising=False)
    log.info("single process")
    rank_zero_report(log, "Throughput over 3 steps\n100%")
    monkeypatch.setenv("RANK", "2")
    log.warning("FaultInjector: killing rank 2")
    rank_zero_report(log, "not on rank 2")
    out, err = capsys.readouterr()
    assert out == "Throughput over 3 steps\n100%\n"
    assert err == "single process\n[rank: 2] FaultInjector: killing rank 2\n"
    monkeypatch.setenv("RANK", "0")
    rank_zero_report(log, "state digest at step %d: %s", 4, "ab")
    assert capsys.readouterr() == ("state digest at step 4: ab\n", "")
    assert global_rank() == 0


def test_emit_message_goes_to_stderr_unchanged(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LIGHTNING_DLROVER_EVENTS", raising=False)
    emit("resumed", step=3, message="training resumed: step 3 committed")
    emit("resumed", step=4)
    assert capsys.readouterr() == ("", "lightning_dlrover: training resumed: step 3 committed\n")


@pytest.mark.parametrize(("level", "shown"), [("", ["info", "warning"]), ("warning", ["warning"]), ("40", [])])
def test_level_from_the_environment_one_handler_no_lightning(level, shown):
    code = ("import logging, sys\n"
            "from lightning_dlrover.log import get_logger\n"
            "a, b = get_logger('a'), get_logger('b')\n"
            "a.info('info'); b.warning('warning')\n"
            "logging.basicConfig()\n"  # the root logger's handler: no line twice
            "print(len(logging.getLogger('lightning_dlrover').handlers), 'lightning' in sys.modules)\n")
    env = {"PYTHONPATH": str(REPO), "LIGHTNING_DLROVER_LOG_LEVEL": level, "PATH": ""}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "1 False\n" and proc.stderr.splitlines() == shown
