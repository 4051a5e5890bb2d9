"""The pipeline a job gets when ``data.pipeline`` names no workers: the machine's start (issue #24). On cores the CPU
trainer's threads fill, worker processes slow every step by more than they save, so the start is everything inline
in one prefetch thread; with a core to spare per rank (a GPU trainer), one worker per stage."""

import json
import re

import pytest

from lightning_dlrover.data.generate import GeneratorConfig, generate_days
from lightning_dlrover.data.sources import CriteoTSV
from lightning_dlrover.data.staged import FEW_CORES, PipelineConfig, for_machine, pipelined_loader
from lightning_dlrover.monitor.events import read_events
from tests.conftest import REPO, run

SIZES = [1000] * 26


@pytest.mark.parametrize("ranks, threads, cores, expected", [
    (1, 2, 2, FEW_CORES),             # a CPU trainer on 2 cores: its two intra-op threads use both
    (2, 1, 2, FEW_CORES),             # two CPU ranks on 2 cores, one thread each (what Lightning sets)
    (2, 8, 16, FEW_CORES),            # a CPU trainer's threads fill any machine
    (1, 1, 2, PipelineConfig()),      # one thread feeding a GPU leaves a core
    (8, 1, 64, PipelineConfig()),     # 8 GPUs on 64 cores: 7 spare cores per rank
    (8, 1, 12, FEW_CORES),            # 8 GPUs on 12 cores: half a spare core per rank
    (2, 4, 16, PipelineConfig()),     # OMP_NUM_THREADS=4 below the cores
])
def test_the_start_leaves_the_trainers_cores_to_the_trainer(ranks, threads, cores, expected):
    assert for_machine(ranks, threads, cores) == expected


def test_a_start_for_no_ranks_or_threads_is_refused():
    with pytest.raises(ValueError, match=r"ranks_per_node=0, trainer_threads=1\): both must be >= 1"):
        for_machine(0, 1, 4)
    with pytest.raises(ValueError, match=r"trainer_threads=0\): both must be >= 1"):
        for_machine(1, 0, 4)


def test_named_workers_win_and_unnamed_settings_take_the_machines_start(tmp_path):
    [path] = generate_days(tmp_path, 1, 3000, GeneratorConfig(max_vocab=500, seed=1))
    source = CriteoTSV([path], SIZES)

    def config(settings, unnamed=FEW_CORES):
        return pipelined_loader(source, 0, 1, 256, settings, unnamed).config

    assert config({}) == FEW_CORES
    assert config({"on_error": "skip", "chunk_rows": 512}) == FEW_CORES
    assert config({"parse": 2}) == PipelineConfig(parse=2)  # named: the rest from PipelineConfig(), as before
    assert config({"prefetch": 0}) == PipelineConfig(prefetch=0)
    assert config({}, unnamed=None) == PipelineConfig()  # the Python API without a machine's start


@pytest.mark.slow
def test_a_fit_naming_no_workers_starts_and_tunes_from_the_machines_start(tmp_path):
    [path] = generate_days(tmp_path / "data", 1, 12_000, GeneratorConfig(max_vocab=1000, seed=3))
    proc = run(["-m", "lightning_dlrover", "fit", "--config", REPO / "configs" / "tsv.yaml", "--trainer.max_steps=16",
                "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path / 'run'}",
                f"--data.criteo_paths=[{path}]", "--data.global_batch_size=512",
                "--trainer.callbacks.init_args.tuner=fixed", "--trainer.callbacks.init_args.window_s=0.1",
                "--trainer.callbacks.init_args.min_batches=2"], tmp_path)
    out = proc.stdout
    said = re.search(r"data.pipeline names no workers: starting at (r\d+ p\d+ t\d+ a\d+ q\d+) \((\d+) rank\(s\) on "
                     r"(\d+) cores, (\d+) trainer thread\(s\) each\)", out)
    assert said, out[-3000:]
    start, ranks, cores, threads = said.group(1), *map(int, said.groups()[1:])
    assert ranks == 2  # configs/tsv.yaml
    assert start == for_machine(ranks, threads, cores).short()
    assert f"PipelineTuner (fixed): budget" in out and f"starting at {start}" in out.split("PipelineTuner (fixed)")[1]
    tuned = [e for e in read_events([tmp_path / "run" / "dlrover_events.jsonl"]) if e.kind == "pipeline_tuned"]
    assert sorted(e.rank for e in tuned) == [0, 1] and {e["start_config"] for e in tuned} == {start}
    trace = json.loads((tmp_path / "run" / "pipeline" / "trace_rank0.json").read_text())
    assert trace["points"] and {p["config"] for p in trace["points"]} == {start}
