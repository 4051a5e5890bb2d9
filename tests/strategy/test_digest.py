"""The state digest in one process: canonical order, sensitivity to every byte, ShardedTensor layout independence."""


import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from lightning_dlrover.monitor import state_digest


@pytest.fixture(scope="module")
def single_process_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"  # a file store: no port another job could hold
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded(full: torch.Tensor, col_splits: list[int]) -> ShardedTensor:
    """``full`` as a ShardedTensor made of column shards (all on this rank)."""
    shards, offset = [], 0
    metas = []
    for width in col_splits:
        meta = ShardMetadata([0, offset], [full.shape[0], width], "rank:0/cpu")
        shards.append(Shard(full[:, offset : offset + width].clone(), meta))
        metas.append(meta)
        offset += width
    props = TensorProperties(dtype=full.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    global_meta = ShardedTensorMetadata(metas, full.shape, props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, global_meta)


def test_digest_is_canonical(single_process_group):
    torch.manual_seed(0)
    table, bias = torch.randn(40, 8), torch.randn(3)
    one = state_digest({"b": bias, "t": sharded(table, [8])})
    two = state_digest({"t": sharded(table, [4, 4]), "b": bias})
    assert one == two, "independent of dict order and column sharding"
    flipped = table.clone()
    flipped.view(torch.int32)[17, 3] ^= 1
    assert state_digest({"b": bias, "t": sharded(flipped, [8])}) != one
    assert state_digest({"b": bias, "t": sharded(table, [8]), "step": 5}) == one, "non-tensors are not hashed"
    assert state_digest({"b": -bias * 0.0, "t": sharded(table, [8])}) != state_digest(
        {"b": bias * 0.0, "t": sharded(table, [8])}
    ), "bytes, not values: -0.0 differs from 0.0"
