"""``lightning-dlrover plan``: the table, the pick and the plot without training, costs and failures from a job
history, and clear errors for input that makes no sense. And the advisor's record of observed failures."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from lightning_dlrover.advisor.history import JobHistory, resolve_url
from lightning_dlrover.advisor.recorder import observed_failures
from lightning_dlrover.cli.plan import main
from lightning_dlrover.monitor import events
from lightning_dlrover.planner import FailureModel
from lightning_dlrover.planner.job import PlannedJob
from lightning_dlrover.planner.records import read_costs, read_failures
from tests.conftest import REPO


def _config(tmp_path, rows=(100_000,) * 26, devices=8) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"devices": devices}, "data": {"global_batch_size": 4096},
                                    "model": {"num_embeddings_per_feature": list(rows), "embedding_dim": 64}}))
    return str(path)


def test_plan_prints_every_strategy_and_the_pick_and_plots(tmp_path, capsys):
    assert main(["--config", _config(tmp_path), "--ranks", "1024", "--mtbf-hours", "2", "--plot",
                 str(tmp_path / "goodput.png")]) == 0
    out = capsys.readouterr().out
    for strategy in ("checkpoint", "parity-restart", "parity-in-process"):
        assert f"\n{strategy} " in out
    assert "<- pick" in out and "\npick: " in out
    assert "job MTBF 2.00 h" in out
    assert (tmp_path / "goodput.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_takes_costs_and_failures_from_the_history(tmp_path, capsys):
    config = _config(tmp_path)
    history = str(tmp_path / "h.sqlite")
    db = JobHistory(resolve_url(history))
    job = db.start_job("run-1", {}, "sig", {"nodes": 1, "ranks_per_node": 8})
    with db.engine.begin() as conn:  # the job ran 10 hours
        conn.execute(db_jobs(db).update().values(started_at=0.0, updated_at=36000.0))
    db.add_failures(job, [{"time": 1.0, "kind": "restored", "world_size": 8, "lost_ranks": 1, "recovery_s": 4.0}] * 4)
    db.add_costs(PlannedJob.from_config(yaml.safe_load(open(config))).key(), {"save_s": 42.0, "step_s": 0.5})
    db.close()
    assert read_failures(history) == (4, pytest.approx(80.0))  # 4 failures in 8 ranks x 10 h
    assert main(["--config", config, "--history", history]) == 0
    out = capsys.readouterr().out
    assert "job history: 4 failure(s) in 80.0 rank-hours" in out
    assert "save 42.00 s" in out and "step 0.500 s" in out


def db_jobs(db):
    from lightning_dlrover.advisor.history import jobs

    return jobs


def test_the_advisor_records_the_failures_its_job_observed(tmp_path, monkeypatch):
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(events.EVENTS_ENV, str(path))
    events.emit("restored", step=5, old_world_size=2, world_size=2, lost_ranks=[1], decode_s=0.2, reshard_s=0.1)
    events.emit("recovered_in_process", step=9, survivor=True, lost_ranks=[0], decode_s=0.1, reshard_s=0.0,
                lost_at=100.0, failed_at=100.1, connected_at=100.2, restored_at=100.5)
    events.emit("resumed", step=6)
    rows = observed_failures(events.read_events([path]), since=0.0, world_size=2)
    assert [(r["kind"], r["lost_ranks"], r["world_size"]) for r in rows] == [("restored", 1, 2),
                                                                             ("recovered_in_process", 1, 2)]
    assert rows[0]["recovery_s"] == pytest.approx(0.3) and rows[1]["recovery_s"] == pytest.approx(0.5)
    assert observed_failures(events.read_events([path]), since=rows[-1]["time"] + 1, world_size=2) == []
    model = FailureModel.from_observed(2, 20.0, ranks_per_machine=2)
    assert model.rank_mtbf_hours == 10.0


def test_recorded_costs_are_read_by_their_job_key(tmp_path):
    history = str(tmp_path / "h.sqlite")
    db = JobHistory(resolve_url(history))
    db.add_costs("a", {"save_s": 1.0, "bogus": 3.0})
    db.add_costs("a", {"save_s": 2.0})
    db.add_costs("b", {"save_s": 9.0})
    db.close()
    assert read_costs(history, "a") == {"save_s": 2.0}  # the newest; unknown names ignored


@pytest.mark.parametrize("args, words", [
    (["--mtbf-hours", "-1"], "--mtbf-hours -1.0 must be a positive number"),
    (["--mtbf-hours", "nan"], "--mtbf-hours nan must be a positive number"),
    (["--ranks", "0"], "--ranks 0 must be >= 1"),
    (["--step-s", "0"], "--step-s 0.0 must be a positive number"),
    (["--machine-share", "1.5"], "--machine-share 1.5 must be in [0, 1)"),
])
def test_nonsense_flags_are_refused(tmp_path, capsys, args, words):
    with pytest.raises(SystemExit) as exit_:
        main(["--config", _config(tmp_path), *args])
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("rows, words", [((), "the config has no embedding tables"),
                                         ((100, 0), "an embedding table of 0 rows x 64 columns makes no sense")])
def test_a_config_without_usable_tables_is_refused(tmp_path, capsys, rows, words):
    assert main(["--config", _config(tmp_path, rows=rows)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-dlrover plan: error: ") and words in err


def test_plan_loads_neither_lightning_nor_torchrec(tmp_path):
    code = ("import sys\nfrom lightning_dlrover.cli import main\n"
            f"try:\n    main(['plan', '--config', {_config(tmp_path)!r}, '--ranks', '64'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('lightning', 'torchrec', 'torch') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines()[-1] == "[]", out.stderr[-3000:]


def test_the_advisors_job_record_keeps_its_failures_for_the_planner(tmp_path, monkeypatch):
    from lightning_dlrover.advisor.config import AdvisorConfig
    from lightning_dlrover.advisor.recorder import JobRecorder
    from lightning_dlrover.advisor.resources import ResourceConfig

    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(events.EVENTS_ENV, str(path))
    events.emit("restored", step=3, old_world_size=2, world_size=2, lost_ranks=[1], decode_s=0.1, reshard_s=0.1)
    history = str(tmp_path / "h.sqlite")
    recorder = JobRecorder(AdvisorConfig(history=history))
    recorder.started_at = 0.0
    recorder.history = JobHistory(resolve_url(history))
    recorder.job_id = recorder.history.start_job("run", {}, "sig", {"nodes": 1, "ranks_per_node": 2})
    recorder.finish("recovered", None, [], None, None, ResourceConfig(nodes=1, ranks_per_node=2))
    recorder.history.close()
    assert read_failures(history)[0] == 1
