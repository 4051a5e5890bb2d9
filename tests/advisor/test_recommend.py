"""Recommendation (throughput / cost objectives, memory, measured range), live and restart controls, warm start."""

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback

from lightning_dlrover.advisor import control
from lightning_dlrover.advisor.history import JobHistory, resolve_url
from lightning_dlrover.advisor.model import JobShape, PerformanceModel
from lightning_dlrover.advisor.recommend import recommend
from lightning_dlrover.advisor.resources import Machine, ResourceConfig, SearchSpace
from lightning_dlrover.advisor.signature import JobSignature, TableSpec
from lightning_dlrover.advisor.warmstart import similar_jobs, warm_start

MACHINE = Machine(cores=8, memory_bytes=64 * 2**30)
SHAPE = JobShape(tuple([16.0] * 26), 30_000, 26 * 10**5 * 64)


def model() -> PerformanceModel:
    m = PerformanceModel()
    m.train = np.array([2e-3, 4e-5, 3e-8, 1e-5, 2e-5, 1e-9, 1e-3, 2e-9, 0.0])
    m.make = np.array([1e-3, 5e-6, 2e-6])
    m.wait = np.array([3e-6])
    m.memory = np.array([2e8, 1.0, 1e4])
    m.world_sizes, m.workers = (1, 8), (0, 2)
    return m


def test_throughput_objective_picks_the_fastest_candidate():
    space = SearchSpace(ranks_per_node=(1, 2, 4, 8), threads_per_rank=(1, 2, 4, 8), data_workers=(0, 1, 2))
    current = ResourceConfig(1, 8, 4, 2, 256)  # 48 threads and workers on 8 cores
    rec = recommend(model(), SHAPE, MACHINE, current, space)
    best = max(rec.candidates, key=lambda p: p.samples_per_sec)
    assert rec.best == best and rec.changed and rec.gain > 1.05
    assert rec.best.config.ranks_per_node * (rec.best.config.threads_per_rank + rec.best.config.data_workers) <= 16
    again = recommend(model(), SHAPE, MACHINE, rec.best.config, space)
    assert not again.changed and "no configuration is predicted more than 5%" in again.reason


def test_cost_objective_is_the_cheapest_that_reaches_the_target():
    space = SearchSpace(nodes=(1, 4), ranks_per_node=(4,), threads_per_rank=(2,), data_workers=(1,))
    current = ResourceConfig(4, 4, 2, 1, 256)
    m = model()
    speeds = {n: m.predict(ResourceConfig(n, 4, 2, 1, 256), SHAPE, 8).samples_per_sec for n in range(1, 5)}
    target = (speeds[1] + speeds[2]) / 2
    rec = recommend(m, SHAPE, MACHINE, current, space, objective="cost", target_samples_per_sec=target)
    assert rec.best.config.nodes == min(n for n, s in speeds.items() if s >= target)
    with pytest.raises(ValueError, match="needs a positive target_samples_per_sec"):
        recommend(m, SHAPE, MACHINE, current, space, objective="cost")
    with pytest.raises(ValueError, match="objective='fast'"):
        recommend(m, SHAPE, MACHINE, current, space, objective="fast")


def test_memory_and_measured_range_exclude_candidates():
    space = SearchSpace(ranks_per_node=(1, 2, 4, 8), threads_per_rank=(1,))
    small = Machine(cores=8, memory_bytes=int(1.1e9))
    rec = recommend(model(), SHAPE, small, ResourceConfig(1, 1, 1, 0, 256), space)
    assert any("GiB per node" in why for _, why in rec.excluded)
    m = model()
    m.world_sizes = (1, 2)
    rec = recommend(m, SHAPE, MACHINE, ResourceConfig(1, 1, 1, 0, 256), space)
    assert {c.ranks_per_node for c, why in rec.excluded if "measured" in why} == {4, 8}
    assert recommend(m, SHAPE, MACHINE, ResourceConfig(1, 1, 1, 0, 256), space, extrapolate=True).excluded == ()


class Knobs(Callback):
    def __init__(self):
        self.workers, self.batch = 0, 64

    def get_data_workers(self):
        return self.workers

    def set_data_workers(self, workers):
        self.workers = workers

    def get_batch_per_rank(self):
        return self.batch

    def set_batch_per_rank(self, batch):
        self.batch = batch


def test_live_changes_go_through_controls_and_the_rest_needs_a_restart():
    knobs = Knobs()
    assert isinstance(knobs, control.DataWorkersControl) and isinstance(knobs, control.BatchSizeControl)
    current, target = ResourceConfig(1, 2, 1, 0, 64), ResourceConfig(2, 4, 2, 1, 128)
    assert control.live_changes(current, target, []) == {"threads_per_rank": 2}
    live = control.live_changes(current, target, [knobs])
    assert live == {"threads_per_rank": 2, "data_workers": 1, "batch_per_rank": 128}
    threads = torch.get_num_threads()
    try:
        control.apply_live(live, [knobs])
        assert (torch.get_num_threads(), knobs.workers, knobs.batch) == (2, 1, 128)
    finally:
        torch.set_num_threads(threads)
    assert control.needs_restart(current, target, [knobs]) == ["nodes", "ranks_per_node"]
    text = control.restart_instructions(current, target, [], ["-m", "lightning_dlrover", "fit", "--config", "c.yaml"],
                                        max_nodes=3)
    assert "OMP_NUM_THREADS=2 torchrun --nnodes 2:3 --nproc-per-node 4 --rdzv-backend c10d" in text
    assert "-m lightning_dlrover fit --config c.yaml" in text
    assert "trainer.devices=4, trainer.num_nodes=2, data.global_batch_size=1024" in text
    assert "Worker: {replicas: 2}" in text and "worker: {replicas: 2}" in text and 'nprocPerNode: "4"' in text


def signature(rows: int, cores: int = 8) -> JobSignature:
    tables = tuple(TableSpec(f"t{i}", rows, 16) for i in range(26))
    return JobSignature("DLRMModule", tables, 30_000, 1024, ("table_wise",), Machine(cores, 64 * 2**30))


def test_similarity_orders_by_size_and_hardware():
    base = signature(10_000)
    assert base.similarity(base) == 1.0
    assert base.similarity(signature(20_000)) > base.similarity(signature(80_000)) > base.similarity(signature(10**6))
    assert base.similarity(signature(10_000, cores=2)) < base.similarity(signature(20_000))
    assert JobSignature.from_dict(base.to_dict()) == base and base.key() == signature(10_000).key()


def _past_job(history, sig, configs_and_steps, outcome="finished"):
    job = history.start_job("past", sig.to_dict(), sig.key(), configs_and_steps[0][0].to_dict())
    history.add_measurements(job, [{**c.to_dict(), "steps": 5, "step_s": s, "data_wait_s": 0.0, "rss_bytes": 10**8,
                                    "cores_available": 8.0} for c, s in configs_and_steps])
    history.finish_job(job, outcome, 1000.0, configs_and_steps[0][1])
    return job


def test_warm_start_picks_the_closest_past_job(tmp_path):
    history = JobHistory(resolve_url(tmp_path / "h.sqlite"))
    far = _past_job(history, signature(10**6), [(ResourceConfig(1, 8, 1, 0, 128), 0.01)])
    close = _past_job(history, signature(12_000), [(ResourceConfig(1, 2, 4, 0, 128), 0.02),
                                                   (ResourceConfig(1, 4, 2, 0, 128), 0.03)])
    new = signature(10_000)
    found = similar_jobs(history, new, min_similarity=0.0)
    assert [p.record.id for p in found] == [close, far]
    start = warm_start(history, new, ResourceConfig(1, 1, 1, 0, 128), SearchSpace(), MACHINE, min_similarity=0.5)
    assert [p.record.id for p in start.jobs] == [close]
    assert start.model is None and start.config == ResourceConfig(1, 4, 2, 0, 128)  # its fastest: 17067 samples/s
    assert "closest: #2" in start.message


def test_warm_start_fits_a_model_when_the_history_has_enough_configurations(tmp_path):
    history = JobHistory(resolve_url(tmp_path / "h.sqlite"))
    truth, sig = model(), signature(10_000)
    configs = [ResourceConfig(1, g, t, 0, 256) for g in (1, 2, 4) for t in (1, 2)]
    _past_job(history, sig, [(c, truth.predict(c, sig.shape(), 8).step_s) for c in configs])
    start = warm_start(history, sig, ResourceConfig(1, 1, 1, 0, 256),
                       SearchSpace(ranks_per_node=(1, 2, 4), threads_per_rank=(1, 2)), MACHINE)
    assert start.model is not None and start.recommendation is not None
    best = max(configs, key=lambda c: truth.predict(c, sig.shape(), 8).samples_per_sec)
    assert start.config == best
    assert warm_start(history, signature(10**7), ResourceConfig(), SearchSpace(), MACHINE).config is None


def test_candidates_keep_the_jobs_own_ranks_and_threads_outside_the_default_ladder():
    current = ResourceConfig(1, 3, 3, 1, 64)  # 3 ranks x 3 threads on 2 cores: not on the 1, 2 ladder
    space = SearchSpace(data_workers=(0, 1), batch_per_rank=(64, 1024))
    found = space.candidates(Machine(cores=2, memory_bytes=2**34), current)
    assert ResourceConfig(1, 3, 3, 1, 1024) in found  # a bigger batch at the job's own world size is a choice
    assert {c.ranks_per_node for c in found} == {1, 2, 3}
