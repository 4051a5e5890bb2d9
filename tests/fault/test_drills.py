"""``lightning-dlrover chaos --kills N``: random SIGKILLs of a rank in every mode (``torchrun`` restarts that decode
the survivors' spills, checkpoint-only restarts, in-process recovery), reported from the job's events.

The packaged chaos config on 1 node x 2 ranks, a few steps: each drill is one short job (no fault-free run, except
where the digest is the point).
"""

import json
import re

import pytest

from lightning_dlrover.monitor.events import read_events
from tests.conftest import REPO, run

pytestmark = pytest.mark.slow


def chaos(workdir, *args: str, check: bool = True) -> tuple[int, dict[str, str], str]:
    """Runs a drill; returns (exit status, its summary as ``{key: value}``, its whole output)."""
    proc = run(["-m", "lightning_dlrover", "chaos", "--nodes", "1", "--nproc-per-node", "2", "--workdir", workdir,
                "--timeout", "300", *args], REPO, timeout=700, check=check)
    summary = proc.stdout.split("\nchaos summary\n")[-1]
    return proc.returncode, dict(re.findall(r"^  ([^:]+): (.*)$", summary, re.MULTILINE)), proc.stdout


def test_torchrun_restarts_decode_every_kill_and_end_with_the_fault_free_digest(tmp_path):
    """Under torchrun (before: ``--kills`` was for ``--in-process`` only), two random kills: each a restart that
    decodes the survivor's spill, nothing lost, the fault-free run's final digest."""
    # 20 steps: each kill lands within 0.3 s of a recovery's first commit, ~6 steps on a quiet machine
    _, got, out = chaos(tmp_path, "--kills", "2", "--kill-jitter", "0.3", "--json", str(tmp_path / "drill.json"),
                        "--trainer.max_steps=20")
    assert got["kills landed"] == "2 of 2", out[-4000:]
    assert got["recoveries"] == "restart + decode 2" and got["steps lost"] == "0"
    assert got["digest match"] == "yes" and got["goodput"][0].isdigit()
    facts = json.loads((tmp_path / "drill.json").read_text())
    assert facts["mode"] == "torchrun, parity (decode from spills)" and facts["kills_landed"] == 2
    assert 0 < facts["goodput"] and facts["fault_free_wall_s"] > 0


def test_a_kill_before_the_first_checkpoint_starts_over_and_says_none_was_written_yet(tmp_path):
    """Checkpoint-only (``--no-parity``), killed just after the first step (a Poisson schedule at 600 kills a
    minute: 0.1 s on average): no checkpoint was written yet (one is configured every 10 steps), so the job starts
    over from step 0, says so (not "add a ModelCheckpoint") and records the start-over's first commit as
    ``resumed`` (before: no event)."""
    # 9 steps (below the first checkpoint's 10): 4 took less than the kill's 0.1 s on a quiet machine
    _, got, out = chaos(tmp_path, "--no-parity", "--kills", "1", "--kill-rate", "600", "--no-reference",
                        "--trainer.max_steps=9")
    assert got["kills landed"] == "1 of 1" and got["recoveries"] == "start over 1", out[-4000:]
    assert got["job finished"] == "yes" and got["steps lost"].isdigit()
    events = read_events([tmp_path / "faulted" / "events.jsonl"])
    kill = next(e.time for e in events if e.kind == "fault_injected")
    assert any(e.kind == "resumed" and e.time > kill for e in events)
    log = (tmp_path / "faulted" / "node0.log").read_text()
    assert "had not written a checkpoint yet" in log and "add a ModelCheckpoint" not in log


def test_an_in_process_drill_whose_kills_cannot_land_fails_loudly(tmp_path):
    """Before: ``--in-process --kills 3 --no-reference`` waited for digests nobody recorded, delivered no kill and
    reported success. Now the kills land; a job too short for all of them (2 steps, each kill needs a commit after
    the previous recovery) fails with how many landed and why."""
    status, got, out = chaos(tmp_path, "--in-process", "--spares", "1", "--kills", "3", "--kill-jitter", "0",
                             "--no-reference", "--trainer.max_steps=2", check=False)
    landed = re.match(r"(\d) of 3 \(FAILED: the job ended ", got.get("kills landed", ""))
    assert status == 2 and landed and 1 <= int(landed.group(1)) < 3, out[-4000:]
    assert "this drill did not drill" in out
    assert got["recoveries"] != "none"


def test_a_loader_without_state_dict_is_named_once_before_training(tmp_path):
    """A user's plain ``DataLoader`` over an ``IterableDataset`` (no ``state_dict``): a recovery restores the model
    exactly but the stream starts again, so the final state differs from a fault-free run. Before: nothing said
    so. Now rank 0 says it once, before its first step, and names the fix."""
    out = run([str(REPO / "tests" / "scripts" / "user_model.py"), "--plain-loader", "--steps", "2", "--devices", "2",
               "--root", str(tmp_path)], tmp_path, timeout=400).stdout
    warning = "has no state_dict(): a recovery (in process, from spills or from a checkpoint) restores the model"
    assert out.count(warning) == 1, out[-4000:]
    assert "StatefulDataLoader" in out.split(warning)[1].splitlines()[0]
    assert out.index(warning) < out.index("state digest:")


def test_torchrecs_dlrm_dcn_with_a_plain_stream_is_restored_exactly_and_the_drill_names_the_loader(tmp_path):
    """Issue #29's case: TorchRec's own ``DLRM_DCN`` fed by a plain ``IterableDataset``, rank 1 killed in process at
    step 12. The model is restored exactly (the step-12 state equals the fault-free run's), the replacement's stream
    starts again so the final state differs, and the report says why instead of a bare "digest match: no"; the
    strategy named the loader once (``data_not_resumable``, rank 0, before the first step) in each run."""
    script = str(REPO / "tests" / "scripts" / "dcn_model.py")
    _, got, out = chaos(tmp_path, "--in-process", "--spares", "1", "--kill-rank", "1", "--at-step", "12",
                        "--script", script, "--", "--steps", "20")
    assert got["recovered"].startswith("yes"), out[-4000:]
    assert got["restored state equals the fault-free state at step 12"] == "yes", out[-4000:]
    assert got["digest match"].startswith("no (the training loader DataLoader(ClickStream) has no state_dict()"), got
    assert "StatefulDataLoader" in got["digest match"]
    for run_dir in ("faulted", "reference"):
        events = read_events([tmp_path / run_dir / "events.jsonl"])
        named = [e for e in events if e.kind == "data_not_resumable"]
        assert named and all(e.rank == 0 and e.step == 0 for e in named), (run_dir, named)
        assert named[0]["loaders"] == ["DataLoader(ClickStream)"]


def test_only_loaders_without_state_dict_are_named():
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_dlrover.strategy.support import unresumable_loaders

    data = list(range(8))
    assert unresumable_loaders(StatefulDataLoader(data)) == []
    assert unresumable_loaders({"a": [DataLoader(data)], "b": StatefulDataLoader(data)}) == ["DataLoader(list)"]
