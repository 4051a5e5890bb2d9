"""The plan's pick carries the checkpoint interval (Young/Daly at the time a save blocks training in the job's save
mode) and the hot spares; ``plan`` prints both and compares save modes; ``launch --spares auto`` takes the spares
from the plan before any rank starts, and refuses what it cannot plan."""

from __future__ import annotations

import math

import pytest
import yaml

from lightning_dlrover.advisor.history import JobHistory, resolve_url
from lightning_dlrover.cli.launch import parse
from lightning_dlrover.cli.plan import main
from lightning_dlrover.planner import FailureModel, JobCosts, estimate, make_plan, young_daly_interval
from lightning_dlrover.planner.costs import SAVE_MODES, save_costs
from lightning_dlrover.planner.goodput import Candidate
from lightning_dlrover.planner.inputs import Pick, plan_inputs
from lightning_dlrover.planner.job import PlannedJob
from lightning_dlrover.planner.records import costs_from_records, save_names

TABLES = tuple((100_000, 64) for _ in range(26))


def _config(tmp_path, devices=8, nodes=1, strategy=None, rows=(100_000,) * 26) -> str:
    trainer = {"devices": devices, "num_nodes": nodes}
    if strategy is not None:
        trainer["strategy"] = {"class_path": "lightning_dlrover.DLRoverStrategy", "init_args": strategy}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"trainer": trainer, "data": {"global_batch_size": 4096},
                                    "model": {"num_embeddings_per_feature": list(rows), "embedding_dim": 64}}))
    return str(path)


def test_a_save_blocks_less_asynchronously_and_least_with_deltas():
    blocking, async_, incremental = (save_costs(m, 2.0) for m in ("blocking", "async", "async+incremental"))
    assert blocking == (pytest.approx(2.0 / 0.54), 0.0)  # a blocking save holds training for its whole write
    assert async_[0] < blocking[0] / 10 and async_[1] > 1.0  # a copy blocks; the write commits later
    assert incremental[0] < async_[0]  # a chain of one full link and 3 deltas: the mean per save
    assert save_costs("async+incremental", 2.0, 1) == pytest.approx(async_)  # every save full: an async save
    with pytest.raises(ValueError, match="save mode 'fast' is not one of"):
        save_costs("fast", 1.0)


def test_the_interval_follows_the_blocked_time_and_waits_for_the_commit():
    failures = FailureModel.from_job_mtbf(10.0, 64, 8, machine_share=0.0)
    blocking = JobCosts.estimate(1.0, 64e9, 64, 8)
    async_ = JobCosts.estimate(1.0, 64e9, 64, 8, save_mode="async")
    b, a = (estimate(Candidate("checkpoint"), c, failures, 64) for c in (blocking, async_))
    assert b.checkpoint_every_s == pytest.approx(young_daly_interval(blocking.save_s, 36000.0))
    assert a.checkpoint_every_s == pytest.approx(young_daly_interval(async_.save_s, 36000.0))
    assert a.checkpoint_every_s < b.checkpoint_every_s and a.goodput > b.goodput
    # a failure before the newest save committed loses back to the one before: the lag costs goodput
    lagged = async_.with_measured(save_lag_s=600.0)
    late = estimate(Candidate("checkpoint"), lagged, failures, 64)
    assert late.goodput < a.goodput
    assert late.checkpoint_every_s == 600.0  # a save waits for the one still being written: never shorter


def test_the_jobs_measured_saves_of_its_mode_win():
    recorded = {"save_s": 40.0, "save_s.async": 0.3, "save_lag_s.async": 5.0}
    assert costs_from_records(recorded, "async")["save_s"] == 0.3
    assert costs_from_records(recorded, "async")["save_lag_s"] == 5.0
    assert costs_from_records(recorded, "blocking")["save_s"] == 40.0  # no blocking save measured: the plain one
    assert save_names("async+incremental") == ("save_s.async+incremental", "save_lag_s.async+incremental")


def test_the_pick_carries_the_interval_and_the_spares():
    job = PlannedJob(TABLES, 4, 2, 4096)
    costs = JobCosts.estimate(0.5, job.state_bytes, 8, 4, restart_s=300.0, parity_capture=0.01,
                              launch_overhead=0.0, refill_hours=0.01)
    plan = make_plan(costs, FailureModel.from_job_mtbf(0.05, 8, 4), 8)
    pick = Pick.of(plan.best)
    assert plan.best.candidate.strategy == "parity-in-process"
    assert pick.spares == plan.best.candidate.spares == 4
    assert pick.parity == {"k": plan.best.candidate.k, "r": plan.best.candidate.r,
                           "commit_every_n_steps": plan.best.candidate.commit_every}
    assert pick.checkpoint_every_steps == round(plan.best.checkpoint_every_s / plan.best.step_s)
    checkpoint = Pick.of(plan.best_of("checkpoint"))
    assert checkpoint.parity is None and checkpoint.spares == 0 and checkpoint.checkpoint_every_steps >= 1


def test_the_config_says_how_the_job_saves(tmp_path):
    job = PlannedJob.from_config(yaml.safe_load(open(_config(
        tmp_path, strategy={"async_checkpoint": True, "incremental_checkpoint_every": 8}))))
    assert (job.save_mode, job.incremental_every) == ("async+incremental", 8)
    assert PlannedJob.from_config(yaml.safe_load(open(_config(tmp_path)))).save_mode == "blocking"
    inputs = plan_inputs(job, 1024, 8, mtbf_hours=5.0)
    assert inputs.costs_at(1024).save_s == pytest.approx(save_costs("async+incremental", inputs.costs_at(
        1024).state_bytes / 128 / 1e9, 8)[0])


def test_plan_prints_the_interval_spares_and_each_save_modes_pick(tmp_path, capsys):
    assert main(["--config", _config(tmp_path), "--ranks", "1024", "--sweep-saves"]) == 0
    out = capsys.readouterr().out
    pick = next(line for line in out.splitlines() if line.startswith("pick: "))
    assert "checkpoint every" in pick and "launch --spares" in pick
    for mode in SAVE_MODES:
        assert f"\n  {mode} " in out
    assert "<- the job's" in out
    sweep = out[out.index("pick's checkpoint interval and goodput against ranks"):].splitlines()[2:]
    assert [int(line.split()[0]) for line in sweep] == [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert main(["--config", _config(tmp_path), "--ranks", "1024", "--save-mode", "async"]) == 0
    assert "(async: blocked per save" in capsys.readouterr().out


def test_launch_spares_auto_takes_the_plans_spares_per_machine(tmp_path, monkeypatch):
    config = _config(tmp_path, devices=4, nodes=2)
    history = tmp_path / "h.sqlite"
    db = JobHistory(resolve_url(history))  # slow restarts, cheap parity, spares refilled in 36 s: in process pays
    db.add_costs(PlannedJob.from_config(yaml.safe_load(open(config))).key(),
                 {"restart_s": 300.0, "parity_capture": 0.01, "launch_overhead": 0.0, "refill_hours": 0.01,
                  "step_s": 0.5})
    db.close()
    monkeypatch.setenv("LIGHTNING_DLROVER_HISTORY", str(history))
    monkeypatch.setenv("LIGHTNING_DLROVER_MTBF_HOURS", "0.05")
    args = parse(["--nnodes", "2", "--nproc-per-node", "4", "--spares", "auto", "--", "-m", "lightning_dlrover",
                  "fit", "--config", config])
    assert args.spares == math.ceil(4 / 2)  # the pick's 4 spares over 2 machines
    monkeypatch.delenv("LIGHTNING_DLROVER_HISTORY")
    monkeypatch.delenv("LIGHTNING_DLROVER_MTBF_HOURS")
    args = parse(["--nproc-per-node", "4", "--spares", "auto", "--", "train.py", f"--config={config}"])
    assert args.spares == 0  # published failure rates: checkpoints only, no spare


@pytest.mark.parametrize("program, env, words", [
    (["train.py"], {}, "--spares auto: the program has no --config job.yaml to plan from"),
    (["train.py", "--config", "missing.yaml"], {}, "--spares auto: the program's --config missing.yaml does not exist"),
    (["train.py", "--config", "{job}"], {"LIGHTNING_DLROVER_MTBF_HOURS": "-2"},
     "--spares auto: $LIGHTNING_DLROVER_MTBF_HOURS=-2.0: the job's mean time between failures must be > 0 hours"),
    (["train.py", "--config", "{bad}"], {},
     "--spares auto: an embedding table of 0 rows x 64 columns makes no sense"),
])
def test_launch_spares_auto_refuses_what_it_cannot_plan(tmp_path, monkeypatch, capsys, program, env, words):
    job = _config(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(job).read().replace("100000", "0", 1))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        parse(["--spares", "auto", "--", *(a.format(job=job, bad=bad) for a in program)])
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def test_launch_spares_refuses_a_negative_count(capsys):
    with pytest.raises(SystemExit):
        parse(["--spares", "-1", "--", "train.py"])
    assert "--spares -1 must be >= 0" in capsys.readouterr().err
