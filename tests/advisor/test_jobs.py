"""The advisor in real multi-process DLRoverStrategy jobs (Lightning's launcher, gloo): a slowed rank is named with
its cause, a growing-memory job gets its forecast before it reaches its limit, a second job warm-starts from the
first one's history, and ``lightning-dlrover advise`` recommends from it."""

import json
import re
from pathlib import Path

import pytest

from lightning_dlrover.advisor.history import JobHistory, resolve_url
from lightning_dlrover.monitor import read_events
from tests.conftest import REPO, run

pytestmark = pytest.mark.slow
JOB = REPO / "tests" / "scripts" / "advisor_job.py"


def job(root: Path, *args: str) -> tuple[str, list]:
    proc = run([str(JOB), "--root", str(root), *args], root.parent, timeout=400)
    return proc.stdout, read_events([root / "dlrover_events.jsonl"])


@pytest.mark.parametrize("how, ms, cause", [("burn", 40, "compute"), ("sleep", 100, "data wait"), ("idle", 200, "idle")])
def test_slowed_rank_is_named_with_its_cause_within_bounded_steps(tmp_path, how, ms, cause):
    """burn: CPU work in each step; sleep: its loader sleeps before each batch; idle: it sleeps inside each step
    (between forward and backward), where only the time the other rank waits in collectives tells them apart. A
    slow-down under 30% of the step is not named (40 ms of loader sleep is less than that on a loaded machine)."""
    flag = {"burn": [], "sleep": ["--slow-sleep"], "idle": ["--slow-idle"]}[how]
    slow = ["--slow-rank", "1", "--slow-from", "15", "--slow-ms", str(ms), *flag]
    out, events = job(tmp_path / "run", "--devices", "2", "--advisor", "--profile-steps", "0", "--check-every", "5",
                      "--steps", "40", *slow)
    # Namings before the slow-down are other programs' bursts on a shared machine (both ranks wait alike then).
    named = [e for e in events if e.kind == "straggler" and e.step >= 15]
    assert named, out[-3000:]
    first = named[0]
    assert (first["straggler_rank"], first["cause"]) == (1, cause), named
    assert first["excess_ms"] > 0.6 * ms and first["ratio"] > 1.5
    assert 15 < first.step <= 15 + 3 * 5  # patience 2 windows of 5 steps (medians), plus one on a loaded machine
    assert all(e["straggler_rank"] == 1 for e in named)  # rank 0, which waits, is not blamed
    assert not [e for e in events if e.kind == "straggler" and e["cause"] == "communication"], named
    assert f"rank 1 is a straggler ({cause})" in out


def test_growing_memory_job_gets_its_forecast_well_before_the_limit(tmp_path):
    out, events = job(tmp_path / "run", "--devices", "2", "--advisor", "--profile-steps", "0", "--check-every", "5",
                      "--steps", "200", "--leak-mb", "4", "--leak-from", "5", "--headroom-mb", "320")
    crossed = int(re.search(r"LEAK_CROSSED_LIMIT step=(\d+)", out).group(1))
    forecasts = [e for e in events if e.kind == "oom_forecast"]
    assert forecasts, out[-3000:]
    first = forecasts[0]
    lead = crossed - first.step
    assert lead >= 10, (crossed, forecasts)
    for f in forecasts:  # 2 ranks x 4 MiB kept per step, and what the allocator adds
        assert 6 * 2**20 < f["growth_bytes_per_step"] < 16 * 2**20, forecasts
    # Each forecast's steps-to-OOM against what happened (the first one saw only 5 steps of growth).
    for f in forecasts[1:]:
        assert abs(f["steps_to_oom"] - (crossed - f.step)) <= max(5, 0.5 * (crossed - f.step)), (crossed, forecasts)
    assert "out of memory in ~" in out


@pytest.fixture(scope="module")
def history_runs(tmp_path_factory):
    """Two 1-rank jobs sharing one history; the first probes threads and data workers, the second warm-starts."""
    base = tmp_path_factory.mktemp("advisor")
    db = base / "history.sqlite"
    common = ["--devices", "1", "--advisor", "--history", str(db), "--profile-steps", "20", "--probe-steps", "5",
              "--steps", "30", "--batch", "64", "--search", json.dumps({"data_workers": [0, 1]})]
    first = job(base / "first", *common)
    second = job(base / "second", *common, "--apply")
    return base, db, first, second


def test_first_job_profiles_fits_and_reports(history_runs):
    base, db, (out, events), _ = history_runs
    assert "ResourceAdvisor (warm start): no similar past job" in out
    advice = json.loads((base / "first" / "advisor" / "advice.json").read_text())
    assert (base / "first" / "advisor" / "advisor_model.png").stat().st_size > 10_000
    assert "measured/s" in (base / "first" / "advisor" / "advisor_report.txt").read_text()
    assert advice["recommended_at_step"] in (15, 20) and advice["model"]["fitted_on"] >= 3  # 3-4 probes of 5 steps
    assert [e["stage"] for e in events if e.kind == "advice"] in ([], ["profile"])
    history = JobHistory(resolve_url(db))
    record = history.jobs()[-1]  # the first job (newest first)
    assert record.outcome == "finished" and record.samples_per_sec > 0 and record.model is not None
    probed = {(m["threads_per_rank"], m["data_workers"]) for m in history.measurements([record.id])}
    assert {t for t, _ in probed} == {1, 2} and {d for _, d in probed} == {0, 1} and len(probed) >= 3  # one knob at a time


def test_second_job_warm_starts_from_the_first(history_runs):
    _, db, _, (out, events) = history_runs
    assert re.search(r"warm start\): 1 similar past job\(s\); closest: #1 .*similarity 1\.00, finished", out), out[-3000:]
    assert len(JobHistory(resolve_url(db)).jobs()) == 2


def test_advise_cli_lists_history_and_recommends_for_a_config(history_runs, tmp_path):
    _, db, _, _ = history_runs
    config = tmp_path / "job.yaml"
    config.write_text("trainer: {devices: 1, num_nodes: 1}\nmodel: {num_embeddings_per_feature: [20000, 20000, 20000, "
                      "20000, 20000, 20000, 20000, 20000, 20000, 20000, 20000, 20000, 20000, 20000, 20000, 20000, "
                      "20000, 20000, 20000, 20000, 20000, 20000, 20000, 20000, 20000, 20000], embedding_dim: 16}\n"
                      "data: {global_batch_size: 64}\n")
    proc = run(["-m", "lightning_dlrover", "advise", "--history", str(db), "--config", str(config), "--workers", "0,1",
                "--plot", str(tmp_path / "advise.png")], tmp_path, timeout=200)
    assert "2 most recent job(s)" in proc.stdout and "DLRMModule" in proc.stdout
    assert re.search(r"2 similar past job\(s\)", proc.stdout), proc.stdout
    assert "recommended: 1x1 ranks" in proc.stdout and (tmp_path / "advise.png").is_file()
    bad = run(["-m", "lightning_dlrover", "advise", "--history", "nosuchdb://x/y"], tmp_path, check=False)
    assert bad.returncode == 2 and "not a database URL SQLAlchemy can open" in bad.stdout
