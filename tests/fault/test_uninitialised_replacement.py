"""A replacement never initialises its embedding tables: the decode overwrites every byte of them, so TorchRec's
initialisation (the kernels' uniform fill and each table's ``init_fn``) would be time spent in proportion to the state
for nothing (issue #26). The tables' ``init_fn`` logs the process that calls it, in our DLRM
(tests/scripts/logged_init_fit.py) and in a user's model (tests/scripts/user_model.py: ``EmbeddingBagCollection``
tables with Adagrad, or ``EmbeddingCollection`` tables with SGD); a spare replaces a rank killed before step 5 under
``lightning-dlrover launch``, the job ends with the fault-free digest, and the replacement's process is not in the log;
its tables and parity share lie in the memory it faulted in while it waited (``fault/coding/reserve.py``). An
``EmbeddingCollection`` replacement builds its tables with no collective (``torchrec_glue.shard_metadata_from_plan``).
"""

import re
import socket
from pathlib import Path

import pytest

from lightning_dlrover.monitor.events import read_events
from tests.conftest import REPO, run

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "tests" / "scripts" / "user_model.py")
DLRM = [str(REPO / "tests" / "scripts" / "logged_init_fit.py"), "fit", "--config",
        str(REPO / "lightning_dlrover" / "cli" / "configs" / "chaos.yaml"), "--trainer.max_steps=8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(workdir: Path, spares: int, program: list[str], fault: str | None = None) -> tuple[str, list, set[int]]:
    """``program`` (its arguments after ``--``) under the launcher with 2 ranks and ``spares`` spares: its digest, events
    and the ids of the processes that ran a table's init_fn."""
    workdir.mkdir(parents=True)
    log = workdir / "init.log"
    env = {"LIGHTNING_DLROVER_EVENTS": str(workdir / "events.jsonl"), "LIGHTNING_DLROVER_PLAN_TIMEOUT": "20",
           "INIT_LOG": str(log)}
    if fault:
        env["LIGHTNING_DLROVER_FAULT"] = fault
    proc = run(["-m", "lightning_dlrover", "launch", "--nproc-per-node", "2", "--spares", str(spares),
                "--master", f"127.0.0.1:{free_port()}", "--", *program], workdir, timeout=400, env=env)
    digest = re.findall(r"state digest: ([0-9a-f]{64})", proc.stdout)
    assert digest, proc.stdout[-4000:]
    pids = {int(line) for line in log.read_text().split()} if log.exists() else set()
    return digest[-1], read_events([workdir / "events.jsonl"]), pids


def user_model(root: Path, *args: str) -> list[str]:
    return [SCRIPT, "--steps", "8", "--root", str(root), "--init-log", str(root / "init.log"), *args]


def dlrm(root: Path) -> list[str]:
    return [*DLRM, f"--trainer.default_root_dir={root}"]


def assert_never_initialised(tmp_path: Path, program) -> None:
    reference, _, initialised = job(tmp_path / "reference", 0, program(tmp_path / "reference"))
    assert len(initialised) == 2  # both ranks initialise their tables at the start (the log works)
    digest, events, initialised = job(tmp_path / "drill", 1, program(tmp_path / "drill"),
                                      fault="rank=1,step=5,phase=before_forward")
    recovered = [e for e in events if e.kind == "recovered_in_process"]
    assert {e.fields["survivor"] for e in recovered} == {True, False}, [e.kind for e in events]
    replacement = next(e for e in recovered if not e.fields["survivor"])
    assert replacement.pid not in initialised, (replacement.pid, initialised)
    assert len(initialised) == 2  # the two ranks of the start, nobody else
    assert digest == reference
    # its tables and parity share took memory it faulted in while it waited as a hot spare, all of it there
    used = [e for e in events if e.kind == "reserve_used"]
    assert [e.pid for e in used] == [replacement.pid], used
    assert 0 < used[0].fields["taken_bytes"] <= used[0].fields["reserved_bytes"] and used[0].fields["refused_bytes"] == 0


def test_our_dlrm_replacement_never_initialises_its_tables(tmp_path):
    assert_never_initialised(tmp_path, dlrm)


def test_a_user_models_replacement_never_initialises_its_tables(tmp_path):
    assert_never_initialised(tmp_path, user_model)


def test_an_embedding_collection_replacement_never_initialises_its_tables(tmp_path):
    assert_never_initialised(tmp_path, lambda root: user_model(root, "--collection"))
