"""How the strategy asks TorchRec's planner to shard a model's embedding tables."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan, ShardingType

from lightning_dlrover import torchrec_glue
from lightning_dlrover.fault import FaultManager

SHARDING_TYPES = [t.value for t in ShardingType]
COMPUTE_KERNELS = [k.value for k in EmbeddingComputeKernel]
# gloo has no reduce-scatter, which these sharding types need in their backward pass.
NEEDS_REDUCE_SCATTER = {"row_wise", "table_row_wise", "grid_shard"}
CPU_DEFAULT_SHARDING_TYPES = ["table_wise", "column_wise", "table_column_wise"]


@dataclass
class TableConstraint:
    """Per-table limits on the planner (``DLRoverStrategy(constraints={"t_cat_0": TableConstraint(...)})``).

    Args:
        sharding_types: sharding types the planner may choose for this table.
        compute_kernels: compute kernels it may choose (``fused`` keeps the optimizer in the backward pass).
        min_partition: smallest column shard for column-wise sharding.
        pooling_factors: ids per sample the table receives, one value per input feature, for the planner's cost
            model (TorchRec assumes 1.0); ``ResourceAdvisor`` measures them (see its re-plan advice).
    """

    sharding_types: list[str] | None = None
    compute_kernels: list[str] | None = None
    min_partition: int | None = None
    pooling_factors: list[float] | None = None


def check_choices(field: str, values: list[str] | None, allowed: list[str]) -> None:
    """Raises a ``ValueError`` naming ``field`` if a value is not one of ``allowed``."""
    if values is not None and not values:
        raise ValueError(f"strategy.{field} is empty: leave it out for the defaults, or name some of {allowed}.")
    for value in values or []:
        if value not in allowed:
            raise ValueError(f"strategy.{field}: {value!r} is not one of {allowed}.")


def check_options(
    sharding_types: list[str] | None, compute_kernel: str, constraints: dict[str, TableConstraint], parity: bool
) -> None:
    """Raises ``ValueError`` naming the field when a strategy option is not one of TorchRec's choices, or when
    ``parity`` is on with a caching compute kernel."""
    check_choices("sharding_types", sharding_types, SHARDING_TYPES)
    check_choices("compute_kernel", [compute_kernel], COMPUTE_KERNELS)
    for table, constraint in constraints.items():
        check_choices(f"constraints.{table}.sharding_types", constraint.sharding_types, SHARDING_TYPES)
        check_choices(f"constraints.{table}.compute_kernels", constraint.compute_kernels, COMPUTE_KERNELS)
    kernels = {compute_kernel, *(k for c in constraints.values() for k in c.compute_kernels or [])}
    if parity and (caching := sorted(k for k in kernels if "caching" in k)):
        raise ValueError(
            f"strategy.parity with compute kernel(s) {caching}: rows in the UVM cache are not flushed before parity "
            "reads them, so parity could miss updates. Use compute_kernel='fused' with parity."
        )


def embedding_tables(module: nn.Module) -> dict[str, str]:
    """Maps every embedding table name in ``module`` to the path of the collection that holds it."""
    return {table.name: table.path for table in torchrec_glue.embedding_tables(module)}


def unfused_embedding_parameters(module: nn.Module) -> list[str]:
    """Names of embedding parameters that have no TorchRec in-backward optimizer."""
    return [param.name for param in torchrec_glue.embedding_parameters(module) if not param.in_backward]


#: In-backward optimizers FBGEMM's fused kernels run on CPU (its CPU kernels have no Adam, LAMB, LARS ...).
CPU_FUSED_OPTIMIZERS = ("SGD", "Adagrad", "RowWiseAdagrad")


def unsupported_cpu_optimizers(module: nn.Module) -> dict[str, str]:
    """``{parameter: optimizer class}`` of embedding parameters whose in-backward optimizer FBGEMM cannot run on CPU."""
    return {
        param.name: cls.__name__
        for param in torchrec_glue.embedding_parameters(module)
        for cls in param.optimizer_classes
        if cls.__name__ not in CPU_FUSED_OPTIMIZERS
    }


def check_module(module: nn.Module, compute_kernel: str, device_type: str) -> dict[str, str]:
    """The module's embedding tables (see :func:`embedding_tables`); raises a ``ValueError`` saying what to change
    when the strategy cannot train it: no tables, tables without in-backward optimizer, an optimizer the device's
    fused kernels do not have."""
    tables = embedding_tables(module)
    if not tables:
        raise ValueError(
            f"{type(module).__name__} has no TorchRec EmbeddingBagCollection or EmbeddingCollection; "
            "DLRoverStrategy shards those. Use `strategy='ddp'` for models without embedding tables."
        )
    if compute_kernel == "fused" and (unfused := unfused_embedding_parameters(module)):
        raise ValueError(
            f"Embedding parameters {unfused} have no in-backward optimizer, which the fused kernel needs. "
            "Call torchrec.optim.apply_optimizer_in_backward(...) on them in the LightningModule's __init__."
        )
    if device_type == "cpu" and (unsupported := unsupported_cpu_optimizers(module)):
        raise ValueError(
            f"In-backward optimizers {sorted(set(unsupported.values()))} of {sorted(unsupported)[:3]}... are not "
            f"supported by FBGEMM on CPU; choose one of {list(CPU_FUSED_OPTIMIZERS)} (DLRMModule: "
            "model.embedding_optimizer: sgd, adagrad or row_wise_adagrad), or train on GPU without parity (untested: "
            "README.md, 'What runs where')."
        )
    return tables


def check_elastic_sizes(world_sizes: list[int], global_batch: int | None, parity: tuple[int, int] | None) -> None:
    """Rejects a job that could not run at one of the world sizes its ``--nnodes MIN:MAX`` range allows."""
    smallest = min(world_sizes)
    if parity is not None and sum(parity) > smallest:
        k, r = parity
        raise ValueError(
            f"strategy.parity: k + r = {k} + {r} needs {k + r} ranks, but the job may shrink to {smallest} ranks "
            f"(torchrun --nnodes allows world sizes {world_sizes}). Lower k, or raise the minimum number of nodes."
        )
    if global_batch is not None and (bad := [w for w in world_sizes if global_batch % w]):
        raise ValueError(
            f"data.global_batch_size={global_batch} is not divisible by the world sizes {bad} that torchrun --nnodes "
            f"allows (every size in {world_sizes} must divide it). Choose a multiple of "
            f"{math.lcm(*world_sizes)}, or narrow the node range."
        )


def build_constraints(
    tables: dict[str, str],
    sharding_types: list[str],
    compute_kernel: str,
    overrides: dict[str, TableConstraint],
    backend: str,
) -> dict[str, ParameterConstraints]:
    """Planner constraints for every table: the strategy-wide choices, refined by per-table overrides."""
    unknown = sorted(set(overrides) - set(tables))
    if unknown:
        raise ValueError(
            f"strategy.constraints names table(s) {unknown} that the model does not have; "
            f"its tables are {sorted(tables)}."
        )
    constraints = {}
    for table in tables:
        override = overrides.get(table, TableConstraint())
        types = override.sharding_types or sharding_types
        if backend == "gloo" and NEEDS_REDUCE_SCATTER & set(types):
            raise ValueError(
                f"strategy sharding types for table {table!r} include {sorted(NEEDS_REDUCE_SCATTER & set(types))}, "
                f"which need reduce-scatter; the gloo backend (CPU) has none. Use {CPU_DEFAULT_SHARDING_TYPES} "
                "or 'data_parallel' on CPU."
            )
        kernels = override.compute_kernels or [compute_kernel]
        if "data_parallel" in types and "dense" not in kernels:
            kernels = [*kernels, "dense"]  # data-parallel tables only run the dense kernel
        extra = {"pooling_factors": list(override.pooling_factors)} if override.pooling_factors else {}
        constraints[table] = ParameterConstraints(
            sharding_types=types, compute_kernels=kernels, min_partition=override.min_partition, **extra
        )
    return constraints


def plan_sharding(
    module: nn.Module,
    constraints: dict[str, ParameterConstraints],
    device: torch.device,
    local_world_size: int,
    sharders: list[ModuleSharder[nn.Module]] | None = None,
    world_size: int | None = None,
) -> ShardingPlan:
    """Runs TorchRec's planner on rank 0 and shares the plan with every rank (a collective), for ``world_size``
    ranks (default: the current world; a grow in process plans for the larger world before it exists)."""
    world_size = world_size or dist.get_world_size()
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=world_size, local_world_size=local_world_size),
        kernel_config=KernelConfig(compute_device=device.type),
    )
    enumerator = torchrec_glue.ordered_enumerator(topology=topology, batch_size=BATCH_SIZE, constraints=constraints)
    # TorchRec's default reservation (heuristic) warns that it is deprecated and over-estimates dense tensors; the
    # same 15 % of each device's memory is kept back (the demo's plans are unchanged at 1-4 ranks).
    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints=constraints,
        enumerator=enumerator,
        storage_reservation=FixedPercentageStorageReservation(percentage=0.15),
    )
    try:
        return planner.collective_plan(module, sharders or get_default_sharders(), dist.GroupMember.WORLD)
    except Exception as err:
        raise RuntimeError(
            f"TorchRec's planner found no sharding plan for world size {world_size} on {device.type} "
            f"with constraints {constraints}: {err}. Relax strategy.sharding_types/constraints or change "
            "the number of devices."
        ) from err


def describe_plan(plan: ShardingPlan) -> str:
    """One line per sharding type: ``table_wise: t_cat_0@0, t_cat_1@1`` (table @ ranks)."""
    by_type: dict[str, list[str]] = {}
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():  # type: ignore[union-attr]
            ranks = ",".join(str(r) for r in sorted(set(sharding.ranks or [])))
            by_type.setdefault(sharding.sharding_type, []).append(f"{table}@{ranks}")
    return "; ".join(f"{kind}: {' '.join(tables)}" for kind, tables in sorted(by_type.items()))


#: How DDP buckets the dense gradients (``bench/bench_ddp_buckets.py`` measures each). DDP rebuilds its buckets in
#: gradient-ready order after a process's first step, so a resumed job would reduce that step's gradients in other
#: buckets than an uninterrupted one and, at > 2 ranks, the float sums would differ (not bit-exact):
#: - ``find_unused`` (used): unused-parameter search, with which DDP never rebuilds, at the price of a traversal of
#:   the autograd graph every step (not measurable on the demo DLRM) and DDP's C++ warning about it, once per rank;
#: - ``per_parameter``: every parameter its own bucket, no traversal; exact across a restart, but NOT across an
#:   in-process replacement: the rebuild is a collective (bucket order broadcast from rank 0) that a replacement runs
#:   at its first step and the survivors, rebuilt long ago, do not (tests/fault/test_in_process.py's digests differ);
#: - ``rebuilt``: DDP's default, not bit-exact after a resume (for comparison only: a 4-rank node-loss drill of
#:   tests/fault/test_user_models.py then ends with another digest than the fault-free run).
DDP_BUCKETS: dict[str, dict[str, Any]] = {
    "per_parameter": {
        "static_graph": False, "find_unused_parameters": False, "ddp_kwargs": {"bucket_cap_mb_list": [0]},
    },
    "find_unused": {"static_graph": False, "find_unused_parameters": True},
    "rebuilt": {"static_graph": False, "find_unused_parameters": False},
}


def distribute(
    module: nn.Module, plan: ShardingPlan, device: torch.device, buckets: str = "find_unused", initialise: bool = True
) -> DistributedModelParallel:
    """``module`` wrapped in TorchRec's ``DistributedModelParallel`` on the world process group, sharded by ``plan``,
    its dense part in DDP with the bucket policy ``buckets`` (one of :data:`DDP_BUCKETS`). ``initialise=False``: built
    by a replacement joining a running job, alone: the sharded tables are allocated and left uninitialised (the decode
    fills them, see :func:`~lightning_dlrover.torchrec_glue.uninitialised_tables`), and their shard metadata comes from
    ``plan``, not from a gather the survivors would not answer (see
    :func:`~lightning_dlrover.torchrec_glue.shard_metadata_from_plan`)."""
    with contextlib.ExitStack() as joining:
        if not initialise:
            joining.enter_context(torchrec_glue.uninitialised_tables(host_buffer=FaultManager.reserved))
            joining.enter_context(torchrec_glue.shard_metadata_from_plan())
        return DistributedModelParallel(
            module=module,
            env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
            device=device,
            plan=plan,
            data_parallel_wrapper=DefaultDataParallelWrapper(**DDP_BUCKETS[buckets]),
        )
