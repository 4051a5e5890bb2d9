"""PipelineTuner at 2 ranks (real processes, gloo): one decision for all ranks. The windows close at the same step on
every rank and rank 0's decision applies everywhere, so both ranks' ``pipeline_decision`` events name the same
configurations at the same steps; a tuner failing on one rank only steps back on every rank at the same step."""

from __future__ import annotations

import pytest

from lightning_dlrover.data.generate import GeneratorConfig, generate_days
from lightning_dlrover.monitor import read_events
from tests.conftest import REPO, run

INJECT = REPO / "tests" / "scripts" / "inject.py"
RANKS_JOB = REPO / "tests" / "scripts" / "tuner_ranks.py"


def _fit(tmp_path, *extra: str, inject: str | None = None):
    [path] = generate_days(tmp_path / "data", 1, 20_000, GeneratorConfig(max_vocab=2000, seed=4))
    args = ["fit", "--config", REPO / "configs" / "tsv.yaml", "--trainer.max_steps=18",
            "--trainer.enable_progress_bar=false", f"--data.criteo_paths=[{path}]", "--data.global_batch_size=512",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.callbacks.init_args.window_s=0.3",
            "--trainer.callbacks.init_args.min_batches=2", "--trainer.callbacks.init_args.cpus=2",
            # from all inline, nothing prefetched, the trainer waits on data: the agent's first trial adds workers
            "--trainer.callbacks.init_args.start={read: 0, parse: 0, transform: 0, assemble: 0, prefetch: 0}", *extra]
    command = [INJECT, inject, "--", *args] if inject else ["-m", "lightning_dlrover", *args]
    proc = run(command, tmp_path, timeout=400)
    assert "`Trainer.fit` stopped: `max_steps=18` reached." in proc.stdout, proc.stdout[-3000:]
    return read_events([tmp_path / "dlrover_events.jsonl"])


@pytest.mark.slow
@pytest.mark.parametrize("tuner", ["rl", "hill_climb"])
def test_every_rank_runs_rank_0s_decisions_from_the_same_step(tmp_path, tuner):
    # Rank 1's pipeline is slower (a slow user transform on rank 1 only): it waits for data, rank 0 waits for it
    # inside the all-reduce. Before, each rank's agent judged its own bottleneck and they changed their pipelines
    # apart (rank 0 toward fewer workers, rank 1 toward more transform workers).
    [path] = generate_days(tmp_path / "data", 1, 12_000, GeneratorConfig(max_vocab=1000, seed=5))
    proc = run([RANKS_JOB, path, tmp_path, tuner, 40], tmp_path, timeout=400)
    assert proc.stdout.count("FINAL_STEP 40") == 2, proc.stdout[-3000:]
    events = read_events([tmp_path / "dlrover_events.jsonl"])
    decisions = {rank: [(e.step, e["config"], e["next_config"]) for e in events
                        if e.kind == "pipeline_decision" and e.rank == rank] for rank in (0, 1)}
    assert decisions[0], "no window closed"
    assert any(next_config for _, _, next_config in decisions[0])  # it changed the pipeline at least once
    assert decisions[0] == decisions[1]  # the same configurations, decided at the same steps, on both ranks
    tuned = {e.rank: e for e in events if e.kind == "pipeline_tuned"}
    assert tuned[0]["config"] == tuned[1]["config"]


@pytest.mark.slow
def test_a_tuner_failing_on_one_rank_steps_back_on_every_rank_at_the_same_step(tmp_path):
    # Rank 1's tuner fails measuring its window for the 3rd meeting; rank 0 learns it there and steps back too.
    events = _fit(tmp_path, inject="lightning_dlrover.pipeline_tuner.harness:TunerDriver.window@2#1")
    failed = {e.rank: e for e in events if e.kind == "addon_failed" and e["addon"] == "PipelineTuner"}
    assert sorted(failed) == [0, 1], failed
    assert "injected failure" in failed[1]["error"]
    assert failed[0]["error_type"] == "PeerFailed" and "rank(s) [1]" in failed[0]["error"]
    assert failed[0].step == failed[1].step == 6  # the 3rd meeting: every 2 batches
    assert failed[0]["stepped_back_to"] == failed[1]["stepped_back_to"]  # the same configuration on both ranks
    assert not [e for e in events if e.kind == "pipeline_decision" and e.step > 6]  # off on every rank
