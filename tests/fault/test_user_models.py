"""A user's own model under ``torchrun`` with parity (tests/scripts/user_model.py: Dropout, BatchNorm, exact Adagrad
tables or an EmbeddingCollection with SGD, Adam and SGD-with-momentum, a per-step LR schedule, a torchdata StatefulDataLoader), drilled with
``lightning-dlrover chaos --script``: 2 agents x 2 ranks on 127.0.0.1, a checkpoint every 5 steps.

Every drill must end with the digest of the same job run without a fault; ``steps lost`` is computed by the
runner from the job's events (the last committed step before the kill against the step it resumed at).
"""

import re

import pytest

from tests.conftest import REPO
from tests.fault.test_node_loss import drill

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "tests" / "scripts" / "user_model.py")


def user_drill(workdir, *args: str, manual: bool = False) -> dict[str, str]:
    job = ["--", "--steps", "16", "--ckpt-every", "5", *(["--manual"] if manual else [])]
    return drill(workdir, "--script", SCRIPT, "--reuse-reference", *args, *job)


def assert_exact(summary: dict[str, str], step: int) -> None:
    assert summary["recovered"].startswith(f"yes, from survivors' spills (recovered step {step} of a 4-rank job"), summary
    assert summary[f"restored state equals the fault-free state at step {step}"] == "yes"
    assert summary["last committed step before the kill"] == str(step)
    assert summary["steps lost"] == "0"
    assert summary["job finished"] == "yes"
    assert summary["digest match"] == "yes", summary


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("user-chaos"))


def test_dropout_batchnorm_model_recovers_exactly(workdir):
    # (a loss during the parity commit of this model: tests/fault/test_in_process.py, cold replacement)
    summary = user_drill(workdir, "--kill-node", "0", "--at-step", "10", "--phase", "before_forward", "--replace")
    assert_exact(summary, 10)


def test_embedding_collection_with_sgd_recovers_exactly(workdir):
    summary = drill(workdir, "--script", SCRIPT, "--kill-node", "0", "--at-step", "9", "--phase", "after_optimizer",
                    "--replace", "--", "--steps", "16", "--collection")
    assert_exact(summary, 9)


def test_manual_optimisation_with_two_optimizers_recovers_exactly(workdir):
    # Two optimizer steps per batch: global_step advances by 2, so the drill's step is even.
    summary = user_drill(workdir, "--kill-node", "1", "--at-step", "8", "--phase", "after_optimizer", "--replace",
                         manual=True)
    assert_exact(summary, 8)


def test_coalesced_commits_resume_at_the_last_commit_and_replay_exactly(workdir):
    # Commits every 4 steps (4, 8, 12, ...): a loss in step index 10 resumes at 8 and trains 8-9 again.
    summary = drill(workdir, "--script", SCRIPT, "--kill-node", "1", "--at-step", "10", "--replace",
                    "--", "--steps", "16", "--parity", "1,1,4")
    assert summary["recovered"].startswith("yes, from survivors' spills (recovered step 8 of a 4-rank job"), summary
    assert summary["restored state equals the fault-free state at step 8"] == "yes"
    assert summary["last committed step before the kill"] == "8" and summary["steps lost"] == "0"
    assert summary["steps trained again"].startswith("2 ")
    assert summary["digest match"] == "yes", summary


def test_every_rank_killed_at_once_resumes_from_the_newest_checkpoint(workdir):
    summary = user_drill(workdir, "--kill-all", "--at-step", "13")
    # Every rank is SIGKILLed at its own step 13. A rank still in step 12's commit when the others died sees its
    # collective fail first and spills before its kill (a CI run: 3 of 4 lost): beyond the parity either way.
    assert re.match(r"from the last checkpoint \((The job was restarted but no rank left a usable spill|"
                    r"[34] of 4 ranks lost their state at step 1[23] )", summary["recovered"]), summary
    assert "epoch=0-step=10.ckpt at step 10)" in summary["recovered"]
    assert summary["last committed step before the kill"] == "13"
    assert summary["steps lost"] == "3"
    assert summary["restored state equals the fault-free state at step 10"] == "yes"
    assert summary["digest match"] == "yes", summary  # the replay from the checkpoint is exact
