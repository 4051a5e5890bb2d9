"""Sharding the LightningModule's tables for the world the strategy runs in (moved out of ``dlrover.py``, which is at
the size limit): at set-up, and again at a new world size after a shrink or grow in process (:mod:`.in_process`)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.types import ShardingPlan

from lightning_dlrover import torchrec_glue
from lightning_dlrover.monitor import emit
from lightning_dlrover.strategy.sharding import describe_plan, distribute, plan_sharding

if TYPE_CHECKING:
    from lightning_dlrover.strategy.dlrover import DLRoverStrategy

#: Per strategy, the unsharded twins of its module's embedding collections (``torchrec_glue.unsharded_twins``), read
#: before the first sharding: a shrink in process puts them back and shards again for the smaller world.
_twins: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
#: Per strategy, the pooled embeddings' key order of the model :func:`shard` built last (see :func:`pooled_keys`).
_orders: weakref.WeakKeyDictionary[Any, dict[str, list[str]]] = weakref.WeakKeyDictionary()


def shard(strategy: DLRoverStrategy, module: pl.LightningModule, initialise: bool = True,
          plan: ShardingPlan | None = None) -> DistributedModelParallel:
    """Plans the sharding of ``module``'s embedding tables for the current world (unless ``plan`` is given: see
    :func:`plan_for`) and wraps it in TorchRec's ``DistributedModelParallel`` (``initialise=False``, or on a
    replacement: tables left for a restore to fill)."""
    if plan is None:
        plan = plan_for(strategy, module, dist.get_world_size())
    dmp = distribute(module, plan, strategy.root_device, initialise=initialise and not strategy.fault.joining())
    strategy.fault.average_over_live_ranks(torchrec_glue.dmp_wrapped_module(dmp))  # (room to grow, or shrunk)
    _orders[strategy] = torchrec_glue.pooled_key_order(module)
    rank_zero_info(f"DLRoverStrategy: {describe_plan(plan)}")
    return dmp


def plan_for(strategy: DLRoverStrategy, module: pl.LightningModule, world_size: int) -> ShardingPlan:
    """The sharding plan of ``module``'s tables for ``world_size`` ranks of one machine (the planner's collective over
    the current world), kept in the launcher's store for the ranks that join; a joining rank reads it instead."""
    constraints = strategy.check_model(module, dist.get_backend())
    if strategy not in _twins:
        _twins[strategy] = torchrec_glue.unsharded_twins(module)
    # Dense parameters move to the device now; meta-device tables are materialised by their shards.
    module._apply(lambda t: t if t.is_meta else t.to(strategy.root_device))
    # The plan is kept in the launcher's store for replacements, which read it instead (the survivors are not running
    # the planner's collective); DistributedModelParallel's constructor broadcasts TorchRec's collective-validation
    # flag from rank 0 once per process, and the survivors are not listening: a replacement keeps the default (off).
    local = strategy.num_processes if world_size == dist.get_world_size() else world_size
    return strategy.fault.shared_plan(  # type: ignore[return-value]
        lambda: plan_sharding(module, constraints, strategy.root_device, local_world_size=local, world_size=world_size),
        strategy.global_rank, torchrec_glue.skip_collective_validation_broadcast,
    )


#: The key under which a checkpoint or a committed step keeps the pooled embeddings' key order (:func:`pooled_keys`).
POOLED_KEYS = "dlrover_pooled_keys"


def pooled_keys(strategy: DLRoverStrategy) -> dict[str, list[str]]:
    """``{collection path: keys}``: the order of each sharded embedding-bag collection's pooled output, which follows
    the sharding plan (a model reading its ``KeyedTensor.values()`` by position depends on it). Read once per sharding,
    by :func:`shard` (each commit keeps it)."""
    return _orders.get(strategy, {})


def by_key(module: pl.LightningModule) -> bool:
    """Whether ``module`` says it reads its pooled embeddings by key (``pooled_embeddings_by_key = True``), so that no
    sharding plan can permute its features."""
    return bool(getattr(module, "pooled_embeddings_by_key", False))


def say_if_reordered(strategy: DLRoverStrategy, before: dict[str, list[str]] | None, step: int | None, how: str) -> None:
    """Records (``feature_order_changed``, rank 0) that the pooled embeddings' key order now differs from ``before``,
    the order the state was trained with (``how``: what put the tables where they are now), with a warning unless the
    model says it reads them by key; nothing when ``before`` is unknown."""
    after = pooled_keys(strategy)
    if not before or before == after or not strategy.is_global_zero:
        return
    moved = "; ".join(f"{path or 'model'}: {', '.join(before.get(path, []))} -> {', '.join(keys)}"
                      for path, keys in after.items() if keys != before.get(path))
    emit("feature_order_changed", step=step, before=before, after=after, how=how, message=None if by_key(
        strategy.lightning_module) else f"{how}: the sharding plan orders the pooled embeddings anew ({moved}); a model "
         "that reads the sharded EmbeddingBagCollection's output by position (KeyedTensor.values()) sees its features "
         "permuted from here on: read it by key (to_dict(), as TorchRec's DLRM does) and set pooled_embeddings_by_key "
         "= True on the LightningModule to say so")


def unshard(strategy: DLRoverStrategy, module: pl.LightningModule) -> None:
    """Puts unsharded twins (meta device, same tables and in-backward optimizers) in place of ``module``'s sharded
    embedding collections, to shard them again for another world."""
    for path, make in _twins[strategy].items():
        module.set_submodule(path, make())
