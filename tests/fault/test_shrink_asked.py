"""A shrink the job asks for (``DLRoverStrategy.shrink_in_process``; the resource advisor's fewer ranks): under
``lightning-dlrover launch`` on one machine the highest ranks retire at a commit boundary and the others go on at
the smaller world size in their own processes (``fault/inplace/retire.py``).

Real processes: the launcher, its store and the user's own model (tests/scripts/user_model.py: Dropout, BatchNorm,
exact Adagrad tables, Adam, its own StatefulDataLoader; k=1 r=1) on 3 ranks. What the shrink promises is checked on
the whole training state: its digest after the shrink (2 ranks) equals the committed state's before it (3 ranks)."""

import re

import pytest

from lightning_dlrover.monitor.events import read_events
from tests.fault.test_in_process import fault_free, launch

pytestmark = pytest.mark.slow

VERIFY = {"LIGHTNING_DLROVER_VERIFY_RESIZE": "1"}


def test_the_advisor_shrinks_a_job_to_fewer_ranks_in_process(tmp_path):
    """``ResourceAdvisor(apply=True)`` advised 2 ranks where 3 run (the cost objective over 2 ranks only) for a model
    that reads its pooled embeddings by key: every rank asks the strategy at the end of the profiling window, rank 2
    retires, ranks 0 and 1 shrink in their own processes with the state the job committed, and train to the end."""
    digest, events, output = launch(tmp_path, "advised", "--spares", "0", nproc=3, steps=24, env=VERIFY,
                                    script_args=("--advisor-ranks", "2", "--by-key"))
    kinds = [e.kind for e in events]
    assert not {"restarting_all", "shrink_refused", "in_process_refused"} & set(kinds), output[-4000:]
    applied = [e for e in events if e.kind == "advice_applied" and e.fields["knob"] == "ranks_per_node"]
    assert sorted((e.rank, e.fields["old"], e.fields["new"]) for e in applied) == [(r, 3, 2) for r in range(3)]
    assert {e.fields["via"] for e in applied} == {"DLRoverStrategy.shrink_in_process"}
    started = {e.rank: e.pid for e in applied}  # the three processes the job started with
    (planned,) = [e for e in events if e.kind == "shrink_planned"]
    assert planned.fields["asked"] and (planned.fields["lost_ranks"], planned.fields["world_size"]) == ([2], 2)
    (retired,) = [e for e in events if e.kind == "retired"]
    assert retired.pid == started[2] and retired.fields["generation"] == planned.fields["generation"]
    shrunk = [e for e in events if e.kind == "shrunk_in_process"]
    assert sorted((e.rank, e.fields["old_rank"], e.pid) for e in shrunk) == [(0, 0, started[0]), (1, 1, started[1])]
    assert {e.step for e in shrunk} == {retired.step}  # at the commit boundary the retiring rank left at
    verified = next(e for e in events if e.kind == "resize_verified" and e.step == retired.step)
    assert verified.fields["equal"] and verified.fields["world_size"] == 2, verified.fields
    final = next(e for e in events if e.kind == "digest" and e.fields["final"])
    assert (final.step, final.pid, final.fields["digest"]) == (24, started[0], digest)


def test_a_shrink_that_cannot_run_leaves_the_job_as_it_is(tmp_path):
    """Asked where it cannot run, nothing changes and training goes on at 3 ranks to the fault-free digest:

    - the advisor's 2 ranks for a model that reads its pooled embeddings by position (a new plan would permute its
      features): not asked, said once (the restart advice stays);
    - 1 rank below the parity's k + r = 2: refused by the strategy on every rank, with the reason;
    - 2 ranks that this machine's memory (a 0.1 GB job limit) cannot take: refused by the launcher
      (``shrink_refused``, ``would_not_fit``); no plan, no restart."""
    digest, events, output = launch(tmp_path, "refused", "--spares", "0", "--memory-limit-gb", "0.1", nproc=3,
                                    steps=24, script_args=("--advisor-ranks", "2", "--shrink-at", "4:1",
                                                           "--shrink-at", "12:2"))
    kinds = [e.kind for e in events]
    assert not {"restarting_all", "shrink_planned", "retired", "shrunk_in_process"} & set(kinds), output[-4000:]
    assert "2 ranks not applied in process: the model reads its pooled embeddings by position" in output
    assert not [e for e in events if e.kind == "advice_applied" and e.fields["knob"] == "ranks_per_node"]
    # said by every rank (counted in the whole output: the ranks' lines may share a line of the merged stream)
    below = re.findall(r"rank (\d): no shrink: 1 ranks are fewer than k \+ r = 2", output)
    assert sorted(below) == ["0", "1", "2"], output[-4000:]
    (refused,) = [e for e in events if e.kind == "shrink_refused"]
    assert (refused.fields["why"], refused.fields["lost_ranks"]) == ("would_not_fit", [2])
    assert "launch --memory-limit-gb)" in output and "the job trains on at 3 ranks" in output, output[-4000:]
    assert "launch --spares 1" not in output  # (no spare to suggest for a shrink the job asked for)
    assert digest == fault_free(tmp_path / "reference", nproc=3, steps=24, script_args=("--advisor-ranks", "2"))
