"""Shrink in process: the survivors of a lost rank go on at the smaller world size in their own processes.

The world group first (:meth:`~lightning_dlrover.fault.inplace.process_group.ReconfigurableGroup.reconfigure` to a
new rank and world size): 3 real gloo processes, rank 0 exits, ranks 1 and 2 reconnect as ranks 0 and 1 of 2, and
every reader of the rank and world size that training uses sees the new ones (collectives, objects, TorchRec's
``ShardingEnv``, DDP's gradient average through :func:`divide_by_live_size`).
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_dlrover.fault.inplace import shrink
from lightning_dlrover.fault.inplace.process_group import BACKEND, divide_by_live_size, register
from lightning_dlrover.fault.restart.renumber import survivor_ranks
from lightning_dlrover.monitor.events import read_events
from tests.conftest import exit_rank


def test_survivors_keep_their_order_and_close_the_gaps():
    assert survivor_ranks(4, [1]) == {0: 0, 2: 1, 3: 2}
    assert survivor_ranks(3, [0]) == {1: 0, 2: 1}
    assert survivor_ranks(4, [0, 3]) == {1: 0, 2: 1}
    with pytest.raises(ValueError, match="not all ranks"):
        survivor_ranks(3, [3])


def test_the_launchers_shrink_plan_names_the_new_world_size():
    from lightning_dlrover.fault.inplace import membership

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    replaced = membership.publish_plan(store, 0, [1], 3, {1: 0})
    shrunk = membership.publish_shrink_plan(store, 0, [2], 3)
    assert not membership.wait_for_plan(store, 0, replaced.generation).shrinks
    read = membership.wait_for_plan(store, 0, shrunk.generation)
    assert read == shrunk and read.shrinks and (read.generation, read.world_size, read.lost) == (2, 2, [2])
    assert not read.covered  # nobody takes rank 2: survivors must not wait for a replacement


def test_a_shrink_below_k_plus_r_or_past_the_machines_memory_is_refused_with_an_event(tmp_path, monkeypatch):
    assert shrink.refusal(4, [1], (2, 1)) is None  # 3 survivors hold k + r = 3
    why, message = shrink.refusal(3, [0], (2, 1))
    assert why == shrink.BELOW_PARITY and "2 survivors are fewer than k + r = 3" in message
    assert shrink.refusal(3, [0], None)[0] == shrink.NO_PARITY
    mib = 2**20
    # the launcher's check: 4 ranks of 10 MiB each; the 3 survivors build 40 MiB of new shares beside their own
    assert shrink.memory_refusal(10 * mib, 4, [3], 1000 * mib, 960 * mib, 500 * mib) is None
    why, message = shrink.memory_refusal(10 * mib, 4, [3], 1000 * mib, 961 * mib, 500 * mib)
    assert why == shrink.WOULD_NOT_FIT and "allocate 40 MiB" in message and "39 MiB left" in message, message
    assert shrink.memory_refusal(10 * mib, 4, [3], 1000 * mib, 0, 39 * mib)[0] == shrink.WOULD_NOT_FIT  # the machine's
    assert shrink.memory_refusal(0, 4, [3], 1000 * mib, 999 * mib, 0) is None  # nothing published: nothing known
    monkeypatch.setenv("LIGHTNING_DLROVER_EVENTS", str(tmp_path / "events.jsonl"))
    shrink.refuse(3, [0], why, message, step=7)
    (event,) = read_events([tmp_path / "events.jsonl"])
    assert (event.kind, event.step, event.fields["why"], event.fields["lost_ranks"]) == ("shrink_refused", 7, why, [0])


def _dense_grad(old_rank: int) -> torch.Tensor:
    """The gradient one rank's batch gives a fixed Linear(4, 1) (the reference for DDP's average)."""
    model = _linear()
    model(_batch(old_rank)).sum().backward()
    return model.weight.grad.clone()


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def _batch(old_rank: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32).reshape(2, 4) * (old_rank + 1) / 7


def _as_launched(port: int) -> None:
    """What ``lightning-dlrover launch`` gives its workers: the launcher's store (here the test's), where a rank marks
    itself started before its group connects."""
    from lightning_dlrover.fault.inplace import membership

    os.environ[membership.STORE_ENV] = f"127.0.0.1:{port}"


def _shrink_worker(rank: int, port: int) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        register()
        _as_launched(port)
        dist.init_process_group(BACKEND, store=store, rank=rank, world_size=3, timeout=timedelta(seconds=30))
        group = dist.group.WORLD
        total = torch.tensor([rank + 1])
        dist.all_reduce(total, group=dist.group.WORLD)
        assert int(total) == 6
        if rank == 0:
            exit_rank()  # lost: its peers' next collective fails
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.tensor([1]), group=dist.group.WORLD)
        with pytest.raises(ValueError, match="at most its capacity of 3 ranks"):
            group.reconfigure(1, rank=0, world_size=4)
        new = survivor_ranks(3, [0])[rank]
        group.reconfigure(1, rank=new, world_size=2)
        assert (group.generation, dist.get_rank(), dist.get_world_size()) == (1, new, 2)
        assert dist.get_process_group_ranks(dist.group.WORLD) == [0, 1]
        total = torch.tensor([rank + 1])
        dist.all_reduce(total, group=dist.group.WORLD)
        assert int(total) == 5  # old ranks 1 and 2
        olds: list = [None, None]
        dist.all_gather_object(olds, rank, group=dist.group.WORLD)
        assert olds == [1, 2]
        said = [f"old rank {rank}" if new == 1 else None]
        dist.broadcast_object_list(said, src=1, group=dist.group.WORLD)
        assert said == ["old rank 2"]
        from torchrec.distributed.types import ShardingEnv

        env = ShardingEnv.from_process_group(dist.group.WORLD)
        assert (env.rank, env.world_size) == (new, 2)
        ddp = torch.nn.parallel.DistributedDataParallel(_linear(), process_group=dist.group.WORLD)
        ddp.register_comm_hook(dist.group.WORLD, divide_by_live_size)
        ddp(_batch(rank)).sum().backward()
        expected = _dense_grad(1) * 0.5 + _dense_grad(2) * 0.5
        assert torch.equal(ddp.module.weight.grad, expected), (ddp.module.weight.grad, expected)
    except BaseException:  # noqa: BLE001 - the parent sees the exit code, the output says why
        traceback.print_exc()
        os._exit(1)
    exit_rank()


@pytest.mark.slow
def test_the_world_group_shrinks_onto_the_survivors_renumbered():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    ranks = [ctx.Process(target=_shrink_worker, args=(rank, store.port)) for rank in range(3)]
    for proc in ranks:
        proc.start()
    for proc in ranks:
        proc.join(120)
    assert [proc.exitcode for proc in ranks] == [0, 0, 0]


TABLES = 3


class _Sparse(torch.nn.Module):
    def __init__(self, ebc) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt):
        return self.ebc(kjt)


def _ebc():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8 * (i + 1), num_embeddings=40 + 30 * i,
                                 feature_names=[f"f{i}"]) for i in range(TABLES)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
    return _Sparse(ebc)


def _shard(module, world_size: int):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv

    from lightning_dlrover.strategy.sharding import plan_sharding

    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise", "row_wise"], compute_kernels=["fused"])
                   for i in range(TABLES)}
    plan = plan_sharding(module, constraints, torch.device("cpu"), local_world_size=world_size)
    return DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                    device=torch.device("cpu"), plan=plan)


def _train_step(dmp, rank: int, step: int) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(1, 4, (TABLES * 2,), generator=g)
    values = torch.cat([torch.randint(0, 40 + 30 * (i // 2), (int(n),), generator=g) for i, n in enumerate(lengths)])
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(TABLES)], values=values, lengths=lengths)
    dmp(kjt).values().pow(2).sum().backward()


def _full_state(dmp) -> dict[str, torch.Tensor]:
    """Every table's weights and optimizer state, whole, gathered from the shards (collective)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    tensors = dict(dmp.state_dict())
    for key, states in dmp.fused_optimizer.state_dict()["state"].items():
        tensors.update({f"{key}/{name}": value for name, value in states.items()})
    pieces = [(key, tuple(value.size()), tuple(shard.metadata.shard_offsets), shard.tensor.clone())
              for key, value in tensors.items() if isinstance(value, ShardedTensor) for shard in value.local_shards()]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces, group=dist.group.WORLD)
    full = {key: torch.full(size, float("nan")) for held in everyone for key, size, _, _ in held}
    for held in everyone:
        for key, _, offsets, tensor in held:
            full[key][tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
    return full


def _reshard_worker(rank: int, port: int) -> None:
    from lightning_dlrover.fault.coding.coded_embeddings import CodedEmbeddings
    from lightning_dlrover.fault.coding.coded_state import CodedState
    from lightning_dlrover.fault.coding.placement import ParityPlacement
    from lightning_dlrover.fault.restart.reshard import restore
    from lightning_dlrover.torchrec_glue import uninitialised_tables, unsharded_twins

    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        register()
        _as_launched(port)
        dist.init_process_group(BACKEND, store=store, rank=rank, world_size=3, timeout=timedelta(seconds=30))
        torch.manual_seed(0)
        module = _ebc()
        twins = unsharded_twins(module)
        dmp = _shard(module, 3)
        state = CodedState(dmp, 1)
        coded = CodedEmbeddings(state, ParityPlacement(3, 1, 1, 3))
        for step in range(2):  # (deltas are not committed here: the encode below is of the trained state)
            _train_step(dmp, rank, step)
        coded.encode()
        before = _full_state(dmp)
        assert not any(value.isnan().any() for value in before.values())
        if rank == 0:
            exit_rank()
        spill = coded.spill(rank, 2, None, None)  # in memory: nothing written
        new = survivor_ranks(3, [0])[rank]
        dist.group.WORLD.reconfigure(1, rank=new, world_size=2)
        state.close()
        del dmp, coded, state
        module.ebc = twins["ebc"]()  # unsharded again, on the meta device
        with uninitialised_tables():  # the restore fills every byte
            dmp = _shard(module, 2)
        state = CodedState(dmp, 1)
        report = restore(state, [spill])
        assert report is not None and report.lost == [0] and report.step == 2, report
        coded = CodedEmbeddings(state, ParityPlacement(2, 1, 1, 2))
        assert coded.verify()
        after = _full_state(dmp)
        assert sorted(after) == sorted(before)
        for key, value in before.items():
            assert torch.equal(after[key], value), key
        _train_step(dmp, new, 2)  # the smaller world trains
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        os._exit(1)
    exit_rank()


@pytest.mark.slow
def test_survivors_reshard_the_lost_ranks_tables_onto_the_smaller_world_in_process():
    """TorchRec's sharded tables at 3 ranks, rank 0 lost: ranks 1 and 2 shrink the group, shard the tables anew for
    2 ranks and fill them from their in-memory spills (the restart path's decode and re-shard), every weight and
    optimizer state equal to before the loss, and parity of the new world equal to a fresh encode."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    ranks = [ctx.Process(target=_reshard_worker, args=(rank, store.port)) for rank in range(3)]
    for proc in ranks:
        proc.start()
    for proc in ranks:
        proc.join(180)
    assert [proc.exitcode for proc in ranks] == [0, 0, 0]
