"""Gradient noise scale (estimator and the DDP hook in a real 2-rank gloo job), step-time model, goodput."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_dlrover.elastic.goodput import GoodputModel, GradientNoiseProbe, NoiseScaleEstimator, StepTimeModel
from tests.conftest import exit_rank, reap


def test_estimator_recovers_known_noise_scale():
    rng = np.random.default_rng(0)
    dim, b, n = 50, 8, 4
    g = np.full(dim, 0.1)  # |G|^2 = 0.5
    sigma = 0.5  # tr(S) = 50 * 0.25 = 12.5 -> phi = 25
    est = NoiseScaleEstimator(smoothing=0.99)
    for _ in range(3000):
        samples = g + sigma * rng.standard_normal((n, b, dim))
        local = samples.mean(axis=1)
        est.update(float((local ** 2).sum(axis=1).mean()), float((local.mean(axis=0) ** 2).sum()), b, b * n)
    assert est.noise_scale == pytest.approx(25.0, rel=0.2)
    with pytest.raises(ValueError, match="two or more ranks"):
        est.update(1.0, 1.0, 8, 8)


def _worker(rank, world, path, out):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ref = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    ref.load_state_dict(ddp.state_dict())
    probe = GradientNoiseProbe(NoiseScaleEstimator(smoothing=0.0))
    probe.attach(ddp)
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)
    for net in (ddp, ref):
        torch.nn.functional.mse_loss(net(x), y).backward()
    phi = probe.end_step(local_batch=16)
    # independent check: local and averaged gradients computed without the hook
    local = torch.cat([p.grad.flatten() for p in ref.parameters()])  # averaged by plain DDP
    model_local = torch.nn.Linear(4, 1)
    model_local.load_state_dict(model.state_dict())
    torch.nn.functional.mse_loss(model_local(x), y).backward()
    mine = torch.cat([p.grad.flatten() for p in model_local.parameters()])
    mean_local_sqr = torch.tensor([float(mine.pow(2).sum())])
    dist.all_reduce(mean_local_sqr)
    hooked = torch.cat([p.grad.flatten() for p in ddp.parameters()])
    if rank == 0:
        out.put((phi, float(mean_local_sqr) / world, float(local.pow(2).sum()), bool(torch.allclose(hooked, local))))
    dist.destroy_process_group()
    out.close()
    out.join_thread()  # the result is in the pipe
    exit_rank()


@pytest.mark.slow  # two spawned ranks import the package: ~30 s on a busy 2-core machine
def test_probe_in_a_real_two_rank_ddp_job(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, str(tmp_path / "store"), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        phi, local_sqr, global_sqr, same_grads = out.get(timeout=400)
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
    finally:
        reap(procs)
    assert same_grads  # the hook's all-reduce averages like DDP's own
    expected = NoiseScaleEstimator(smoothing=0.0)
    expected.update(local_sqr, global_sqr, 16, 32)
    assert phi == pytest.approx(expected.noise_scale, rel=1e-4)


def test_step_time_and_goodput_switching():
    times = StepTimeModel()
    times.observe(64, 0.10)
    assert times.coefficients() == pytest.approx((0.0, 0.10 / 64))
    times.observe(128, 0.14)
    a, c = times.coefficients()
    assert (a, c) == pytest.approx((0.06, 0.04 / 64))
    model = GoodputModel(base_batch=128, noise_scale=None, step_times=times)
    # no noise scale: efficiency 1, the largest batch has the best throughput
    assert model.goodput(2, 512) > model.goodput(2, 256)
    model.noise_scale = 100.0  # noisy-free-ish gradients: efficiency falls fast with batch
    assert model.efficiency(128) == 1.0 and model.efficiency(1128) == pytest.approx(228 / 1228)
    assert model.goodput(2, 256) > model.goodput(2, 1024)
    assert not model.worth_switching(2, 256, 260)  # below the 5% hysteresis
    assert model.worth_switching(2, 1024, 256)
