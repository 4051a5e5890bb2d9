"""PipelineTuner in a real 2-rank training job (gloo): tunes, logs, plots, and trains on the same batches as
the in-process loader (same final state digest), through pipeline resets."""

import json

import pytest

from lightning_dlrover.data.generate import GeneratorConfig, generate_days
from tests.conftest import REPO, digests, run


@pytest.mark.slow
def test_tuned_pipeline_trains_like_the_in_process_loader(tmp_path):
    [path] = generate_days(tmp_path / "data", 1, 40_000, GeneratorConfig(max_vocab=5000, seed=2))
    common = ["-m", "lightning_dlrover", "fit", "--config", str(REPO / "configs" / "tsv.yaml"),
              "--trainer.max_steps=24", "--trainer.enable_progress_bar=false", f"--data.criteo_paths=[{path}]",
              "--data.global_batch_size=1024"]
    tuned = run([*common, f"--trainer.default_root_dir={tmp_path / 'tuned'}", "--trainer.callbacks.init_args.cpus=3",
                 "--trainer.callbacks.init_args.window_s=0.5", "--trainer.callbacks.init_args.memory_mb=512",
                 # from every stage inline the trainer waits on data, so the first decision adds a worker: a
                 # start the pipeline keeps up with would rightly be kept, and this test would test nothing
                 "--trainer.callbacks.init_args.start={read: 0, parse: 0, transform: 0, assemble: 0, prefetch: 0}"],
                tmp_path)
    plain = run([*common, f"--trainer.default_root_dir={tmp_path / 'plain'}", "--data.pipeline=null",
                 "--trainer.callbacks=[]"], tmp_path)
    assert digests(tuned.stdout)["end"] == digests(plain.stdout)["end"]
    assert "PipelineTuner (rl): start" in tuned.stdout
    events = [json.loads(line) for line in (tmp_path / "tuned" / "dlrover_events.jsonl").read_text().splitlines()]
    decisions = [e for e in events if e["kind"] == "pipeline_decision"]
    assert {e["rank"] for e in decisions} == {0, 1}
    assert all(e["memory_bytes"] <= e["budget_memory_bytes"] for e in decisions)
    tuned_events = [e for e in events if e["kind"] == "pipeline_tuned"]
    assert len(tuned_events) == 2 and all(e["budget_cpus"] == 3 for e in tuned_events)
    # Whether the agent changes the pipeline within 24 steps is its judgement of measured rates, which a loaded
    # machine changes (the trainer, not the data, is then the bottleneck): on a quiet machine it does, and the digests
    # above show the resets lost or repeated nothing; without a change there must be no reset.
    if any(e["next_config"] for e in decisions):
        assert all(e["resets"] >= 1 for e in tuned_events)
    else:
        assert all(e["resets"] == 0 for e in tuned_events)
    for rank in (0, 1):
        assert (tmp_path / "tuned" / "pipeline" / f"tuner_rank{rank}.png").stat().st_size > 10_000
