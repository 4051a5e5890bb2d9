"""``ResourceAdvisor(apply=True)`` in a real 2-rank job (gloo) on the TSV pipeline with the ``PipelineTuner`` and the
``ElasticBatchScaler``: threads, data workers (the tuner's budget) and the per-rank batch (the scaler's global batch,
learning rates by its rule) change while training, each change is an event and is seen in the job's steps."""

import json

import pytest
import torch
import yaml

from lightning_dlrover.advisor.live import LiveApplier, with_workers
from lightning_dlrover.data.generate import GeneratorConfig, generate_days
from lightning_dlrover.data.staged import PipelineConfig
from lightning_dlrover.monitor import read_events
from tests.conftest import REPO, digests, run


def test_with_workers_keeps_the_heavy_stages_out_of_the_trainer_longest():
    start = PipelineConfig(1, 2, 1, 1, 2)
    assert with_workers(start, 3) == PipelineConfig(0, 2, 1, 0, 2)
    assert with_workers(start, 1) == PipelineConfig(0, 1, 0, 0, 2)
    assert with_workers(start, 0).total_workers == 0
    assert with_workers(PipelineConfig(0, 0, 0, 0, 0), 2) == PipelineConfig(0, 1, 1, 0, 1)
    with pytest.raises(ValueError, match="0 or more"):
        with_workers(start, -1)


def test_live_applier_records_a_thread_change_and_sees_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DLROVER_EVENTS", str(tmp_path / "events.jsonl"))
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    applier = LiveApplier([])
    try:
        assert applier.apply({"threads_per_rank": target}, step=3, stage="profile") == {"threads_per_rank": target}
        applier.check(step=4, samples=None)
    finally:
        torch.set_num_threads(before)
    applied, seen = read_events([tmp_path / "events.jsonl"])
    assert (applied.kind, applied["old"], applied["new"], applied["via"]) == ("advice_applied", before, target,
                                                                               "torch.set_num_threads")
    assert (seen.kind, seen["value"], seen["applied_step"], seen["steps"]) == ("advice_in_effect", target, 3, 1)
    assert applier.pending == []


@pytest.mark.slow
def test_advisor_applies_threads_workers_and_batch_through_their_owners(tmp_path):
    [path] = generate_days(tmp_path / "data", 1, 16_000, GeneratorConfig(max_vocab=5000, seed=2))
    config = yaml.safe_load((REPO / "configs" / "tsv.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=18, default_root_dir=str(tmp_path / "run"), enable_progress_bar=False,
                   enable_checkpointing=False)
    # The cost objective with one cheaper candidate makes the recommendation independent of noisy timings:
    # 2 ranks x (1 thread + 1 worker), 128 per rank, against the job's 2 x (2 + 2), 256 per rank.
    trainer["callbacks"] = [
        {"class_path": "lightning_dlrover.ThroughputMonitor", "init_args": {"log_every_n_steps": 1000}},
        {"class_path": "lightning_dlrover.PipelineTuner",
         "init_args": {"tuner": "rl", "cpus": 2, "memory_mb": 1024, "window_s": 0.5,
                       "start": {"read": 0, "parse": 1, "transform": 1, "assemble": 0, "prefetch": 2}}},
        {"class_path": "lightning_dlrover.ElasticBatchScaler",
         "init_args": {"min_batch": 128, "max_batch": 1024, "policy": "keep_global", "lr_rule": "sqrt"}},
        {"class_path": "lightning_dlrover.ResourceAdvisor",
         "init_args": {"profile_steps": 12, "probe_steps": 3, "settle_steps": 1, "apply": True, "history": None,
                       "objective": "cost", "target_samples_per_sec": 1.0, "cost_per_core_hour": 1.0,
                       "extrapolate": True, "check_every_n_steps": 1000,
                       "search": {"ranks_per_node": [2], "threads_per_rank": [1], "data_workers": [1],
                                  "batch_per_rank": [128]}}},
    ]
    config["data"].update(criteo_paths=[str(path)], global_batch_size=512)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    proc = run(["-m", "lightning_dlrover", "fit", "--config", str(tmp_path / "job.yaml")], tmp_path, timeout=300,
               env={"OMP_NUM_THREADS": "2"})
    out = proc.stdout
    events = read_events([tmp_path / "run" / "dlrover_events.jsonl"])
    [advice] = [e for e in events if e.kind == "advice"]
    assert advice["stage"] == "profile" and advice.step == 12, out[-4000:]
    assert advice["applied"] == {"threads_per_rank": 1, "data_workers": 1, "batch_per_rank": 128}
    applied = [e for e in events if e.kind == "advice_applied"]
    assert {(e.rank, e["knob"], e["old"], e["new"], e["via"]) for e in applied} == {
        (rank, knob, old, new, via) for rank in (0, 1) for knob, old, new, via in (
            ("threads_per_rank", 2, 1, "torch.set_num_threads"), ("data_workers", 2, 1, "PipelineTuner.set_budget"),
            ("batch_per_rank", 256, 128, "ElasticBatchScaler.set_batch_per_rank"))}
    # Each change seen in the job's own steps on both ranks: threads in use, 128 samples per step, one worker.
    seen = {(e.rank, e["knob"]): e for e in events if e.kind == "advice_in_effect"}
    knobs = ("threads_per_rank", "data_workers", "batch_per_rank")
    assert set(seen) == {(r, k) for r in (0, 1) for k in knobs}, out[-4000:]
    assert all(e["applied_step"] == 12 and 0 <= e["steps"] <= 5 for e in seen.values()), seen
    # The scaler owned the batch: the global batch went 512 -> 256 and the learning rates by its sqrt rule.
    final = [e for e in events if e.kind == "batch_rescaled"][-1]
    assert (final["reason"], final["old_global_batch"], final["global_batch"]) == ("advisor", 512, 256)
    assert final["lr_factor"] == pytest.approx(0.5 ** 0.5)
    # The tuner owned the workers: it ended within its new budget; training went on to the last step.
    tuned = [e for e in events if e.kind == "pipeline_tuned"]
    assert len(tuned) == 2 and all(e["budget_cpus"] == 1 for e in tuned), tuned
    assert all(sum(int(part[1:]) for part in e["config"].split()[:4]) <= 1 for e in tuned), tuned  # "r0 p1 t0 a0 q2"
    [digest] = [e for e in events if e.kind == "digest" and e["final"]]
    assert digest.step == 18 and digest["digest"] == digests(out)["end"]
    advice_file = json.loads((tmp_path / "run" / "advisor" / "advice.json").read_text())
    assert advice_file["recommended"]["batch_per_rank"] == 128
