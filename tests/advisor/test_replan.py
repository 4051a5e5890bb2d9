"""Measured per-table load and the re-plan with TorchRec's planner."""

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_dlrover.advisor.replan import LookupCounter, find_kjt, imbalance, rank_loads, replan
from lightning_dlrover.advisor.signature import TableSpec
from lightning_dlrover.strategy.sharding import TableConstraint, build_constraints

FEATURES = {f"t{i}": [f"f{i}"] for i in range(8)}


def kjt(ids_per_sample: list[int], batch: int = 32) -> KeyedJaggedTensor:
    lengths = torch.tensor([k for k in ids_per_sample for _ in range(batch)], dtype=torch.int32)
    values = torch.cat([torch.arange(k * batch) % 7 for k in ids_per_sample])  # 7 distinct rows: very hot
    return KeyedJaggedTensor(keys=[f"f{i}" for i in range(len(ids_per_sample))], values=values, lengths=lengths)


def test_lookup_counter_measures_pooling_factors_and_hot_rows():
    counter = LookupCounter({t: (1000, f) for t, f in FEATURES.items()}, hot_fraction=0.01)
    pattern = [20, 1, 20, 1, 1, 1, 1, 1]
    assert counter.observe({"sparse": kjt(pattern)}, hot_rows=True)
    assert counter.observe(kjt(pattern))
    assert not counter.observe(torch.zeros(3))
    assert counter.pooling_factors() == {f"t{i}": float(k) for i, k in enumerate(pattern)}
    hot = counter.hot_shares()
    assert all(0 < v <= 1 for v in hot.values()) and hot["t0"] >= 1 / 7
    doubled = counter.pooling_factors(counter.counts * 2)  # e.g. summed over two ranks
    assert doubled == counter.pooling_factors()
    assert find_kjt([1, {"x": kjt([1] * 8)}]) is not None


def test_replan_with_measured_pooling_factors_balances_the_ranks():
    # Two hot tables that the planner's uniform assumption puts on the same rank.
    tables = [TableSpec(f"t{i}", 20_000, 16, 20.0 if i in (0, 2) else 1.0) for i in range(8)]
    advice = replan(tables, FEATURES, world_size=2, local_world_size=2, batch_per_rank=128, sharding_types=["table_wise"])
    assert advice.imbalance_before > 1.4 and advice.imbalance_after < 1.1 and advice.worthwhile
    assert advice.placement_after["t0"] != advice.placement_after["t2"]
    assert set(advice.sharding_after.values()) == {"table_wise"}
    assert sum(advice.loads_after.values()) == sum(advice.loads_before.values()) == 16 * (2 * 20 + 6)
    yaml = advice.constraints_yaml()
    assert "t0: {pooling_factors: [20]}" in yaml and "t1:" not in yaml
    assert "re-planned with the measured ones (restart" in advice.message()


def test_rank_loads_by_sharding_type():
    tables = [TableSpec("a", 100, 8, 2.0), TableSpec("b", 100, 8, 1.0)]
    placement = {"a": [(0, 100, 4, "column_wise"), (1, 100, 4, "column_wise")], "b": [(0, -1, -1, "data_parallel"),
                                                                                      (1, -1, -1, "data_parallel")]}
    assert rank_loads(placement, tables, 2) == {0: 2 * 4 + 8 / 2, 1: 2 * 4 + 8 / 2}
    assert imbalance({0: 3.0, 1: 1.0}) == 1.5


def test_strategy_passes_measured_pooling_factors_to_the_planner():
    constraints = build_constraints({"t0": "ebc", "t1": "ebc"}, ["table_wise"], "fused",
                                    {"t0": TableConstraint(pooling_factors=[20.0])}, "gloo")
    assert constraints["t0"].pooling_factors == [20.0] and constraints["t1"].pooling_factors == [1.0]
