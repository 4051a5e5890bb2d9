"""A resize the job asks for (``DLRoverStrategy.resize_in_process``; the resource advisor's fewer ranks): under
``lightning-dlrover launch`` on one machine, a shrink retires the highest ranks at a commit boundary and the others go
on at the smaller world size in their own processes; a grow (up to ``launch --max-nproc-per-node``) has a new process
join at a commit boundary (``fault/inplace/retire.py``, ``grow.py``).

Real processes: the launcher, its store and the user's own model (tests/scripts/user_model.py: Dropout, BatchNorm,
exact Adagrad tables, Adam, its own StatefulDataLoader; k=1 r=1). What a resize promises is checked on the whole
training state: its digest after the resize equals the committed state's before it."""

import re

import pytest

from lightning_dlrover.cli.launch import parse

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
    assert {e.fields["via"] for e in applied} == {"DLRoverStrategy.resize_in_process"}
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
                                    steps=24, script_args=("--advisor-ranks", "2", "--resize-at", "4:1",
                                                           "--resize-at", "12:2"))
    kinds = [e.kind for e in events]
    assert not {"restarting_all", "shrink_planned", "retired", "shrunk_in_process"} & set(kinds), output[-4000:]
    assert "2 ranks not applied in process: the model reads its pooled embeddings by position" in output
    assert not [e for e in events if e.kind == "advice_applied" and e.fields["knob"] == "ranks_per_node"]
    # said by every rank (counted in the whole output: the ranks' lines may share a line of the merged stream)
    below = re.findall(r"rank (\d): no resize: 1 ranks are fewer than k \+ r = 2", output)
    assert sorted(below) == ["0", "1", "2"], output[-4000:]
    (refused,) = [e for e in events if e.kind == "shrink_refused"]
    assert (refused.fields["why"], refused.fields["lost_ranks"]) == ("would_not_fit", [2])
    assert "launch --memory-limit-gb)" in output and "the job trains on at 3 ranks" in output, output[-4000:]
    assert "launch --spares 1" not in output  # (no spare to suggest for a shrink the job asked for)
    assert digest == fault_free(tmp_path / "reference", nproc=3, steps=24, script_args=("--advisor-ranks", "2"))


def test_a_job_grows_past_its_launch_size_when_it_asks(tmp_path):
    """Launched at 2 ranks with room for 3 (``--max-nproc-per-node 3``): a request for 4 ranks is refused by every rank
    with the reason; a request for 3 has the launcher start a process that sets up beside training and joins as rank 2
    at a commit boundary, while ranks 0 and 1 grow in their own processes with the state the job committed."""
    digest, events, output = launch(tmp_path, "grown", "--spares", "0", "--max-nproc-per-node", "3", nproc=2, steps=24,
                                    env=VERIFY, script_args=("--resize-at", "4:4", "--resize-at", "6:3",
                                                             "--slow-while-short", "1.5"))
    kinds = [e.kind for e in events]
    assert not {"restarting_all", "in_process_refused", "grow_abandoned", "grow_failed"} & set(kinds), output[-4000:]
    beyond = re.findall(r"rank (\d): no resize: the job may grow to 3 ranks at most \(launch --max-nproc-per-node",
                        output)
    assert sorted(beyond) == ["0", "1"], output[-4000:]
    (started,) = [e for e in events if e.kind == "grow_started"]
    assert started.fields["asked"] and (started.fields["world_size"], started.fields["target_world_size"]) == (2, 3)
    (planned,) = [e for e in events if e.kind == "grow_planned"]
    assert (planned.fields["joined_ranks"], planned.fields["world_size"]) == ([2], 3)
    grown = [e for e in events if e.kind == "grown_in_process"]
    assert sorted((e.rank, e.fields["survivor"], e.fields["world_size"]) for e in grown) == [
        (0, True, 3), (1, True, 3), (2, False, 3)]
    assert len({e.step for e in grown}) == 1 and grown[0].step >= 6  # one commit boundary, after the request
    assert next(e for e in grown if e.rank == 2).pid == planned.fields["pids"]["2"]  # the process the launcher started
    verified = next(e for e in events if e.kind == "resize_verified")
    assert verified.fields["equal"] and verified.fields["world_size"] == 3 and verified.step == grown[0].step
    final = next(e for e in events if e.kind == "digest" and e.fields["final"])
    survivor0 = next(e for e in grown if e.rank == 0)
    assert (final.step, final.pid, final.fields["digest"]) == (24, survivor0.pid, digest)


def test_room_to_grow_changes_nothing_in_training(tmp_path):
    """A job launched with room to grow (its world group's C++ size 3, the live size 2: DDP's reducer would divide the
    gradients by 3) trains to the same state as the same job without it."""
    digest, events, output = launch(tmp_path, "room", "--spares", "0", "--max-nproc-per-node", "3", nproc=2)
    assert digest == fault_free(tmp_path / "reference", nproc=2), output[-4000:]


def test_room_to_grow_is_refused_up_front_where_it_cannot_be_used():
    for extra in (["--max-nproc-per-node", "1"], ["--max-nproc-per-node", "3", "--nnodes", "2"],
                  ["--max-nproc-per-node", "3", "--no-in-process"]):
        with pytest.raises(SystemExit):
            parse(["--nproc-per-node", "2", *extra, "--", "train.py"])
    assert parse(["--nproc-per-node", "2", "--", "train.py"]).max_nproc_per_node == 2
    assert parse(["--nproc-per-node", "2", "--max-nproc-per-node", "4", "--", "train.py"]).max_nproc_per_node == 4
