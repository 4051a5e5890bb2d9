"""``lightning-dlrover advise``: it reads the history the config's ``ResourceAdvisor`` writes to, names every
measurement by its own configuration, and plots the measurements its model was fitted on (no empty panel)."""

import re
from pathlib import Path

import yaml

from lightning_dlrover.advisor.history import JobHistory, resolve_url
from lightning_dlrover.advisor.report import plot_data
from lightning_dlrover.advisor.resources import Machine, ResourceConfig, SearchSpace
from lightning_dlrover.advisor.warmstart import warm_start
from lightning_dlrover.cli.advise import job_from_config
from lightning_dlrover.cli.advise import main as advise

SIZES = [1000] * 26


def write_config(path: Path, root: Path, history: object = "run") -> Path:
    """A 4-rank job, global batch 512 (128 per rank), whose ResourceAdvisor keeps its history ``history``."""
    advisor = {"class_path": "lightning_dlrover.ResourceAdvisor", "init_args": {"history": history}}
    path.write_text(yaml.safe_dump({
        "trainer": {"devices": 4, "num_nodes": 1, "default_root_dir": str(root), "callbacks": [advisor]},
        "model": {"num_embeddings_per_feature": SIZES, "embedding_dim": 16},
        "data": {"global_batch_size": 512}}))
    return path


def record_past_job(db: str, config: Path, measured: list[tuple[ResourceConfig, float]]) -> None:
    """A finished job of the same signature in the history ``db`` with ``(config, step seconds)`` measurements."""
    signature, _, _ = job_from_config(config, Machine.detect())
    history = JobHistory(db)
    job = history.start_job("past", signature.to_dict(), signature.key(), measured[0][0].to_dict())
    history.add_measurements(job, [{**c.to_dict(), "steps": 5, "step_s": s, "data_wait_s": 0.0, "rss_bytes": 2**28,
                                    "cores_available": 4.0} for c, s in measured])
    history.finish_job(job, "finished", samples_per_sec=measured[0][0].global_batch / measured[0][1])
    history.close()


def test_advise_reads_the_history_the_configs_advisor_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LIGHTNING_DLROVER_HISTORY", str(tmp_path / "user.sqlite"))  # the user-wide one: empty
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path / "job.yaml", Path("runs/job"))  # history: run, under a relative root dir
    record_past_job(resolve_url("run", "runs/job"), config, [(ResourceConfig(1, 1, 1, 0, 512), 0.05)])
    assert advise(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "job history from" in out and "ResourceAdvisor history: run" in out
    assert "1 most recent job(s)" in out and "1 similar past job(s)" in out, out
    nothing = write_config(tmp_path / "none.yaml", tmp_path, history=None)
    assert advise(["--config", str(nothing)]) == 2
    assert "history: null: the job keeps no history to advise from; give --history" in capsys.readouterr().err


def test_advise_names_a_measurement_by_its_own_batch(tmp_path, capsys):
    db = resolve_url(tmp_path / "h.sqlite")
    config = write_config(tmp_path / "job.yaml", tmp_path)
    record_past_job(db, config, [(ResourceConfig(1, 1, 1, 0, 512), 0.05)])  # b=512: 10240 samples/s
    assert advise(["--history", db, "--config", str(config), "--list", "0"]) == 0
    out = capsys.readouterr().out
    assert "its fastest measured: 1x1 ranks, 1 thr, 0 wrk, b=512 (10240 samples/s)" in out, out
    assert "starting from 1x1 ranks, 1 thr, 0 wrk, b=128 (the job's own batch)" in out
    assert not re.search(r"b=128 \(\d+ samples/s", out)  # no b=128 was measured


def test_advise_plots_the_measurements_its_model_was_fitted_on(tmp_path, capsys):
    db = resolve_url(tmp_path / "h.sqlite")
    config = write_config(tmp_path / "job.yaml", tmp_path)
    b = 128
    record_past_job(db, config, [(ResourceConfig(1, 4, 1, 0, b), 0.060), (ResourceConfig(1, 2, 1, 0, b), 0.035),
                                 (ResourceConfig(1, 1, 1, 0, b), 0.022), (ResourceConfig(1, 4, 2, 0, b), 0.070)])
    png = tmp_path / "advise.png"
    assert advise(["--history", db, "--config", str(config), "--list", "0", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 10_000
    assert re.search(r"plot: .*advise\.png \(4 measured configurations of similar past jobs; held-out error", out), out
    # what the panels are drawn from, for the same history and config
    signature, current, _ = job_from_config(config, Machine.detect())
    found = warm_start(JobHistory(db), signature, current, SearchSpace(), Machine.detect())
    data = plot_data(found.model, found.observations, found.recommendation)
    assert len(data.measured) == len(data.predicted) == len(data.held_out) == 4  # left panel
    assert data.candidates and len(data.labels) == len(data.candidates) and data.measured_at  # right panel
