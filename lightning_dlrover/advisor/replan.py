"""A better sharding plan from measured load.

TorchRec's planner estimates each table's cost from its pooling factor (ids per sample), which it takes to
be 1.0 unless told. :class:`LookupCounter` measures every table's ids per sample and the share of lookups that
hit its hottest rows from the batches a rank trains on; :func:`replan` runs TorchRec's planner again with
the measured pooling factors (``ParameterConstraints.pooling_factors``) and reports the busiest rank's load
over the mean rank's (the imbalance) under the current plan and under the new one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_dlrover.advisor.signature import TableSpec
from lightning_dlrover.torchrec_glue import embedding_tables


def _natural(name: str) -> tuple:
    """Sort key putting ``t_cat_2`` before ``t_cat_10``."""
    import re

    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def find_kjt(batch: Any) -> Any | None:
    """The ``KeyedJaggedTensor`` of a batch: the batch itself, ``batch.sparse_features`` (TorchRec ``Batch``), or
    the first one in a mapping/sequence."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if isinstance(batch, KeyedJaggedTensor):
        return batch
    sparse = getattr(batch, "sparse_features", None)
    if isinstance(sparse, KeyedJaggedTensor):
        return sparse
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        if (found := find_kjt(item)) is not None:
            return found
    return None


class LookupCounter:
    """Counts ids per table and the hot-row share of lookups in the batches it observes.

    Args:
        tables: the embedding tables, each with the features it serves (``{table: (rows, [features])}``).
        hot_fraction: a table's hottest ``hot_fraction`` of rows are its hot rows.
    """

    def __init__(self, tables: Mapping[str, tuple[int, Sequence[str]]], hot_fraction: float = 0.01) -> None:
        if not 0 < hot_fraction < 1:
            raise ValueError(f"hot_fraction={hot_fraction} must be in (0, 1).")
        self.tables = list(tables)
        self.rows = {t: rows for t, (rows, _) in tables.items()}
        self.feature_table = {f: t for t, (_, features) in tables.items() for f in features}
        self.hot_fraction = hot_fraction
        # per table: ids, samples seen, hot lookups (sampled), lookups in sampled batches
        self.counts = torch.zeros(len(self.tables), 4, dtype=torch.float64)

    def observe(self, batch: Any, hot_rows: bool = False) -> bool:
        """Adds a batch's ids per table (and, with ``hot_rows``, its hot-row lookups); ``False`` if it has no KJT."""
        kjt = find_kjt(batch)
        if kjt is None:
            return False
        samples = kjt.stride()
        index = {t: i for i, t in enumerate(self.tables)}
        seen: set[int] = set()
        for key, ids in zip(kjt.keys(), kjt.length_per_key()):
            table = self.feature_table.get(key)
            if table is None:
                continue
            i = index[table]
            self.counts[i, 0] += ids
            if i not in seen:
                self.counts[i, 1] += samples
                seen.add(i)
        if hot_rows:
            for key, jagged in kjt.to_dict().items():
                table = self.feature_table.get(key)
                values = jagged.values()
                if table is None or values.numel() == 0:
                    continue
                _, counts = torch.unique(values, return_counts=True)
                k = max(1, math.ceil(self.hot_fraction * self.rows[table]))
                i = index[table]
                self.counts[i, 2] += counts.topk(min(k, counts.numel())).values.sum().item()
                self.counts[i, 3] += values.numel()
        return True

    def pooling_factors(self, counts: torch.Tensor | None = None) -> dict[str, float]:
        """Ids per sample of every observed table (``counts``: e.g. the sum over ranks of :attr:`counts`)."""
        c = self.counts if counts is None else counts
        return {t: float(c[i, 0] / c[i, 1]) for i, t in enumerate(self.tables) if c[i, 1] > 0}

    def hot_shares(self, counts: torch.Tensor | None = None) -> dict[str, float]:
        """Share of sampled lookups that hit each table's hottest ``hot_fraction`` of rows."""
        c = self.counts if counts is None else counts
        return {t: float(c[i, 2] / c[i, 3]) for i, t in enumerate(self.tables) if c[i, 3] > 0}


def plan_placement(plan: Any) -> dict[str, list[tuple[int, int, int, str]]]:
    """``{table: [(rank, rows, columns, sharding type), ...]}`` of a TorchRec ``ShardingPlan``."""
    out: dict[str, list[tuple[int, int, int, str]]] = {}
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():
            spec = sharding.sharding_spec
            if spec is None or sharding.sharding_type == "data_parallel":
                out[table] = [(r, -1, -1, "data_parallel") for r in (sharding.ranks or [])]
                continue
            out[table] = [(int(s.placement.rank()), s.shard_sizes[0], s.shard_sizes[1],
                           sharding.sharding_type) for s in spec.shards]
    return out


def rank_loads(placement: Mapping[str, list[tuple[int, int, int, str]]], tables: Sequence[TableSpec],
               world_size: int) -> dict[int, float]:
    """Embedding floats each rank gathers and updates per sample of the global batch: a table-/column-wise shard
    serves every sample's ids for its columns, a row-wise shard its share of the rows, a data-parallel table
    only its rank's samples."""
    specs = {t.name: t for t in tables}
    loads = {r: 0.0 for r in range(world_size)}
    for name, shards in placement.items():
        t = specs.get(name)
        if t is None:
            continue
        for rank, rows, cols, kind in shards:
            if kind == "data_parallel":
                loads[rank] = loads.get(rank, 0.0) + t.pooling_factor * t.dim / world_size
            elif "row" in kind:
                loads[rank] = loads.get(rank, 0.0) + t.pooling_factor * cols * rows / t.rows
            else:
                loads[rank] = loads.get(rank, 0.0) + t.pooling_factor * cols
    return loads


def imbalance(loads: Mapping[int, float]) -> float:
    """Busiest rank's load over the mean rank's (1.0: balanced)."""
    values = list(loads.values())
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class ReplanAdvice:
    """A re-plan with measured pooling factors and its effect on the ranks' embedding load.

    Attributes:
        pooling_factors: measured ids per sample per table.
        hot_shares: measured share of lookups on each table's hottest rows.
        loads_before, loads_after: embedding floats per global sample each rank serves (current plan, new plan).
        imbalance_before, imbalance_after: busiest over mean rank.
        placement_after: ``{table: sorted ranks}`` under the new plan.
        sharding_after: ``{table: sharding type}`` under the new plan.
    """

    pooling_factors: dict[str, float]
    hot_shares: dict[str, float]
    loads_before: dict[int, float]
    loads_after: dict[int, float]
    imbalance_before: float
    imbalance_after: float
    placement_after: dict[str, list[int]]
    sharding_after: dict[str, str]

    @property
    def worthwhile(self) -> bool:
        """Whether the new plan lowers the imbalance by more than 5%."""
        return self.imbalance_after < self.imbalance_before / 1.05

    def constraints_yaml(self) -> str:
        """``trainer.strategy.init_args.constraints`` giving the planner the measured pooling factors."""
        lines = ["# trainer.strategy.init_args (tables not listed keep the planner's 1.0)", "constraints:"]
        skewed = [(t, pf) for t, pf in self.pooling_factors.items() if abs(pf - 1.0) > 0.05]
        lines += [f"  {t}: {{pooling_factors: [{pf:.3g}]}}" for t, pf in sorted(skewed, key=lambda x: _natural(x[0]))]
        return "\n".join(lines)

    def message(self, applied: bool = False) -> str:
        """The finding; ``applied``: the advisor hands the re-plan to the strategy (``apply=True``)."""
        act = ("applied in process at the next commit under lightning-dlrover launch, else restart with the "
               "constraints below" if applied else "restart with the constraints below")
        return (f"sharding plan: busiest rank {self.imbalance_before:.2f}x the mean embedding load with the planner's "
                f"default pooling factors, {self.imbalance_after:.2f}x when re-planned with the measured ones"
                + (f" ({act})" if self.worthwhile else " (keep the current plan)"))


def replan(tables: Sequence[TableSpec], features: Mapping[str, Sequence[str]], world_size: int, local_world_size: int,
           batch_per_rank: int, sharding_types: Sequence[str], compute_kernel: str = "fused",
           device: str = "cpu", current_placement: Mapping[str, list] | None = None,
           hot_shares: Mapping[str, float] | None = None) -> ReplanAdvice:
    """Runs TorchRec's planner on ``tables`` (their ``pooling_factor`` = measured ids per sample) and compares the
    ranks' loads with ``current_placement`` (default: the planner's plan with pooling factors of 1.0)."""
    new = _plan(tables, features, world_size, local_world_size, batch_per_rank, sharding_types, compute_kernel,
                device, measured=True)
    before = current_placement or _plan(tables, features, world_size, local_world_size, batch_per_rank,
                                        sharding_types, compute_kernel, device, measured=False)
    loads_before, loads_after = rank_loads(before, tables, world_size), rank_loads(new, tables, world_size)
    return ReplanAdvice({t.name: t.pooling_factor for t in tables}, dict(hot_shares or {}), loads_before, loads_after,
                        imbalance(loads_before), imbalance(loads_after),
                        {t: sorted({s[0] for s in shards}) for t, shards in new.items()},
                        {t: shards[0][3] for t, shards in new.items() if shards})


def _plan(tables: Sequence[TableSpec], features: Mapping[str, Sequence[str]], world_size: int, local_world_size: int,
          batch_per_rank: int, sharding_types: Sequence[str], compute_kernel: str, device: str,
          measured: bool) -> dict[str, list[tuple[int, int, int, str]]]:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders

    configs = [EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows,
                                  feature_names=list(features.get(t.name, [t.name]))) for t in tables]
    module = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    constraints = {
        t.name: ParameterConstraints(sharding_types=list(sharding_types), compute_kernels=[compute_kernel],
                                     pooling_factors=[t.pooling_factor if measured else 1.0] * len(features.get(t.name, [t.name])))
        for t in tables
    }
    topology = Topology(world_size=world_size, compute_device=device, local_world_size=local_world_size)
    quiet = logging.getLogger("torchrec.distributed.planner")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the planner logs a table of its plan and dry-run warnings
    try:
        planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch_per_rank, constraints=constraints)
        plan = planner.plan(module, get_default_sharders())
    finally:
        quiet.setLevel(level)
    return plan_placement(plan)


def strategy_placement(strategy: Any) -> dict[str, list[tuple[int, int, int, str]]]:
    """:func:`plan_placement` of the sharding plan of ``strategy.model`` (TorchRec DMP), ``{}`` without one."""
    plan = getattr(getattr(strategy, "model", None), "plan", None)
    return plan_placement(plan) if plan is not None and hasattr(plan, "plan") else {}


def table_features(module: torch.nn.Module) -> dict[str, list[str]]:
    """Feature names of every embedding table of ``module``'s ``EmbeddingBagCollection``/``EmbeddingCollection``."""
    return {t.name: list(t.features) for t in embedding_tables(module)}
