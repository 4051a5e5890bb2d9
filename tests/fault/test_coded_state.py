"""CodedState on a real single-process TorchRec model: chunk layout round-trips and the undo log."""


import pytest
import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from lightning_dlrover.fault import CodedState
from lightning_dlrover.strategy.sharding import plan_sharding


@pytest.fixture(scope="module")
def sharded_ebc(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"  # a file store: no port another job could hold
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8 * (i + 1), num_embeddings=50 + 30 * i,
                                 feature_names=[f"f{i}"]) for i in range(3)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
                   for i in range(3)}
    plan = plan_sharding(ebc, constraints, torch.device("cpu"), local_world_size=1)
    dmp = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                   device=torch.device("cpu"), plan=plan)
    yield dmp
    dist.destroy_process_group()


def test_chunks_round_trip_and_rows_never_straddle(sharded_ebc):
    state = CodedState(sharded_ebc, k=3)
    assert [s.name.split("@")[0] for s in state.segments] == ["t0", "t0", "t1", "t1", "t2", "t2"]
    assert state.chunk_len % 96 == 0 and state.chunk_len * 3 >= state.num_bytes
    before = [s.tensor.clone() for s in state.segments]
    chunks = [state.read_chunk(c) for c in range(3)]
    for s in state.segments:
        s.tensor.zero_()
    for c, chunk in enumerate(chunks):
        state.write_chunk(c, chunk)
    assert all(torch.equal(a, s.tensor) for a, s in zip(before, state.segments))
    for seg_index, seg in enumerate(state.segments):
        rows = torch.arange(seg.rows)
        chunk, slot = state.locate(seg_index, rows)
        for r in (0, seg.rows // 2, seg.rows - 1):
            got = chunks[int(chunk[r])].view(-1, seg.row_bytes)[int(slot[r])]
            assert torch.equal(got, seg.row_view()[r])
    state.close()


def test_undo_log_over_two_forwards_in_one_step(sharded_ebc):
    state = CodedState(sharded_ebc, k=1)
    weight, momentum = state.segments[0].tensor, state.segments[1].tensor
    original = weight.clone(), momentum.clone()
    state._touch(0, torch.tensor([2, 1, 2]))
    weight[[1, 2]] += 1.0
    state._touch(0, torch.tensor([5, 2]))  # row 2 already logged: its committed value must be kept
    weight[[2, 5]] += 1.0
    momentum[5] += 3.0
    touched = {index: (rows, old) for index, rows, old in state.touched()}
    rows, old = touched[0]
    assert rows.tolist() == [1, 2, 5]  # in row order, each row once
    assert torch.equal(old, original[0].index_select(0, rows))  # the committed values, not the first forward's
    assert touched[1][0].tolist() == [1, 2, 5] and torch.equal(touched[1][1], original[1].index_select(0, rows))
    state.rollback()
    assert torch.equal(weight, original[0]) and torch.equal(momentum, original[1])
    assert state.touched() == []
    state.close()


@pytest.mark.parametrize("every", [1, 3])
def test_undo_log_of_real_steps_against_snapshots(sharded_ebc, every):
    """Real forwards and fused optimizer steps, ``every`` per commit window: touched() gives the union of the
    window's ids in increasing order with the window-start values; rollback restores them exactly."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    state = CodedState(sharded_ebc, k=2)
    gen = torch.Generator().manual_seed(every)
    sizes = [50, 80, 110]
    for window in range(4):
        start = [s.tensor.clone() for s in state.segments]
        union = [set() for _ in sizes]
        for _ in range(every):
            ids = [(n * torch.rand(12, generator=gen).pow(2)).long() for n in sizes]
            for t, i in enumerate(ids):
                union[t] |= set(i.tolist())
            kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"], values=torch.cat(ids),
                                                      lengths=torch.ones(36, dtype=torch.int32))
            sharded_ebc(kjt).values().sum().backward()
        assert not all(torch.equal(a, s.tensor) for a, s in zip(start, state.segments))  # the optimizer ran
        touched = {index: (rows, old) for index, rows, old in state.touched()}
        assert sorted(touched) == list(range(len(state.segments)))
        for index, seg in enumerate(state.segments):
            rows, old = touched[index]
            assert rows.tolist() == sorted(union[seg.table])
            assert torch.equal(old, start[index].index_select(0, rows))
            untouched = torch.ones(seg.rows, dtype=torch.bool)
            untouched[rows] = False
            assert torch.equal(seg.tensor[untouched], start[index][untouched])  # only logged rows changed
        if window % 2:
            state.rollback()
            assert all(torch.equal(a, s.tensor) for a, s in zip(start, state.segments))
        else:
            state.commit()
        assert state.touched() == []
    state.close()
