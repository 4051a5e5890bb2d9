"""``lightning-dlrover chaos``: its report is computed from the job's structured events, and its rendezvous store
listens on the loopback interface only."""

import psutil
import pytest

from lightning_dlrover.cli.chaos import _loopback_store, _reference_overrides, parse_args
from lightning_dlrover.cli.chaos_kills import plan, trained_since
from lightning_dlrover.cli.chaos_report import drill_facts, summarize
from lightning_dlrover.monitor.events import Event


def event(kind: str, time: float, step: int | None = None, rank: int = 0, **fields) -> Event:
    return Event(kind, time, rank, step, 1, fields)


def report(events, reference) -> dict[str, str]:
    args = parse_args(["--kill-node", "0", "--at-step", "12", "--replace"])
    lines = summarize(args, True, events, reference)
    return dict(line.split(": ", 1) for line in lines)


REFERENCE = [event("digest", 1.0, 12, digest="a" * 64, final=False), event("digest", 2.0, 30, digest="f" * 64, final=True)]
RESTORED = dict(old_world_size=4, world_size=4, lost_ranks=[0, 1], decode_s=0.01, reshard_s=0.02)


def test_steps_lost_come_from_the_last_commit_and_the_resumed_step():
    events = [
        event("fault_injected", 100.0, 12, phase="before_forward", target="node", signal="SIGKILL", committed_step=12),
        event("fault_injected", 100.0, 12, rank=1, phase="before_forward", target="node", signal="SIGKILL",
              committed_step=12),  # every rank of the node records the node's one kill
        event("stopped", 100.05, 12, rank=2, reason="RuntimeError", spill="x", spill_s=0.01),
        event("restored", 110.0, 12, **RESTORED),
        event("parity_encoded", 110.1, 12, encode_s=0.004, kept_parity=True, encoded_ranks=[0, 1], verified=True),
        event("digest", 110.5, 12, digest="a" * 64, final=False),
        event("resumed", 111.0, 13),
        event("digest", 130.0, 30, digest="f" * 64, final=True),
    ]
    got = report(events, REFERENCE)
    assert got["steps lost"] == "0" and got["last committed step before the kill"] == "12"
    assert got["restored state equals the fault-free state at step 12"] == "yes"
    assert got["detection"].startswith("0.05 s") and got["time to resume"].startswith("11.00 s")
    assert got["digest match"] == "yes"
    assert "kills" not in got  # one kill, though two ranks recorded it
    assert got["parity after the restore"] == ("kept on the survivors, encoded for ranks [0, 1] in 0.004 s; "
                                               "equals a fresh encode: yes")


def test_an_unconfirmed_restore_is_not_reported_as_exact():
    events = [
        event("fault_injected", 100.0, 14, phase="before_forward", target="node", signal="SIGKILL", committed_step=14),
        event("fallback", 110.0, 10, why="2 of 4 ranks lost.", checkpoint="/c/epoch=0-step=10.ckpt", failed_step=14,
              steps_lost=4, load_s=0.1),
        event("digest", 130.0, 30, digest="e" * 64, final=True),
    ]
    got = report(events, REFERENCE)
    assert got["steps lost"] == "4"
    assert got["restored state equals the fault-free state at step 10"] == "no (cannot confirm: no digest of that step)"
    assert got["digest match"] == "no"
    no_injection = report([e for e in events if e.kind != "fault_injected"], None)
    assert no_injection["steps lost"] == "unknown" and no_injection["node killed"] == "no"


def test_the_rendezvous_store_listens_on_loopback_only():
    store, sock = _loopback_store()
    try:
        port = sock.getsockname()[1]
        listening = [c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert listening == ["127.0.0.1"]
    finally:
        sock.close()


def test_in_process_recovery_is_reported_with_its_split():
    common = dict(lost_ranks=[1], decode_s=0.01, reshard_s=0.03, lost_at=100.02)
    events = [
        event("fault_injected", 100.0, 12, rank=1, phase="before_forward", target="rank", signal="SIGKILL",
              committed_step=12),
        event("recovered_in_process", 100.40, 12, rank=0, survivor=True, failed_at=100.05, connected_at=100.30,
              restored_at=100.40, **common),
        event("recovered_in_process", 100.41, 12, rank=1, survivor=False, failed_at=None, connected_at=100.25,
              restored_at=100.41, **common),
        event("digest", 100.5, 12, digest="a" * 64, final=False),
        event("resumed", 101.0, 13),
        event("digest", 130.0, 30, digest="f" * 64, final=True),
    ]
    args = parse_args(["--in-process", "--nodes", "1", "--kill-rank", "1", "--at-step", "12"])
    got = dict(line.split(": ", 1) for line in summarize(args, True, events, REFERENCE))
    assert got["recovered"].startswith("yes, in process") and "ranks [1] replaced" in got["recovered"]
    assert got["detection"].startswith("0.05 s") and got["replacement ready"].startswith("0.20 s")
    assert got["decode"] == "0.040 s" and got["time to resume"].startswith("1.00 s")
    assert got["steps lost"] == "0" and got["digest match"] == "yes"
    assert got["restored state equals the fault-free state at step 12"] == "yes"


def test_a_recovery_that_fails_again_before_training_on_is_not_counted():
    """Three kills: the first recovery trains on (a step is committed), the second fails again before any commit
    (a new plan follows it), the third ends in a full restart: one recovery in process, one full restart."""
    def recovered(t: float, lost_at: float) -> Event:
        return event("recovered_in_process", t, 12, rank=0, survivor=True, failed_at=lost_at + 0.01, connected_at=t,
                     restored_at=t, lost_ranks=[1], decode_s=0.01, reshard_s=0.0, lost_at=lost_at)

    kill = dict(rank=1, phase="before_forward", target="rank", signal="SIGKILL", committed_step=12)
    events = [
        event("fault_injected", 100.0, 12, **kill), event("replacement_planned", 100.1, lost_ranks=[1]),
        recovered(100.4, 100.02), event("resumed", 101.0, 13),
        event("fault_injected", 110.0, 20, **kill), event("replacement_planned", 110.1, lost_ranks=[1]),
        recovered(110.4, 110.02), event("replacement_planned", 111.0, lost_ranks=[1]),
        event("fault_injected", 120.0, 24, **kill), event("restarting_all", 120.1, reason="no_survivor"),
        event("resumed", 130.0, 25), event("digest", 140.0, 30, digest="f" * 64, final=True),
    ]
    args = parse_args(["--in-process", "--nodes", "1", "--kill-rank", "1", "--at-step", "12"])
    got = dict(line.split(": ", 1) for line in summarize(args, True, events, REFERENCE))
    assert got["kills"] == "3; recovered in process: 1; full restarts: 1"


def test_a_shortened_fault_free_run_checks_the_restored_state_but_not_the_final_digest():
    args = parse_args(["--kill-node", "1", "--at-step", "6", "--reference-steps", "7", "--trainer.max_steps=100"])
    assert _reference_overrides(args) == ["--trainer.max_steps=7"]  # after the job's own overrides: it wins
    assert _reference_overrides(parse_args(["--at-step", "6"])) == []
    short = [event("digest", 1.0, 6, digest="a" * 64, final=False),
             event("digest", 2.0, 7, digest="b" * 64, final=True)]
    events = [
        event("fault_injected", 100.0, 6, phase="before_forward", target="node", signal="SIGKILL", committed_step=6),
        event("restored", 110.0, 6, **RESTORED),
        event("digest", 110.5, 6, digest="a" * 64, final=False),
        event("digest", 130.0, 100, digest="b" * 64, final=True),  # a digest the 7-step run also ended with
    ]
    got = dict(line.split(": ", 1) for line in summarize(args, True, events, short))
    assert got["restored state equals the fault-free state at step 6"] == "yes"
    assert "fault-free digest" not in got
    assert got["digest match"] == "no (not compared: the fault-free run stopped at step 7, --reference-steps)"


def test_a_fault_free_run_shortened_below_the_kill_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--at-step", "12", "--reference-steps", "5"])
    assert "--reference-steps 5 stops before --at-step 12" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--at-step", "12", "--reference-steps", "20", "--no-reference"])


# ---------------------------------------------------------------------------------------- --kills drills
def runner_kill(time: float, step: int | None) -> Event:
    """A kill of chaos's own runner: it knows no committed step (``committed_step`` None)."""
    return event("fault_injected", time, step, rank=-1, phase="random", target="rank", signal="SIGKILL",
                 committed_step=None)


def digests(*steps_at: tuple[float, int]) -> list[Event]:
    return [event("digest", t, step, digest=f"{step:064x}", final=False) for t, step in steps_at]


def test_a_single_runner_kill_reports_its_committed_step_and_steps_lost_from_the_events():
    """Before: an in-process kill of chaos's runner carries no committed step, and the report said "unknown"."""
    events = [*digests((10.0, 0), (11.0, 5), (12.0, 6)), runner_kill(12.5, 6),
              event("recovered_in_process", 13.0, 6, rank=0, survivor=True, failed_at=12.6, connected_at=12.9,
                    restored_at=13.0, lost_ranks=[1], decode_s=0.01, reshard_s=0.0, lost_at=12.55),
              event("resumed", 13.5, 7), event("digest", 20.0, 30, digest="f" * 64, final=True)]
    args = parse_args(["--in-process", "--nodes", "1", "--kill-rank", "1", "--at-step", "6"])
    got = dict(line.split(": ", 1) for line in summarize(args, True, events, REFERENCE))
    assert got["last committed step before the kill"] == "6" and got["steps lost"] == "0"


def test_a_kills_drill_reports_recoveries_by_kind_steps_lost_and_goodput():
    """Three kills under torchrun: a decode from spills, a checkpoint fallback (steps 20 -> 10), a start-over
    before any checkpoint (3 -> 0): 10 + 3 steps lost; goodput is the fault-free wall over this run's."""
    events = [
        *digests((1.0, 0), (2.0, 5)), runner_kill(2.5, 5),
        event("restored", 5.0, 5, **RESTORED), *digests((5.1, 5), (6.0, 20)), runner_kill(6.5, 20),
        event("fallback", 9.0, 10, why="x", checkpoint="/c/step=10.ckpt", failed_step=20, steps_lost=10, load_s=0.1),
        *digests((9.1, 10), (10.0, 30)), event("digest", 10.5, 30, digest="f" * 64, final=True),
    ]
    args = parse_args(["--nodes", "1", "--kills", "2", "--no-parity"])
    facts = drill_facts(args, True, events, REFERENCE, (80.0, 60.0), (2, ""))
    assert facts["recoveries"] == {"in process": 0, "restart + decode": 1, "checkpoint": 1, "shrunk in process": 0,
                                   "start over": 0}
    assert facts["steps_lost"] == 10 and [k["committed_step"] for k in facts["kills"]] == [5, 20]
    assert facts["goodput"] == 0.75 and facts["digest_match"] is True
    assert facts["mode"] == "torchrun, checkpoint only"
    got = dict(line.split(": ", 1) for line in summarize(args, True, events, REFERENCE, (80.0, 60.0), (2, "")))
    assert got["kills landed"] == "2 of 2" and got["steps lost"] == "10"
    assert got["last committed step before each kill"] == "5 (resumed at 5, restart + decode), 20 (resumed at 10, checkpoint)"
    assert got["recoveries"] == "restart + decode 1, checkpoint 1"
    assert got["goodput"].startswith("0.750") and got["digest match"] == "yes"


def test_kills_that_share_one_recovery_count_their_lost_steps_once():
    """A second kill during the restart the first one caused: one recovery answers both."""
    events = [*digests((1.0, 0), (2.0, 8)), runner_kill(2.5, 8), runner_kill(3.0, 8),
              event("fallback", 9.0, 0, why="x", checkpoint=None, failed_step=8, steps_lost=8, load_s=0.0),
              *digests((9.1, 0), (10.0, 30))]
    facts = drill_facts(parse_args(["--nodes", "1", "--kills", "2"]), True, events, None, (None, None), (2, ""))
    assert facts["steps_lost"] == 8 and facts["recoveries"]["start over"] == 1


def test_a_drill_whose_kills_did_not_land_says_so():
    args = parse_args(["--in-process", "--nodes", "1", "--kills", "3", "--no-reference"])
    got = dict(line.split(": ", 1) for line in summarize(args, True, digests((1.0, 0)), None, (30.0, None),
                                                            (0, "the job ended before the job committed a step")))
    assert got["kills landed"] == "0 of 3 (FAILED: the job ended before the job committed a step)"


def test_runs_that_differ_before_any_fault_are_reported_as_unseeded():
    """Without seed_everything the drill and its fault-free run differ from step 0: that is not a failed restore."""
    events = [event("digest", 1.0, 0, digest="1" * 64, final=False), runner_kill(2.0, 5),
              event("restored", 5.0, 5, **RESTORED), event("digest", 5.1, 5, digest="2" * 64, final=False),
              event("digest", 9.0, 30, digest="e" * 64, final=True)]
    reference = [event("digest", 0.5, 0, digest="0" * 64, final=False), *REFERENCE]
    args = parse_args(["--kill-node", "0", "--at-step", "5", "--replace"])
    got = dict(line.split(": ", 1) for line in summarize(args, True, events, reference))
    assert got["restored state equals the fault-free state at step 5"].startswith(
        "not comparable (the two runs differ at step 0, before any fault: the job is not seeded")
    assert "seed_everything" in got["digest match"]


def test_the_kill_schedules_are_drawn_from_the_seed():
    """Every mode gets the same kills from the same seed; a rate gives exponential delays of that mean."""
    assert plan(3, 2, seed=1, jitter=40.0, rate=None) == plan(3, 2, seed=1, jitter=40.0, rate=None)
    assert all(0 <= k.delay <= 40.0 and k.rank in (0, 1) for k in plan(50, 2, seed=1, jitter=40.0, rate=None))
    poisson = plan(4000, 4, seed=2, jitter=1.0, rate=6.0)  # 6 per minute: 10 s apart on average
    assert 9.5 < sum(k.delay for k in poisson) / len(poisson) < 10.5
    assert {k.rank for k in poisson} == {0, 1, 2, 3}


def test_kills_options_are_checked():
    for wrong in (["--kills", "-1", "--at-step", "3"], [], ["--kills", "2", "--kill-all"], ["--at-step", "3", "--kill-rate", "2"],
                  ["--kills", "2", "--script", __file__, "--no-parity"]):
        with pytest.raises(SystemExit):
            parse_args(wrong)
    assert parse_args(["--nodes", "1", "--kills", "2", "--kill-rate", "3"]).kill_rate == 3.0


def test_a_step_digested_but_not_yet_committed_is_not_counted_as_lost():
    """The digest of a step is recorded before its commit: a kill just after it finds the survivors' spill (and
    the restore) one step back, and no committed step was lost."""
    events = [*digests((1.0, 0), (2.0, 3), (3.0, 4)), runner_kill(3.01, 4),
              event("stopped", 3.1, 3, reason="SIGTERM", spill="x", spill_s=0.01, tentative_step=None),
              event("restored", 9.0, 3, **RESTORED), *digests((9.1, 3), (10.0, 30))]
    facts = drill_facts(parse_args(["--nodes", "1", "--kills", "1"]), True, events, None, (None, None), (1, ""))
    assert facts["steps_lost"] == 0 and facts["kills"][0]["committed_step"] == 3


def test_the_next_kill_waits_for_the_recovery_to_commit_a_step():
    """A digest a rank records just after a kill (it finished its step) is not a commit of the recovery."""
    events = [*digests((1.0, 0), (2.0, 1)), runner_kill(2.5, 1), *digests((2.6, 2), (9.0, 1))]
    assert trained_since(events, 0.0) == 2.0
    assert trained_since(events, 2.5) is None
    events.append(event("resumed", 9.5, 2))
    assert trained_since(events, 2.5) == 9.5
