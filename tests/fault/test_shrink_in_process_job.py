"""Shrink in process end to end: a user's model (tests/scripts/user_model.py: Dropout, BatchNorm, its own
StatefulDataLoader, k=1 r=1) on 3 ranks under ``lightning-dlrover launch --spares 0 --no-cold-start``; rank 0 is
SIGKILLed before step 6 and ranks 1 and 2 train on as ranks 0 and 1 of 2 in their own processes. The final digest
equals the same job's restart-path shrink on the same machine (``torchrun`` at 3 ranks, rank 0 killed at the same
point, the survivors spill; ``torchrun`` at 2 ranks restores from the spills: what ``--nnodes MIN:MAX`` restarts do).

(On 3 one-rank machines, ``chaos --nodes 3 --nproc-per-node 1 --kill-node 0``, the restart-path shrink ends with
another digest than both: the ranks per machine are part of the job.)"""

import re
from importlib import resources

import pytest

from lightning_dlrover.monitor.events import read_events
from tests.conftest import run
from tests.fault.test_in_process import SCRIPT, fault_free, free_port, launch
from tests.fault.test_node_loss import drill

pytestmark = pytest.mark.slow


def restart_path_shrink(workdir, program: tuple[str, ...] = (SCRIPT, "--steps", "12")) -> str:
    """The digest of the job shrunk from 3 to 2 ranks by a restart of every worker, from the survivors' spills."""
    workdir.mkdir()
    env = {"LIGHTNING_DLROVER_SPILL_DIR": str(workdir / "spill"), "LIGHTNING_DLROVER_JOB_ID": "shrink-reference"}
    outputs = []
    for nproc, fault in ((3, "rank=0,step=6,phase=before_forward"), (2, None)):
        torchrun = ["-m", "torch.distributed.run", "--rdzv-backend", "c10d", "--rdzv-id", "shrink-reference",
                    "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nnodes", "1", "--nproc-per-node", str(nproc),
                    "--max-restarts", "0", *program, *(["--root", str(workdir)] if program[0] == SCRIPT else [])]
        outputs.append(run(torchrun, workdir, timeout=400, check=fault is None,
                           env={**env, **({"LIGHTNING_DLROVER_FAULT": fault} if fault else {})}).stdout)
    assert "recovered step 6 of a 3-rank job onto 2 ranks: decoded lost ranks [0]" in outputs[1], outputs[1][-4000:]
    return re.findall(r"state digest: ([0-9a-f]{64})", outputs[1])[-1]


def test_a_rank_lost_with_no_spare_leaves_the_survivors_training_at_n_minus_1(tmp_path):
    digest, events, output = launch(tmp_path, "shrink", "--spares", "0", "--no-cold-start", nproc=3,
                                    fault="rank=0,step=6,phase=before_forward")
    kinds = [e.kind for e in events]
    assert "restarting_all" not in kinds and "shrink_refused" not in kinds, output[-4000:]
    shrunk = [e for e in events if e.kind == "shrunk_in_process"]
    assert sorted(e.fields["old_rank"] for e in shrunk) == [1, 2], kinds
    assert all(e.step == 6 and e.fields["world_size"] == 2 and e.fields["lost_ranks"] == [0] for e in shrunk)
    planned = next(e for e in events if e.kind == "shrink_planned")
    assert (planned.fields["lost_ranks"], planned.fields["world_size"]) == ([0], 2)
    # the survivors trained on in the processes the launcher started them in (it started none after the loss)
    assert {e.rank: e.pid for e in shrunk} == {int(r): pid for r, pid in planned.fields["pids"].items()}
    final = next(e for e in events if e.kind == "digest" and e.fields["final"])
    assert final.pid in {e.pid for e in shrunk}
    assert digest == restart_path_shrink(tmp_path / "restart")


def test_a_shrink_below_k_plus_r_restarts_every_worker_with_the_reason(tmp_path):
    """2 ranks at k=1 r=1: one survivor cannot hold parity; the survivors refuse and the launcher restarts the job."""
    digest, events, output = launch(tmp_path, "refused", "--spares", "0", "--no-cold-start", nproc=2,
                                    fault="rank=1,step=6,phase=before_forward")
    refused = [e for e in events if e.kind == "shrink_refused"]
    assert refused and refused[0].fields["why"] == "below_parity", output[-4000:]
    assert "restarting_all" in [e.kind for e in events]


def test_a_shrink_that_fails_half_way_restarts_every_worker_from_the_state_before_it(tmp_path):
    """Rank 1 raises during the shrink (after the group shrank): the survivors write the spills of step 6 they kept,
    the launcher restarts all 3 ranks, and they restore step 6 from those spills: nothing is lost, and the job ends
    with the digest of the same job without a fault."""
    faults = "rank=0,step=6,phase=before_forward;rank=1,step=6,phase=during_recovery,signal=error"
    digest, events, output = launch(tmp_path, "half-way", "--spares", "0", "--no-cold-start", nproc=3, fault=faults)
    failed = [e for e in events if e.kind == "shrink_refused"]
    assert failed and all(e.fields["why"] == "failed" for e in failed), output[-4000:]
    assert "restarting_all" in [e.kind for e in events] and "shrunk_in_process" not in [e.kind for e in events]
    restored = next(e for e in events if e.kind == "restored")
    assert (restored.step, restored.fields["world_size"], restored.fields["lost_ranks"]) == (6, 3, [0])
    assert digest == fault_free(tmp_path / "reference", nproc=3)


def test_our_dlrm_shrinks_from_3_to_2_ranks_in_process_with_the_restart_paths_digest(tmp_path):
    """The packaged chaos job (a small DLRM, 26 tables, row-wise Adagrad, a checkpoint at step 10: saved by the
    shrunk job) on 3 ranks, rank 0 killed before step 6."""
    config = resources.files("lightning_dlrover.cli") / "configs" / "chaos.yaml"
    job = ("-m", "lightning_dlrover", "fit", "--config", str(config), "--trainer.max_steps=12")
    workdir = tmp_path / "shrink"
    workdir.mkdir()
    events = workdir / "events.jsonl"
    proc = run(["-m", "lightning_dlrover", "launch", "--nproc-per-node", "3", "--spares", "0", "--no-cold-start",
                "--master", f"127.0.0.1:{free_port()}", "--", *job, f"--trainer.default_root_dir={workdir}"],
               workdir, timeout=400, env={"LIGHTNING_DLROVER_EVENTS": str(events), "LIGHTNING_DLROVER_PLAN_TIMEOUT": "20",
                                          "LIGHTNING_DLROVER_FAULT": "rank=0,step=6,phase=before_forward"})
    shrunk = [e for e in read_events([events]) if e.kind == "shrunk_in_process"]
    assert sorted(e.fields["old_rank"] for e in shrunk) == [1, 2] and all(e.step == 6 for e in shrunk), proc.stdout[-4000:]
    assert (workdir / "checkpoints").exists() or list(workdir.rglob("*step=10*")), "the shrunk job saved no checkpoint"
    digest = re.findall(r"state digest: ([0-9a-f]{64})", proc.stdout)[-1]
    reference = tmp_path / "restart"
    assert digest == restart_path_shrink(reference, (*job, f"--trainer.default_root_dir={reference}"))


def test_a_shrink_the_machines_memory_cannot_take_restarts_every_worker_with_the_reason(tmp_path):
    """The launcher checks the memory before it plans a shrink: under a job memory limit below what its 3 ranks
    already hold, the plan it publishes refuses the shrink (``shrink_refused``, ``would_not_fit``, once, from the
    launcher), the survivors leave without waiting, and the restarted job restores step 6 from their spills: nothing
    is lost and the digest is the fault-free job's."""
    digest, events, output = launch(tmp_path, "no-room", "--spares", "0", "--no-cold-start", "--memory-limit-gb",
                                    "0.1", nproc=3, fault="rank=0,step=6,phase=before_forward")
    refused = [e for e in events if e.kind == "shrink_refused"]
    assert [e.fields["why"] for e in refused] == ["would_not_fit"], output[-4000:]
    assert "launch --memory-limit-gb" in output and "survivors would allocate" in output, output[-4000:]
    kinds = [e.kind for e in events]
    assert "shrink_planned" not in kinds and "shrunk_in_process" not in kinds and "restarting_all" in kinds
    restored = next(e for e in events if e.kind == "restored")
    assert (restored.step, restored.fields["lost_ranks"]) == (6, [0])
    assert digest == fault_free(tmp_path / "reference", nproc=3)


def test_chaos_drills_a_shrink_in_process_against_the_restart_paths_shrink(tmp_path):
    """``chaos --in-process --shrink``: the user's model on 3 ranks, rank 0 killed before step 6 with no spare; the
    report says the survivors shrank in process, nothing was lost, and the final digest equals the same job shrunk by
    the restart path (which the drill runs as its reference: torchrun at 3 ranks, then at 2 from the spills)."""
    summary = drill(str(tmp_path), "--in-process", "--shrink", "--nodes", "1", "--nproc-per-node", "3",
                    "--kill-rank", "0", "--at-step", "6", "--script", SCRIPT, "--", "--steps", "12")
    assert summary["recovered"].startswith("yes, shrunk in process from 3 to 2 ranks"), summary
    assert summary["restored state equals the fault-free state at step 6"] == "yes", summary
    assert summary["steps lost"] == "0" and summary["job finished"] == "yes"
    assert summary["digest match"] == "yes", summary
    assert "the restart path's shrink digest" in summary


def test_a_rank_lost_during_a_shrink_is_rolled_back_like_any_other_loss(tmp_path):
    """4 ranks, no spare: rank 0 is SIGKILLed before step 6 and, while the 3 survivors shrink, the second of them
    (rank 1 of the new world, rank 2 before) is SIGKILLed too. The two left write the spills of step 6 they kept, the
    launcher restarts every worker, and the job restores step 6 at 4 ranks, decoding ranks 0 and 2 (different parity
    groups of k=1 r=1): nothing is lost, and the job ends with the fault-free digest."""
    faults = "rank=0,step=6,phase=before_forward;rank=1,step=6,phase=during_recovery"
    digest, events, output = launch(tmp_path, "twice", "--spares", "0", "--no-cold-start", nproc=4, fault=faults)
    kinds = [e.kind for e in events]
    assert "shrunk_in_process" not in kinds and "restarting_all" in kinds, output[-4000:]
    assert {e.fields["why"] for e in events if e.kind == "shrink_refused"} == {"failed"}
    restored = next(e for e in events if e.kind == "restored")
    assert (restored.step, restored.fields["world_size"], restored.fields["lost_ranks"]) == (6, 4, [0, 2])
    assert digest == fault_free(tmp_path / "reference", nproc=4)
