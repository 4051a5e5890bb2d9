"""Assemble in worker processes (issue #24): the stages run as a chain of worker processes and the training process
only receives batches; the batches are those of assemble inline (same order, same values), resumption is exact,
and a change of assemble workers applies live."""

import functools
import os
import time

import pytest
import torch

from lightning_dlrover.data import CriteoTSV, ResumableLoader
from lightning_dlrover.data.generate import GeneratorConfig, generate_days
from lightning_dlrover.data.staged import INLINE, PipelineConfig, PipelinedLoader
from lightning_dlrover.data.staged import chain as chain_module

SIZES = [1000 + 17 * i for i in range(26)]
MAIN_PID = os.getpid()


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    return generate_days(tmp_path_factory.mktemp("tsv"), 2, 900, GeneratorConfig(max_vocab=50_000, seed=5))


def not_in_the_training_process(dense, ids, labels):
    """A user transform that fails if the training process runs it."""
    if os.getpid() == MAIN_PID:
        raise AssertionError("the transform ran in the training process")
    return dense, ids, labels


def fails_in_a_worker(dense, ids, labels):
    raise ValueError("a user transform failed")


def identical(a, b) -> bool:
    """Same tensors (values and dtypes) and the same KeyedJaggedTensor, its computed per-key sums included."""
    ka, kb = a.sparse_features, b.sparse_features
    tensors = [(a.dense_features, b.dense_features), (a.labels, b.labels), (ka.values(), kb.values()),
               (ka.lengths(), kb.lengths())]
    return (all(x.dtype == y.dtype and torch.equal(x, y) for x, y in tensors) and ka.keys() == kb.keys()
            and ka.length_per_key() == kb.length_per_key() and ka.offset_per_key() == kb.offset_per_key()
            and ka.stride() == kb.stride())


def stream(loader) -> list:
    try:
        return list(loader)
    finally:
        loader.close()


def test_assemble_in_processes_delivers_the_batches_of_assemble_inline(days):
    source = CriteoTSV(days, SIZES)
    want = list(ResumableLoader(source, 1, 2, 160))  # make_batch's batches
    inline = stream(PipelinedLoader(source, 1, 2, 160, PipelineConfig(0, 1, 1, 0, 2), chunk_rows=37))
    threads = stream(PipelinedLoader(source, 1, 2, 160, PipelineConfig(1, 1, 1, 2, 2), chunk_rows=37,
                                     methods={"assemble": "thread"}))
    for config in (PipelineConfig(0, 0, 0, 1, 0), PipelineConfig(1, 2, 1, 2, 2), PipelineConfig(0, 1, 0, 3, 0)):
        loader = PipelinedLoader(source, 1, 2, 160, config, chunk_rows=37,
                                 user_transforms=[not_in_the_training_process])
        got = stream(loader)
        assert len(got) == len(want) == len(inline) == len(threads) == 900 * 2 // 160
        assert all(identical(g, w) and identical(g, i) and identical(g, t)
                   for g, w, i, t in zip(got, want, inline, threads)), config.short()


def test_resume_is_exact_across_assemble_inline_threads_and_processes(days):
    source = CriteoTSV(days, SIZES)
    want = list(ResumableLoader(source, 0, 1, 150))
    loader = PipelinedLoader(source, 0, 1, 150, PipelineConfig(1, 1, 1, 1, 2), chunk_rows=64)
    got, it = [], iter(loader)
    for step in range(5):
        got.append(next(it))
        assert len(loader.worker_pids()) == loader.config.total_workers - (loader.config.assemble == 0)
        if step == 0:
            loader.reconfigure(PipelineConfig(0, 2, 0, 2, 1))  # a tuner's change of assemble workers: live
        if step == 2:
            loader.reconfigure(PipelineConfig(1, 1, 0, 0, 0))  # assemble back inline
    state = loader.state_dict()
    assert state["next_sample"] == 5 * 150 and loader.stats.resets == 2
    loader.close()
    resumed = PipelinedLoader(source, 0, 1, 150, PipelineConfig(0, 1, 1, 2, 1), chunk_rows=50)
    resumed.load_state_dict(state)
    got += stream(resumed)
    assert len(got) == len(want) and all(identical(g, w) for g, w in zip(got, want))


def test_a_worker_error_reaches_the_trainer_with_its_message(days):
    loader = PipelinedLoader(CriteoTSV(days, SIZES), 0, 1, 100, PipelineConfig(0, 1, 0, 1, 1),
                             user_transforms=[fails_in_a_worker])
    with pytest.raises(ValueError, match="a user transform failed"):
        stream(loader)
    assert loader.worker_pids() == []


def test_a_killed_assemble_worker_is_named(days):
    loader = PipelinedLoader(CriteoTSV(days, SIZES), 0, 1, 100, PipelineConfig(0, 0, 0, 1, 0))
    it = iter(loader)
    next(it)
    [pid] = loader.worker_pids()
    os.kill(pid, 9)
    with pytest.raises(RuntimeError, match=rf"assemble worker process \(pid {pid}\) exited with code -9"):
        for _ in it:
            pass
    assert loader.worker_pids() == []


def test_all_inline_runs_no_process(days):
    loader = PipelinedLoader(CriteoTSV(days, SIZES), 0, 1, 100, INLINE)
    it = iter(loader)
    next(it)
    assert loader.worker_pids() == []
    it.close()


_real_worker = chain_module._worker


def _stuck_once(marker: str, *args) -> None:
    """A worker whose first start never runs (as a child stuck in CPython's after-fork code): it never says so."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return _real_worker(*args)
    os.close(fd)
    time.sleep(600)


def test_a_worker_stuck_in_its_fork_is_started_again_and_no_batch_is_lost(days, tmp_path, monkeypatch, capsys):
    """Once in ~50 rebuilds a forked child hung before any of its Python ran (another thread of the training process
    was creating or deleting its thread state at the fork) and the rank waited for its batch forever. The chain now
    waits for each worker to say it runs, kills one that does not and starts it again."""
    source = CriteoTSV(days, SIZES)
    want = list(ResumableLoader(source, 0, 1, 160))
    monkeypatch.setenv(chain_module.START_S_ENV, "2")
    monkeypatch.setattr(chain_module, "_worker", functools.partial(_stuck_once, str(tmp_path / "stuck")))
    got = stream(PipelinedLoader(source, 0, 1, 160, PipelineConfig(0, 1, 0, 1, 1), chunk_rows=37))
    assert len(got) == len(want) and all(identical(a, b) for a, b in zip(got, want))
    assert (tmp_path / "stuck").exists()
    said = capsys.readouterr()
    assert "did not start within 2 s (stuck in its fork); started it again" in said.out + said.err
