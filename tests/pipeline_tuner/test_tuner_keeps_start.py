"""A real (one-rank) fit whose steps are bound by the model, not by the data: no pipeline setting can make it
faster, so the RL tuner, judged on the end-to-end rate, must keep the start it was given (and its events say so)."""

import json
import time

import lightning.pytorch as pl
import torch

from lightning_dlrover import PipelineTuner
from lightning_dlrover.data import CriteoTSV
from lightning_dlrover.data.generate import GeneratorConfig, generate_days
from lightning_dlrover.data.staged import PipelineConfig, PipelinedLoader
from lightning_dlrover.monitor import events

SIZES = [1000] * 26
START = {"read": 0, "parse": 0, "transform": 0, "assemble": 0, "prefetch": 1}


class ModelBound(pl.LightningModule):
    """A tiny model whose step takes 80 ms (as a large model's would): the pipeline's share of a step (16 rows) is
    well under 1%, so every configuration runs at the same end-to-end rate within noise."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(13, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(0.08)
        return torch.nn.functional.binary_cross_entropy_with_logits(self.layer(batch.dense_features).squeeze(1),
                                                                    batch.labels.float())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(tmp_path, tuner: PipelineTuner, steps: int) -> list[dict]:
    [path] = generate_days(tmp_path / "data", 1, 8_000, GeneratorConfig(max_vocab=1000, seed=3))
    loader = PipelinedLoader(CriteoTSV([str(path)], SIZES), 0, 1, 16, PipelineConfig(**START))
    events.configure(tmp_path / "events.jsonl")
    try:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[tuner],
                             default_root_dir=str(tmp_path))
        trainer.fit(ModelBound(), loader)
    finally:
        events.configure(None)
    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]


def test_a_start_no_setting_beats_is_kept(tmp_path):
    tuner = PipelineTuner("rl", cpus=2, memory_mb=512, window_s=0.8, min_batches=3, report_dir=str(tmp_path / "pl"))
    recorded = _fit(tmp_path, tuner, 140)
    decisions = [e for e in recorded if e["kind"] == "pipeline_decision"]
    [tuned] = [e for e in recorded if e["kind"] == "pipeline_tuned"]
    start = PipelineConfig(**START).short()
    # it tried changes (each measured against the start, interleaved) and undid every one
    assert any(e["next_config"] not in (None, start) for e in decisions)
    assert any(e["reason"].startswith("undo") for e in decisions)
    assert any(f"keeping the start {start}" in e["reason"] for e in decisions)
    assert tuned["start_config"] == tuned["config"] == start and tuned["kept_start"] is True
    assert tuner.trace.final == PipelineConfig(**START)


def test_the_hill_climber_starts_from_the_configured_pipeline(tmp_path):
    # It started from one worker per stage (r1 p1 t1 a1 q1), whatever the user configured.
    tuner = PipelineTuner("hill_climb", cpus=2, memory_mb=512, window_s=0.2, min_batches=2,
                          report_dir=str(tmp_path / "pl"))
    recorded = _fit(tmp_path, tuner, 12)
    decisions = [e for e in recorded if e["kind"] == "pipeline_decision"]
    assert decisions and decisions[0]["config"] == PipelineConfig(**START).short()
    # and climbs from it: its first trial is one knob +1 of the start
    first_try = PipelineConfig(**START).replace(read=1).short()
    assert decisions[0]["next_config"] == first_try
