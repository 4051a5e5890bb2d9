"""The staged TSV pipeline: the same batches as ResumableLoader at any parallelism and world size, exact
resumption across parallelism and batch-size changes, malformed lines, no leftover processes."""

import os

import psutil
import pytest
import torch

from lightning_dlrover.data import CriteoTSV, ResumableLoader
from lightning_dlrover.data.generate import GeneratorConfig, generate_days
from lightning_dlrover.data.staged import INLINE, PipelineConfig, PipelinedLoader
from lightning_dlrover.data.tsv_parse import MalformedLine

SIZES = [1000 + 17 * i for i in range(26)]
CONFIGS = [INLINE, PipelineConfig(), PipelineConfig(2, 3, 2, 2, 4), PipelineConfig(0, 2, 0, 1, 1)]


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    # Two files of 1500 lines: batches cross the file boundary.
    return generate_days(tmp_path_factory.mktemp("tsv"), 2, 1500, GeneratorConfig(max_vocab=50_000, seed=11))


def same(a, b):
    return (torch.equal(a.dense_features, b.dense_features) and torch.equal(a.labels, b.labels)
            and a.sparse_features.keys() == b.sparse_features.keys()
            and torch.equal(a.sparse_features.values(), b.sparse_features.values())
            and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths()))


def assert_same_stream(got, want):
    assert len(got) == len(want)
    assert all(same(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_same_batches_as_resumable_loader_at_any_parallelism(days, world_size):
    source = CriteoTSV(days, SIZES)
    for rank in range(world_size):
        want = list(ResumableLoader(source, rank, world_size, 240))
        for config in CONFIGS[: 4 if rank == 0 else 2]:
            assert_same_stream(list(PipelinedLoader(source, rank, world_size, 240, config, chunk_rows=37)), want)


def test_resume_after_parallelism_change_neither_loses_nor_repeats(days):
    source = CriteoTSV(days, SIZES)
    want = list(ResumableLoader(source, 1, 2, 200))
    loader = PipelinedLoader(source, 1, 2, 200, PipelineConfig(1, 1, 1, 1, 2), chunk_rows=64)
    got, it = [], iter(loader)
    for step in range(6):
        got.append(next(it))
        if step == 1:
            loader.reconfigure(PipelineConfig(2, 2, 1, 1, 3))
        if step == 3:
            loader.reconfigure(INLINE)
    state = loader.state_dict()
    assert state["next_sample"] == 6 * 200 and loader.stats.resets == 2
    # A checkpoint taken now resumes, at another parallelism, exactly where it stopped.
    resumed = PipelinedLoader(source, 1, 2, 200, PipelineConfig(1, 3, 2, 1, 1), chunk_rows=50)
    resumed.load_state_dict(state)
    got += list(resumed)
    assert_same_stream(got, want)
    loader.close()


def test_global_batch_size_change_between_steps(days):
    source = CriteoTSV(days, SIZES)
    ref, pipe = ResumableLoader(source, 0, 2, 200), PipelinedLoader(source, 0, 2, 200, PipelineConfig(1, 2, 1, 1, 4))
    got, want = [], []
    for loader, out in ((ref, want), (pipe, got)):
        it = iter(loader)
        out += [next(it), next(it)]
        loader.global_batch_size = 300
        out += list(it)
    assert_same_stream(got, want)


@pytest.mark.parametrize("config", [INLINE, PipelineConfig(1, 2, 1, 1, 2)])
def test_malformed_line_raises_with_file_and_line_or_is_skipped(tmp_path, config):
    [path] = generate_days(tmp_path, 1, 600, GeneratorConfig(max_vocab=1000))
    lines = path.read_bytes().splitlines(keepends=True)
    lines[432] = lines[432].replace(b"\t", b"\tzz", 1)  # a non-numeric I1 on line 433
    path.write_bytes(b"".join(lines))
    source = CriteoTSV([path], SIZES)
    with pytest.raises(MalformedLine, match=rf"{path.name}:433: malformed Criteo line \(non-numeric dense value in I1"):
        list(PipelinedLoader(source, 0, 1, 100, config))
    loader = PipelinedLoader(source, 0, 1, 100, config, on_error="skip")
    batches = list(loader)
    assert loader.stats.skipped == 1 and loader.skipped_lines == [(str(path), 433)]
    assert [len(b.labels) for b in batches] == [100, 100, 100, 100, 99, 100]


def test_no_worker_process_outlives_the_loader(days):
    me = psutil.Process(os.getpid())
    before = {p.pid for p in me.children(recursive=True)}
    loader = PipelinedLoader(CriteoTSV(days, SIZES), 0, 1, 300, PipelineConfig(1, 3, 2, 1, 2))
    it = iter(loader)
    next(it)
    assert len(loader.worker_pids()) == 7  # assemble in processes: every stage with workers runs in processes
    loader.reconfigure(PipelineConfig(1, 1, 1, 1, 1))
    next(it)
    assert len(loader.worker_pids()) == 4
    loader.reconfigure(PipelineConfig(1, 1, 1, 0, 1))  # assemble inline: processes for parse and transform only
    next(it)
    assert len(loader.worker_pids()) == 2
    it.close()
    alive = {p.pid for p in me.children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}
    assert alive <= before
