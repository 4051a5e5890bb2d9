"""How a replacement builds its sharded tables alone, while the survivors train (issue #26), in real gloo processes:

- an ``EmbeddingCollection`` is built with no collective (``torchrec_glue.shard_metadata_from_plan``): one rank builds
  it while the other does not take part, and every table's ``ShardedTensor`` metadata equals the one the two ranks'
  gather built (tables it holds, tables it does not hold, a table split over both);
- the tables' FBGEMM buffers are neither initialised nor zeroed (``torchrec_glue.uninitialised_tables``) and come
  from the memory handed to the build (a hot spare's reserve, ``fault/coding/reserve.py``) while it has room.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_dlrover import torchrec_glue
from lightning_dlrover.fault.coding.reserve import Reserve
from tests.conftest import exit_rank

ROWS, DIM = 64, 8


def _collection(bag: bool):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    if bag:
        module = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t{t}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{t}"])
                    for t in range(3)], device=torch.device("meta"))
        apply_optimizer_in_backward(torch.optim.Adagrad, module.parameters(), {"lr": 0.1})
    else:
        module = EmbeddingCollection(
            tables=[EmbeddingConfig(name=f"t{t}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{t}"])
                    for t in range(3)], device=torch.device("meta"))
        apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.1})
    return module


def _shard(bag: bool):
    """The collection sharded on this rank: ``t0`` on rank 0, ``t1`` on rank 1, ``t2`` column-wise over both."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv

    module = _collection(bag)
    sharder = EmbeddingBagCollectionSharder() if bag else EmbeddingCollectionSharder()
    plan = construct_module_sharding_plan(
        module, {"t0": table_wise(rank=0), "t1": table_wise(rank=1), "t2": column_wise(ranks=[0, 1])},
        local_size=2, world_size=2, device_type="cpu", sharder=sharder)
    return sharder.shard(module, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))


def _metadata(module) -> dict:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return {key: value.metadata() for key, value in module.state_dict().items() if isinstance(value, ShardedTensor)}


def _worker(rank: int, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    gathered = _metadata(_shard(bag=False))  # both ranks: the gather
    if rank == 1:  # alone: rank 0 waits in the barrier below, a collective here would not be answered
        with torchrec_glue.shard_metadata_from_plan():
            alone = _metadata(_shard(bag=False))
        assert sorted(alone) == sorted(gathered) and len(gathered) == 3, (sorted(alone), sorted(gathered))
        for key, expected in gathered.items():
            assert alone[key] == expected, (key, alone[key], expected)
        _check_uninitialised()
    dist.barrier()
    dist.destroy_process_group()
    exit_rank()


def _check_uninitialised() -> None:
    """Rank 1's tables (``t1`` and its half of ``t2``, with their Adagrad state) built in a reserve filled with 0xAB:
    every byte is still 0xAB (nothing initialised or zeroed them); a reserve too small for them gives fresh memory."""
    for size, fits in ((1 << 20, True), (64, False)):
        reserve = Reserve(size)
        reserve.memory.fill_(0xAB)
        with torchrec_glue.uninitialised_tables(host_buffer=reserve.take), torchrec_glue.shard_metadata_from_plan():
            module = _shard(bag=True)
        kernels = torchrec_glue.fused_embedding_kernels(module)
        buffers = [getattr(k.emb_module, f"{name}_host") for k in kernels for name in ("weights", "momentum1")]
        assert buffers and all(b.numel() for b in buffers)
        lo, hi = reserve.memory.data_ptr(), reserve.memory.data_ptr() + reserve.memory.numel()
        inside = [lo <= b.data_ptr() < hi for b in buffers]
        assert inside == [fits] * len(buffers), (size, inside)
        if fits:
            assert all(bool((b.view(torch.uint8) == 0xAB).all()) for b in buffers)
            assert reserve.used >= sum(b.numel() * b.element_size() for b in buffers)


def test_a_replacement_builds_its_tables_alone_and_uninitialised(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path / "store"),), nprocs=2, start_method="spawn")


def test_the_reserve_hands_out_aligned_views_until_it_is_full():
    reserve = Reserve(1000)
    a = reserve.take(3, torch.uint8)
    b = reserve.take(10, torch.float32)
    assert a.numel() == 3 and b.numel() == 10 and b.dtype == torch.float32
    assert (b.data_ptr() - reserve.memory.data_ptr()) % 64 == 0
    assert reserve.take(1000, torch.uint8) is None  # does not fit in what is left: the caller allocates
    assert reserve.take(100, torch.uint8) is not None
