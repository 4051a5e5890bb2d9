"""The planner's failure and goodput model against cases computed by hand (pure Python, no ranks)."""

from __future__ import annotations

import math

import pytest

from lightning_dlrover.fault.coding.placement import ParityPlacement
from lightning_dlrover.planner import Candidate, FailureModel, JobCosts, estimate, make_plan, young_daly_interval
from lightning_dlrover.planner.goodput import covers_machine_loss

HOUR = 3600.0


def costs(**changes: float) -> JobCosts:
    """step 1 s, save 10 s, load 5 s, restart 20 s, in process 1 s, decode 2 s per k, capture 2%, commit 10%."""
    values = dict(step_s=1.0, state_bytes=1e9, save_s=10.0, load_s=5.0, restart_s=20.0, in_process_s=1.0,
                  decode_s=2.0, parity_capture=0.02, parity_commit=0.10, launch_overhead=0.0, refill_hours=1.0)
    values.update(changes)
    return JobCosts(**values)


def ranks_only(mtbf_hours: float = 10.0, world: int = 4) -> FailureModel:
    return FailureModel.from_job_mtbf(mtbf_hours, world, ranks_per_machine=1, machine_share=0.0)


def test_failures_within_a_recovery_restart_it():
    # a failure every 10 s on average, a 10 s restart: up while no failure landed in the last 10 s, exp(-1)
    e = estimate(Candidate("parity-restart", k=1, r=1, commit_every=1), costs(restart_s=10.0, decode_s=0.0,
                 parity_capture=0.0, parity_commit=0.0, step_s=1e-6), ranks_only(mtbf_hours=10 / 3600, world=2), 2)
    assert e.goodput == pytest.approx(math.exp(-1), rel=1e-4)


def test_young_daly_interval():
    assert young_daly_interval(10.0, 36000.0) == pytest.approx(848.528, rel=1e-5)  # sqrt(2 * 10 * 36000)


def test_published_failure_rates_reproduce_the_llama3_report():
    model = FailureModel.published()
    # 419 unexpected interruptions in 54 days on 16,384 GPUs: one every 1296 / 419 = 3.093 hours
    assert model.job_mtbf_hours(16384) == pytest.approx(1296 / 419, rel=1e-9)
    assert model.rank_mtbf_hours == pytest.approx(16384 / (0.587 * 419 / 1296), rel=1e-9)
    assert model.machine_mtbf_hours == pytest.approx(2048 / (0.413 * 419 / 1296), rel=1e-9)


def test_job_mtbf_override_gives_that_mtbf_at_that_size():
    model = FailureModel.from_job_mtbf(24.0, 1024, ranks_per_machine=8, machine_share=0.25)
    assert model.job_mtbf_hours(1024) == pytest.approx(24.0)
    assert model.machine_rate(1024) / (model.rank_rate(1024) + model.machine_rate(1024)) == pytest.approx(0.25)
    assert model.job_mtbf_hours(2048) == pytest.approx(12.0)  # twice the ranks, twice the failures


def test_checkpoint_only_goodput_by_hand():
    e = estimate(Candidate("checkpoint"), costs(), ranks_only(), 4)
    tau = math.sqrt(2 * 10 * 36000)  # 848.53 s
    kept = tau / (tau + 10)  # 0.988352
    loss = 20 + 5 + (tau + 10) / 2  # restart + load + half an interval: 454.26 s
    assert e.checkpoint_every_s == pytest.approx(tau)
    assert e.goodput == pytest.approx(kept * math.exp(-loss / 36000), rel=1e-9)  # no failure in the loss window
    assert e.goodput == pytest.approx(0.975960, abs=1e-6)
    assert e.checkpoint_every_steps == 849


def test_parity_restart_goodput_by_hand():
    e = estimate(Candidate("parity-restart", k=2, r=1, commit_every=4), costs(), ranks_only(), 4)
    step = 1 + 0.02 + 0.10 / 4  # 1.045 s
    loss = 20 + 2 * 2 + 4 * step / 2  # restart + decode from k = 2 sources + half a commit window: 26.09 s
    assert math.isinf(e.checkpoint_every_s) and e.checkpoint_every_steps is None  # every failure is covered
    assert e.goodput == pytest.approx((1 / step) * math.exp(-loss / 36000), rel=1e-9)
    assert e.goodput == pytest.approx(0.956245, abs=1e-6)


def test_parity_in_process_goodput_by_hand():
    e = estimate(Candidate("parity-in-process", k=2, r=1, commit_every=4, spares=1), costs(), ranks_only(), 4)
    step = 1.045
    found = math.exp(-0.1)  # ranks out of service: Poisson of mean 0.1 failures/h * 1 h; a spare is free if none
    rate = 1 / 36000
    inside = 1 - math.exp(-rate * (1 + 2 * 2))  # the next failure lands inside the 5 s recovery: launch restarts
    in_process = found * (1 - inside)
    # no spare free (or a failure inside the recovery): launch restarts every worker from the newest checkpoint, kept
    # at Young's interval for those
    tau = math.sqrt(2 * 10 / (rate * (1 - in_process)))
    waste = rate * in_process * (1 + 2 * 2 + 4 * step / 2) + rate * (1 - in_process) * (20 + 5 + (tau + 10) / 2)
    assert e.checkpoint_every_s == pytest.approx(tau)
    assert e.goodput == pytest.approx((1 / step) * tau / (tau + 10) * math.exp(-waste) * 4 / 5, rel=1e-9)  # spare paid


def test_parity_in_process_with_spares_respawned_at_once_by_hand():
    # launch re-spawns a used spare at once (CPU): 60 s to start it; failures every 2 minutes (rate 1/120 per s)
    c = JobCosts(step_s=1.0, state_bytes=1e9, save_s=10.0, load_s=5.0, restart_s=20.0, in_process_s=1.0, decode_s=0.0,
                 parity_capture=0.0, parity_commit=0.0, launch_overhead=0.0, spare_start_s=60.0)
    failures = FailureModel.from_job_mtbf(1 / 30, 2, ranks_per_machine=2, machine_share=0.0)
    e = estimate(Candidate("parity-in-process", k=1, r=1, commit_every=1, spares=1), c, failures, 2)
    rate = 1 / 120
    found = math.exp(-rate * 60)  # the spare started after the previous failure is up
    wait = 60 - 120 + 60 / math.expm1(0.5)  # else the rest of its start, on average
    recovery = 1 + (1 - found) * wait
    inside = 1 - math.exp(-rate * recovery)
    tau = math.sqrt(2 * 10 / (rate * inside))
    waste = rate * (1 - inside) * (recovery + 0.5) + rate * inside * (20 + 5 + (tau + 10) / 2)
    assert e.goodput == pytest.approx(tau / (tau + 10) * math.exp(-waste) * 2 / 3, rel=1e-9)


@pytest.mark.parametrize("world, per_machine, k, r", [(16, 8, 2, 1), (16, 8, 1, 1), (32, 8, 2, 2), (32, 8, 3, 1),
                                                      (24, 8, 2, 1), (8, 8, 1, 1)])
def test_machine_loss_coverage_matches_the_placement(world, per_machine, k, r):
    placement = ParityPlacement(world, k, r, per_machine)
    assert covers_machine_loss(world, per_machine, k, r) == placement.tolerates_node_loss


def test_uncovered_machine_loss_keeps_checkpoints_for_it():
    failures = FailureModel.from_job_mtbf(10.0, 16, ranks_per_machine=8, machine_share=0.5)
    covered = estimate(Candidate("parity-restart", k=1, r=1, commit_every=1), costs(), failures, 16)
    uncovered = estimate(Candidate("parity-restart", k=2, r=1, commit_every=1), costs(), failures, 16)
    assert math.isinf(covered.checkpoint_every_s) and covered.covered_share == 1.0
    assert uncovered.covered_share == pytest.approx(0.5)
    # checkpoints at Young's interval for the machine losses alone (rate 0.05 / h), on the parity job's steps
    assert uncovered.checkpoint_every_s == pytest.approx(math.sqrt(2 * 10 * HOUR / 0.05))


def test_plan_picks_the_highest_goodput_and_follows_the_failure_rate():
    rare = make_plan(costs(), ranks_only(mtbf_hours=1e6), 4)
    assert rare.best.candidate.strategy == "checkpoint"  # parity's per-step cost buys nothing
    frequent = make_plan(costs(save_s=60.0), ranks_only(mtbf_hours=0.5), 4)
    assert frequent.best.candidate.strategy != "checkpoint"
    for plan in (rare, frequent):
        assert plan.best.goodput == max(e.goodput for e in plan.estimates)
        assert "<- pick" in plan.table()


def test_fit_parity_recovers_capture_and_commit():
    capture, commit = 0.05, 0.4
    steps = {n: 2.0 * (1 + capture + commit / n) for n in (1, 4, 16)}
    assert JobCosts.fit_parity(2.0, steps) == pytest.approx((capture, commit))


@pytest.mark.parametrize("make, words", [
    (lambda: FailureModel.from_job_mtbf(-1, 8), "mtbf_hours=-1"),
    (lambda: FailureModel.from_job_mtbf(float("nan"), 8), "mtbf_hours=nan"),
    (lambda: FailureModel(rank_mtbf_hours=0), "rank_mtbf_hours=0"),
    (lambda: costs(step_s=0.0), "step_s=0.0"),
    (lambda: costs(save_s=-2.0), "save_s=-2.0"),
    (lambda: costs(state_bytes=0), "no embedding tables"),
    (lambda: make_plan(costs(), ranks_only(), 1, ("parity-restart",)), "at least 2 ranks"),
    (lambda: estimate(Candidate("parity-restart", k=4, r=1), costs(), ranks_only(), 4), "more than the world size"),
    (lambda: make_plan(costs(), ranks_only(), 0), "--ranks 0"),
])
def test_bad_input_is_a_clear_error(make, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        make()


def test_costs_from_a_jobs_own_step_records():
    from lightning_dlrover.planner.records import costs_from_records, step_name

    base = {step_name(None): 0.100, "save_s": 3.0}
    # a run without parity and one with k1 r1 N1: parity's per-step share is theirs
    one = costs_from_records({**base, step_name((1, 1, 1)): 0.112})
    assert one["step_s"] == 0.100 and one["save_s"] == 3.0
    assert one["parity_capture"] == pytest.approx(0.12) and one["parity_commit"] == 0.0
    # at two commit intervals: split into the per-step and the per-commit part (0.04 + 0.08 / N)
    two = costs_from_records({**base, step_name((1, 1, 1)): 0.112, step_name((1, 1, 4)): 0.106})
    assert two["parity_capture"] == pytest.approx(0.04) and two["parity_commit"] == pytest.approx(0.08)
    # parity steps alone: the step without parity is theirs less the default share; the share stays the default's
    alone = costs_from_records({step_name((2, 1, 1)): 0.120})
    assert alone["step_s"] == pytest.approx(0.120 / (1 + JobCosts.__dataclass_fields__["parity_capture"].default))
    assert "parity_capture" not in alone
    # a benchmark's measured share wins over the steps
    assert costs_from_records({**base, step_name((1, 1, 1)): 0.2, "parity_capture": 0.05})["parity_capture"] == 0.05


def test_the_plan_counts_parity_memory():
    e = estimate(Candidate("parity-restart", k=2, r=1, commit_every=4), costs(), ranks_only(), 4)
    assert e.parity_bytes_per_rank == pytest.approx(costs().state_bytes / 4 / 2) and e.memory_share == 0.5
    assert estimate(Candidate("checkpoint"), costs(), ranks_only(), 4).parity_bytes_per_rank == 0.0
    plan = make_plan(costs(), ranks_only(), 4)
    assert "parity GB/rank" in plan.table()


def test_a_spare_that_never_starts_at_idle_priority_is_waited_for_at_every_failure():
    # a loaded machine: the waiting spare's idle-priority start never ends; each failure promotes it and waits 12 s
    c = JobCosts(step_s=1.0, state_bytes=1e9, save_s=10.0, load_s=5.0, restart_s=20.0, in_process_s=1.0, decode_s=0.0,
                 parity_capture=0.0, parity_commit=0.0, launch_overhead=0.0, spare_start_s=12.0,
                 spare_idle_start_s=math.inf)
    failures = FailureModel.from_job_mtbf(1 / 30, 2, ranks_per_machine=2, machine_share=0.0)
    e = estimate(Candidate("parity-in-process", k=1, r=1, commit_every=1, spares=1), c, failures, 2)
    rate, recovery = 1 / 120, 1 + 12
    inside = 1 - math.exp(-rate * recovery)
    tau = math.sqrt(2 * 10 / (rate * inside))
    waste = rate * (1 - inside) * (recovery + 0.5) + rate * inside * (20 + 5 + (tau + 10) / 2)
    assert e.goodput == pytest.approx(tau / (tau + 10) * math.exp(-waste) * 2 / 3, rel=1e-9)
