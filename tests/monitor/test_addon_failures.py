"""An add-on never ends a training run (issue #20): a failure injected into each add-on of a real 2-rank fit is
reported once per rank (an ``addon_failed`` event and a warning), the add-on steps back (a half-made change put back)
and the fit reaches its last step; add-on options that cannot work are refused in the launching process, before any
rank starts, with one line and exit status 2."""

from __future__ import annotations

import sys

import pytest

from lightning_dlrover import ElasticBatchScaler, ResourceAdvisor
from lightning_dlrover.monitor import read_events
from tests.conftest import REPO, forked, run

SCALER_JOB = REPO / "tests" / "elastic" / "elastic_job.py"
ADVISOR_JOB = REPO / "tests" / "scripts" / "advisor_job.py"
INJECT = REPO / "tests" / "scripts" / "inject.py"


def failures(root, addon):
    return [e for e in read_events([root / "dlrover_events.jsonl"]) if e.kind == "addon_failed" and e["addon"] == addon]


@pytest.mark.slow
def test_scaler_that_fails_mid_change_puts_batch_and_lrs_back_and_the_fit_goes_on(tmp_path):
    # The batch 64 is outside [128, 256]: the scaler switches at train start; the LRs are scaled, then it fails.
    proc = run(forked(SCALER_JOB, "--log", tmp_path / "samples", "--devices", "2", "--steps", "4", "--batch", "64",
                "--range", "128", "256", "--inject", "lightning_dlrover.elastic.scaler:scale_learning_rates!"),
               tmp_path, timeout=400)
    assert "`Trainer.fit` stopped: `max_steps=4` reached." in proc.stdout
    [events] = [failures(tmp_path, "ElasticBatchScaler")]
    assert sorted(e.rank for e in events) == [0, 1], proc.stdout[-3000:]
    assert all(e["hook"] == "on_train_start" and "injected failure" in e["error"] for e in events)
    assert all(e["stepped_back_to"].startswith("global batch 64 on 2 ranks") for e in events)
    assert 'scaler: {"world_size": 2, "global_batch": 64, "lrs": [0.05], "history": []}' in proc.stdout  # put back
    for rank in (0, 1):  # every step trained the old batch
        assert set(line.split('"batch": ')[1].split(",")[0]
                   for line in (tmp_path / f"samples.rank{rank}").read_text().splitlines()) == {"32"}
    assert proc.stdout.count("ElasticBatchScaler failed in on_train_start") == 2  # one warning per rank


@pytest.mark.slow
def test_advisor_whose_history_and_report_fail_goes_on_in_memory(tmp_path):
    root = tmp_path / "run"
    proc = run(forked(ADVISOR_JOB, "--root", root, "--devices", "2", "--advisor", "--history", tmp_path / "h.sqlite",
                "--profile-steps", "15", "--probe-steps", "5", "--steps", "20", "--search", '{"data_workers": [0]}',
                "--inject", "lightning_dlrover.advisor.history:JobHistory.start_job",
                "lightning_dlrover.advisor.callback:write_reports"), tmp_path, timeout=400)
    assert "FINAL_STEP 20 world_size 2" in proc.stdout, proc.stdout[-3000:]
    events = failures(root, "ResourceAdvisor")
    assert {e["hook"]: e.rank for e in events} == {"history": 0, "report": 0}, events
    assert "in memory" in next(e for e in events if e["hook"] == "history")["stepped_back_to"]
    assert "ResourceAdvisor (profile): " in proc.stdout  # it went on: recommended after its window
    assert not (root / "advisor" / "advice.json").exists()


@pytest.mark.slow
def test_monitor_failing_on_one_rank_still_joins_the_collectives(tmp_path):
    root = tmp_path / "run"
    proc = run(forked(ADVISOR_JOB, "--root", root, "--devices", "2", "--steps", "10",
                "--inject", "lightning_dlrover.monitor.throughput:rss_bytes@3#1"), tmp_path, timeout=300)
    assert "FINAL_STEP 10 world_size 2" in proc.stdout, proc.stdout[-3000:]
    [event] = failures(root, "ThroughputMonitor")
    assert (event.rank, event.step, event["hook"]) == (1, 4, "on_train_batch_end")
    assert "ThroughputMonitor: failed on rank(s) [1]; no summary." in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("spec, hook", [
    ("lightning_dlrover.advisor.runtime:RuntimeWatch.check@1#1", "on_train_batch_end"),  # before its 2nd gather
    ("lightning_dlrover.advisor.window:gather#1", "on_train_batch_end"),  # before the first probe's gather
    ("lightning_dlrover.advisor.callback:broadcast@1#1", "on_train_batch_end"),  # before the recommendation's
    ("lightning_dlrover.advisor.callback:broadcast#1", "on_train_batch_start"),  # before the warm start's
])
def test_advisor_failing_on_one_rank_before_its_collective_steps_back_on_every_rank(tmp_path, spec, hook):
    # Rank 1's advisor fails right before a collective rank 0 enters: before the fix rank 0 waited there for good.
    root = tmp_path / "run"
    proc = run(forked(ADVISOR_JOB, "--root", root, "--devices", "2", "--advisor", "--steps", "16", "--check-every", "4",
                "--profile-steps", "6", "--probe-steps", "3", "--search", '{"data_workers": [0]}',
                "--inject", spec), tmp_path, timeout=240)
    assert "FINAL_STEP 16 world_size 2" in proc.stdout, proc.stdout[-3000:]
    events = failures(root, "ResourceAdvisor")
    assert sorted(e.rank for e in events) == [0, 1], events  # each rank reports once
    by_rank = {e.rank: e for e in events}
    assert by_rank[1]["hook"] == hook and "injected failure" in by_rank[1]["error"]
    assert by_rank[0]["error_type"] == "PeerFailed" and "rank(s) [1]" in by_rank[0]["error"]
    assert by_rank[0].step == by_rank[1].step  # stepped back together, at the same collective


@pytest.mark.slow
def test_scaler_failing_on_one_rank_before_its_goodput_decision_steps_back_on_every_rank(tmp_path):
    # Rank 1 fails predicting the gain, right before the decision's collective rank 0 enters (hung before the fix).
    proc = run(forked(SCALER_JOB, "--log", tmp_path / "samples", "--devices", "2", "--steps", "8", "--batch", "64",
                "--range", "32", "256", "--policy", "goodput", "--check-every", "3",
                "--inject", "lightning_dlrover.elastic.goodput:GoodputModel.worth_switching#1"), tmp_path, timeout=240)
    assert "`Trainer.fit` stopped: `max_steps=8` reached." in proc.stdout, proc.stdout[-3000:]
    by_rank = {e.rank: e for e in failures(tmp_path, "ElasticBatchScaler")}
    assert sorted(by_rank) == [0, 1] and by_rank[0].step == by_rank[1].step == 3, by_rank
    assert "injected failure" in by_rank[1]["error"] and "rank(s) [1]" in by_rank[0]["error"]


@pytest.mark.slow
def test_tuner_failing_after_a_decision_goes_back_to_the_last_pipeline_and_the_fit_goes_on(tmp_path):
    from lightning_dlrover.data.generate import GeneratorConfig, generate_days

    [path] = generate_days(tmp_path / "data", 1, 20_000, GeneratorConfig(max_vocab=5000, seed=2))
    proc = run([INJECT, "lightning_dlrover.pipeline_tuner.harness:TunerDriver.after_batch@4!", "--", "fit", "--config",
                REPO / "configs" / "tsv.yaml", "--trainer.max_steps=10", "--trainer.enable_progress_bar=false",
                f"--data.criteo_paths=[{path}]", "--data.global_batch_size=1024", f"--trainer.default_root_dir={tmp_path}",
                "--trainer.callbacks.init_args.window_s=0.2", "--trainer.callbacks.init_args.min_batches=1"],
               tmp_path, timeout=400, program=[sys.executable])
    assert "`Trainer.fit` stopped: `max_steps=10` reached." in proc.stdout, proc.stdout[-3000:]
    events = failures(tmp_path, "PipelineTuner")
    assert sorted(e.rank for e in events) == [0, 1] and all(e.step == 5 for e in events), events
    assert all(e["stepped_back_to"].startswith("pipeline config ") for e in events)
    kinds = [e.kind for e in read_events([tmp_path / "dlrover_events.jsonl"])]
    assert "pipeline_tuned" not in kinds  # off after its failure


# ------------------------------------------------------------------------------------------------ refused up front
def test_history_problems_are_named_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"driver 'psycopg' is not installed; `pip install psycopg`"):
        ResourceAdvisor(history="postgresql://user@127.0.0.1/db")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"history file .*h.sqlite cannot be created in .*file; give a writable path"):
        ResourceAdvisor(history=str(tmp_path / "file" / "h.sqlite"))
    scaler = ElasticBatchScaler(100, 101)
    scaler.validate(1)
    with pytest.raises(ValueError, match=r"no global batch in \[100, 101\] is divisible by world size 3"):
        scaler.validate(3)


@pytest.mark.slow
@pytest.mark.parametrize("callback, message", [
    ("{class_path: lightning_dlrover.ElasticBatchScaler, init_args: {min_batch: 512, max_batch: 256}}",
     "trainer.callbacks: ElasticBatchScaler: batch range [512, 256]: min > max"),
    ("{class_path: lightning_dlrover.ElasticBatchScaler, init_args: {min_batch: 100, max_batch: 101}}",
     "no global batch in [100, 101] is divisible by world size 3"),
    ("{class_path: lightning_dlrover.ResourceAdvisor, init_args: {history: 'postgresql://u@127.0.0.1/db'}}",
     "`pip install psycopg`"),
    ("{class_path: lightning_dlrover.ResourceAdvisor, init_args: {history: FILE/h.sqlite}}",
     "cannot be created in"),
])
def test_bad_addon_option_is_one_line_and_exit_2_before_ranks_start(tmp_path, callback, message):
    (tmp_path / "file").write_text("")
    extra = tmp_path / "bad.yaml"
    extra.write_text(f"trainer:\n  callbacks:\n    - {callback.replace('FILE', str(tmp_path / 'file'))}\n")
    proc = run(["-m", "lightning_dlrover", "fit", "--config", REPO / "configs" / "demo.yaml", "--config", extra,
                f"--trainer.default_root_dir={tmp_path}"], tmp_path, check=False, timeout=200)
    assert proc.returncode == 2, proc.stdout[-3000:]
    [line] = [line for line in proc.stdout.splitlines() if "error" in line.lower()]
    assert line.startswith("lightning-dlrover fit: error: ") and message in line
    assert "Traceback" not in proc.stdout and "Subtypes" not in proc.stdout and "[rank: 1]" not in proc.stdout
