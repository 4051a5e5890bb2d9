"""Node loss end to end: ``lightning-dlrover chaos`` runs 2 torchrun agents x 2 ranks on 127.0.0.1 and SIGKILLs
one node (agent and workers) at a training step; the job must carry on from the survivors' spills.

Every drill runs the packaged chaos config (k=1, r=1, a checkpoint every 10 steps), 20 steps (``STEPS``): past
the recoveries at steps 5, 12 and 14 and the checkpoint of step 10. A kill at every
phase of a step, on a user's own model, is drilled in test_user_models.py.
"""

import re

import pytest

from tests.conftest import REPO, run

pytestmark = pytest.mark.slow
STEPS = "--trainer.max_steps=20"  # the packaged 30 add nothing to these checks, only time


def drill(workdir, *args: str) -> dict[str, str]:
    """Runs a chaos drill; returns its summary as ``{key: value}`` (repeated keys joined by newlines)."""
    proc = run(["-m", "lightning_dlrover", "chaos", "--workdir", workdir, "--timeout", "300", *args], REPO, timeout=700)
    summary = proc.stdout.split("\nchaos summary\n")[-1]
    found: dict[str, str] = {}
    for key, value in re.findall(r"^  ([^:]+): (.*)$", summary, re.MULTILINE):
        found[key] = f"{found[key]}\n{value}" if key in found else value
    assert found.get("node killed") == "yes", proc.stdout[-4000:]
    return found


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("chaos"))


@pytest.fixture(scope="module")
def replaced_before_forward(workdir):
    """Node 0 dies before the forward of step 12; a replacement joins (with the fault-free reference run)."""
    return drill(workdir, "--kill-node", "0", "--at-step", "12", "--replace", "--reuse-reference", STEPS)


def assert_exact_recovery(summary: dict[str, str], step: int) -> None:
    assert summary["recovered"].startswith(f"yes, from survivors' spills (recovered step {step} of a 4-rank job")
    assert summary[f"restored state equals the fault-free state at step {step}"] == "yes"
    assert summary["steps lost"] == "0"
    assert summary["job finished"] == "yes"
    assert summary["digest match"] == "yes", summary


def assert_parity(summary: dict[str, str], encoded: str, kept: bool) -> None:
    """The restored job's parity: kept on the survivors or not, encoded for ``encoded``, equal to a fresh encode."""
    line = summary["parity after the restore"]
    assert line.startswith(f"{'kept on the survivors, ' if kept else ''}encoded for ranks {encoded} in "), line
    assert line.endswith("equals a fresh encode: yes"), line


def test_replacement_before_forward_gives_the_fault_free_digest(replaced_before_forward):
    assert_exact_recovery(replaced_before_forward, 12)
    assert "decoded lost ranks [0, 1]" in replaced_before_forward["recovered"]
    # the surviving node comes back as node 0; it takes back node rank 1 and keeps its parity
    assert_parity(replaced_before_forward, "[0, 1]", kept=True)
    assert float(replaced_before_forward["detection"].split()[0]) < 20  # bounded by the 20 s collective timeout


def test_two_lost_ranks_at_r2_recover(workdir, replaced_before_forward):
    summary = drill(workdir, "--kill-node", "1", "--at-step", "5", "--replace", "--no-reference",
                    "--trainer.strategy.init_args.parity.k=2", "--trainer.strategy.init_args.parity.r=2", STEPS)
    assert "recovered step 5 of a 4-rank job onto 4 ranks: decoded lost ranks [2, 3]" in summary["recovered"]
    assert summary["final digest"] == replaced_before_forward["fault-free digest"]  # parity never changes training
    assert_parity(summary, "[2, 3]", kept=True)


def test_more_losses_than_parity_fall_back_to_the_last_checkpoint(workdir, replaced_before_forward):
    # k=3, r=1 on 2 nodes: a parity group has 2 members on each node, so a lost node is beyond the code.
    summary = drill(workdir, "--kill-node", "0", "--at-step", "14", "--replace", "--no-reference",
                    "--trainer.strategy.init_args.parity.k=3", STEPS)
    # Node 0's two ranks are lost. Under load a survivor can also miss: its spill absent, or a step behind
    # when the commit vote broke with node 0 before it saw the outcome (the fallback is right either way).
    assert re.match(r"from the last checkpoint \([23] of 4 ranks lost their state at step 14 \(ranks \[0, 1", summary["recovered"]), \
        summary["recovered"]
    assert "epoch=0-step=10.ckpt at step 10" in summary["recovered"]
    assert summary["last committed step before the kill"] == "14" and summary["steps lost"] == "4"
    assert summary["final digest"] == replaced_before_forward["fault-free digest"]  # the replay is exact


def test_shrink_onto_the_survivors_then_grow_when_a_node_rejoins(workdir):
    # The shrunk job sleeps 1 s a step until the node has rejoined (its agent and ranks start: seconds), so it lasts
    # for the rejoin however fast its steps (the grown job resumed at step 14 on a quiet machine).
    # Only the restored state is checked against the fault-free run (the world size changes): it stops after step 6.
    slow = '{"class_path": "tests.elastic.elastic_job.SlowWhileShort", "init_args": {"seconds": 1.0, "world_size": 4}}'
    summary = drill(workdir, "--kill-node", "1", "--at-step", "6", "--rejoin-after", "2", "--reference-steps", "6",
                    "--trainer.max_steps=40", f"--trainer.callbacks+={slow}")
    shrink, grow = summary["recovered"].splitlines()
    assert summary["restored state equals the fault-free state at step 6"] == "yes"  # re-sharded onto 2 ranks
    assert "recovered step 6 of a 4-rank job onto 2 ranks: decoded lost ranks [2, 3]" in shrink
    assert_parity(summary, "[0, 1]", kept=False)  # a new world: all of it encoded afresh
    # Growing, the agents SIGTERM every worker; one the launcher kills before it spills is decoded from parity.
    assert re.search(r"recovered step \d+ of a 2-rank job onto 4 ranks: (no rank lost|decoded lost ranks \[\d\])",
                     grow), grow
    assert summary["steps lost"] == "0"
    assert summary["job finished"] == "yes"
