"""Batch policies, LR rules and learning-rate changes on dense and TorchRec fused optimizers."""

import math

import pytest
import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from lightning_dlrover.elastic.batch import (
    BatchRange, _leaf_optimizers, adascale_gain, choose_batch, decide, learning_rates, lr_factor, scale_learning_rates,
)


def test_bad_ranges_rejected_with_fix():
    with pytest.raises(ValueError, match="min > max"):
        BatchRange(512, 256)
    with pytest.raises(ValueError, match="positive"):
        BatchRange(0, 256)
    with pytest.raises(ValueError, match="divisible by world size 3"):
        BatchRange(100, 101).check(3)
    with pytest.raises(ValueError, match="per-rank limit"):
        BatchRange(256, 512, per_rank_max=32).check(4)
    with pytest.raises(ValueError, match="policy 'fastest' is unknown"):
        choose_batch("fastest", BatchRange(8, 64), 2, 4, 32)
    with pytest.raises(ValueError, match="LR rule"):
        lr_factor("cubic", 8, 16)


def test_policies_after_shrink_and_grow():
    r = BatchRange(128, 1024, per_rank_max=200)
    # shrink 4 -> 2 from 512: keep_global keeps 512 only if 256/rank fits; it does not (200), so 400
    assert choose_batch("keep_global", r, 4, 2, 512) == 400
    assert choose_batch("keep_global", BatchRange(128, 1024), 4, 2, 512) == 512
    assert choose_batch("keep_per_rank", r, 4, 2, 512) == 256
    assert choose_batch("keep_per_rank", r, 2, 4, 256) == 512
    assert choose_batch("keep_per_rank", r, 2, 3, 256) == 384
    # grow clamps to the range
    assert choose_batch("keep_per_rank", BatchRange(128, 600), 2, 4, 512) == 600
    # goodput picks the maximiser
    best = choose_batch("goodput", BatchRange(64, 512), 4, 4, 256, goodput=lambda w, b: -abs(b - 300))
    assert best == 300
    with pytest.raises(ValueError, match="goodput model"):
        choose_batch("goodput", r, 4, 2, 512)


def test_lr_rules():
    assert lr_factor("linear", 256, 512) == 2.0
    assert math.isclose(lr_factor("sqrt", 256, 1024), 2.0)
    assert lr_factor("none", 256, 1024) == 1.0
    assert math.isclose(adascale_gain(0.0, 256, 1024), 1.0)  # no noise: larger batch buys nothing
    assert math.isclose(adascale_gain(1e12, 256, 1024), 4.0, rel_tol=1e-6)  # all noise: linear
    assert 1.0 < lr_factor("adascale", 256, 1024, noise_scale=500) < 4.0
    d = decide("keep_per_rank", "linear", BatchRange(64, 1024), 4, 2, 512)
    assert (d.global_batch, d.per_rank, d.lr_factor) == (256, 128, 0.5)


def test_scale_dense_and_fused_embedding_learning_rates(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ebc = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=50, feature_names=["f0"])],
            device=torch.device("meta"),
        )
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.04})
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=1, compute_device="cpu"),
            constraints={"t0": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])},
        )
        plan = planner.collective_plan(ebc, get_default_sharders(), dist.GroupMember.WORLD)
        dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan)
        dense = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        assert learning_rates([dense, dmp.fused_optimizer]) == pytest.approx([0.1, 0.04])
        scale_learning_rates([dense, dmp.fused_optimizer], 0.5)
        assert learning_rates([dense, dmp.fused_optimizer]) == pytest.approx([0.05, 0.02])
        kernels = [leaf._emb_module for leaf in _leaf_optimizers(dmp.fused_optimizer)]
        assert kernels and all(k.get_learning_rate() == pytest.approx(0.02) for k in kernels)
        # the kernel trains with the new rate: one step of row-wise Adagrad moves a row by ~lr
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([3]), torch.tensor([1]))
        before = dmp.state_dict()[next(k for k in dmp.state_dict() if k.endswith("weight"))]
        before = before.local_shards()[0].tensor.clone() if hasattr(before, "local_shards") else before.clone()
        dmp(kjt).values().sum().backward()
        after = dmp.state_dict()[next(k for k in dmp.state_dict() if k.endswith("weight"))]
        after = after.local_shards()[0].tensor if hasattr(after, "local_shards") else after
        assert (before[3] - after[3]).abs().max().item() == pytest.approx(0.02, rel=0.05)
    finally:
        dist.destroy_process_group()
