"""Criteo-format sources: determinism across world sizes, the TSV reader, the resumable loader."""

import math

import pytest
import torch

from lightning_dlrover.data import CriteoTSV, ResumableLoader, SyntheticCriteo
from lightning_dlrover.data.sources import NUM_SPARSE

SIZES = [50 + 10 * i for i in range(NUM_SPARSE)]


def concat(batches):
    return (
        torch.cat([b.dense_features for b in batches]),
        torch.cat([b.sparse_features.values().view(NUM_SPARSE, -1) for b in batches], dim=1),
        torch.cat([b.labels for b in batches]),
    )


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_synthetic_ranks_partition_the_global_batch(world_size):
    source = SyntheticCriteo(SIZES, global_batch_size=12, num_batches=3, seed=5)
    dense, ids, labels = source.global_batch(1)
    ranks = [next(source.iter_rank_batches(1, r, world_size)) for r in range(world_size)]
    got_dense, got_ids, got_labels = concat(ranks)
    assert torch.equal(got_dense, dense) and torch.equal(got_labels, labels)
    assert torch.equal(got_ids, ids.t())
    assert ranks[0].sparse_features.keys() == [f"cat_{i}" for i in range(NUM_SPARSE)]


def test_synthetic_is_deterministic_skewed_and_learnable():
    a = SyntheticCriteo(SIZES, 4096, 2, seed=1).global_batch(0)
    b = SyntheticCriteo(SIZES, 4096, 2, seed=1).global_batch(0)
    c = SyntheticCriteo(SIZES, 4096, 2, seed=2).global_batch(0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[1], c[1])
    ids = a[1]
    assert ((ids >= 0) & (ids < torch.tensor(SIZES))).all()
    # Power law: the lowest 10% of ids of a table get far more than 10% of lookups.
    assert (ids[:, 0] < SIZES[0] // 10).float().mean() > 0.2
    assert 0.2 < a[2].mean() < 0.8


def test_bad_world_size_and_sizes():
    with pytest.raises(ValueError, match="global_batch_size=10 is not divisible by the world size 3"):
        ResumableLoader(SyntheticCriteo(SIZES, 10, 1), rank=0, world_size=3)
    with pytest.raises(ValueError, match="has 2 entries; Criteo has 26"):
        SyntheticCriteo([1, 2], 8, 1)


def write_tsv(path, rows):
    path.write_text("".join("\t".join(r) + "\n" for r in rows))


def criteo_row(label, i):
    dense = [str(i), "", str(-3)] + [str(7 * i)] * 10
    sparse = [format(1000 + i, "x"), ""] + [format(i * 31 + k, "08x") for k in range(24)]
    return [str(label)] + dense + sparse


def test_criteo_tsv_reader(tmp_path):
    rows = [criteo_row(i % 2, i) for i in range(10)]
    write_tsv(tmp_path / "day_0.tsv", rows[:7])
    write_tsv(tmp_path / "day_1.tsv", rows[7:])
    source = CriteoTSV([tmp_path / "day_0.tsv", tmp_path / "day_1.tsv"], SIZES, global_batch_size=4)
    assert len(source) == 2  # 10 lines -> 2 full batches of 4
    batches = list(source.iter_rank_batches(0, rank=1, world_size=2))
    assert len(batches) == 2
    second = batches[1]  # global batch 1 = lines 4..7, rank 1 holds lines 6 and 7
    assert second.labels.tolist() == [0.0, 1.0]
    assert second.dense_features[0, :3].tolist() == pytest.approx([math.log1p(6), 0.0, 0.0])
    ids = second.sparse_features.values().view(NUM_SPARSE, -1)
    assert ids[0].tolist() == [(1000 + 6) % SIZES[0], (1000 + 7) % SIZES[0]]
    assert ids[1].tolist() == [0, 0]
    resumed = next(source.iter_rank_batches(1, rank=1, world_size=2))
    assert torch.equal(resumed.labels, second.labels)


def test_criteo_tsv_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.criteo_paths"):
        CriteoTSV([tmp_path / "missing.tsv"], SIZES, 4)
    (tmp_path / "bad.tsv").write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match="malformed Criteo line with 3 fields"):
        next(CriteoTSV([tmp_path / "bad.tsv"], SIZES, 1).iter_rank_batches(0, 0, 1))


def test_resumable_loader_restarts_at_saved_position():
    loader = ResumableLoader(SyntheticCriteo(SIZES, 8, 5, seed=3), rank=0, world_size=2)
    it = iter(loader)
    seen = [next(it) for _ in range(3)]
    state = loader.state_dict()
    assert state == {"next_batch": 3}
    fresh = ResumableLoader(SyntheticCriteo(SIZES, 8, 5, seed=3), rank=1, world_size=2)
    fresh.load_state_dict(state)
    rest = list(fresh)
    assert len(rest) == 2
    expected = SyntheticCriteo(SIZES, 8, 5, seed=3).global_batch(3)[2][4:]
    assert torch.equal(rest[0].labels, expected)
    assert len(list(fresh)) == 5, "the next epoch starts from the beginning"
    assert seen[0].labels.shape == (4,)
