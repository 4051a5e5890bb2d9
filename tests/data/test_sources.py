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
    source = SyntheticCriteo(SIZES, num_samples=36, seed=5)
    dense, ids, labels = source.rows(12, 24)
    ranks = []
    for rank in range(world_size):
        loader = ResumableLoader(source, rank, world_size, global_batch_size=12)
        loader.load_state_dict({"next_sample": 12})
        ranks.append(next(iter(loader)))
    got_dense, got_ids, got_labels = concat(ranks)
    assert torch.equal(got_dense, dense) and torch.equal(got_labels, labels)
    assert torch.equal(got_ids, ids.t())
    assert ranks[0].sparse_features.keys() == [f"cat_{i}" for i in range(NUM_SPARSE)]


def test_synthetic_rows_do_not_depend_on_how_they_are_read():
    source = SyntheticCriteo(SIZES, num_samples=3000, seed=4)
    whole = source.rows(0, 3000)
    pieces = [source.rows(a, b) for a, b in [(0, 7), (7, 511), (511, 513), (513, 2000), (2000, 3000)]]
    for part, full in zip(zip(*pieces), whole):
        assert torch.equal(torch.cat(part), full)
    assert [t.shape[0] for t in source.rows(5, 5)] == [0, 0, 0]
    with pytest.raises(IndexError, match=r"samples \[2990, 3010\) are outside the source's \[0, 3000\)"):
        source.rows(2990, 3010)


def test_synthetic_is_deterministic_skewed_and_learnable():
    a = SyntheticCriteo(SIZES, 4096, seed=1).rows(0, 4096)
    b = SyntheticCriteo(SIZES, 4096, seed=1).rows(0, 4096)
    c = SyntheticCriteo(SIZES, 4096, seed=2).rows(0, 4096)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[1], c[1])
    ids = a[1]
    assert ((ids >= 0) & (ids < torch.tensor(SIZES))).all()
    # Power law: the lowest 10% of ids of a table get far more than 10% of lookups.
    assert (ids[:, 0] < SIZES[0] // 10).float().mean() > 0.2
    assert 0.2 < a[2].mean() < 0.8


def test_bad_world_size_and_sizes():
    with pytest.raises(ValueError, match="global_batch_size=10 is not divisible by the world size 3"):
        iter(ResumableLoader(SyntheticCriteo(SIZES, 10), rank=0, world_size=3, global_batch_size=10)).__next__()
    with pytest.raises(ValueError, match="has 2 entries; Criteo has 26"):
        SyntheticCriteo([1, 2], 8)


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
    source = CriteoTSV([tmp_path / "day_0.tsv", tmp_path / "day_1.tsv"], SIZES)
    assert len(source) == 10
    loader = ResumableLoader(source, rank=1, world_size=2, global_batch_size=4)
    batches = list(loader)
    assert len(batches) == 2 == len(loader)  # 10 lines -> 2 full batches of 4
    second = batches[1]  # global batch 1 = lines 4..7 (across both files), rank 1 holds lines 6 and 7
    assert second.labels.tolist() == [0.0, 1.0]
    assert second.dense_features[0, :3].tolist() == pytest.approx([math.log1p(6), 0.0, 0.0])
    ids = second.sparse_features.values().view(NUM_SPARSE, -1)
    assert ids[0].tolist() == [(1000 + 6) % SIZES[0], (1000 + 7) % SIZES[0]]
    assert ids[1].tolist() == [0, 0]
    resumed = ResumableLoader(source, rank=1, world_size=2, global_batch_size=4)
    resumed.load_state_dict({"next_sample": 4})
    assert torch.equal(next(iter(resumed)).labels, second.labels)
    assert torch.equal(source.rows(3, 9)[2], torch.tensor([r[0] == "1" for r in rows[3:9]]).float())


def test_criteo_tsv_errors_name_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.criteo_paths"):
        CriteoTSV([tmp_path / "missing.tsv"], SIZES)
    good = "\t".join(criteo_row(1, 3)) + "\n"
    (tmp_path / "bad.tsv").write_text(good + "1\t2\t3\n")
    with pytest.raises(ValueError, match=r"bad.tsv:2: malformed Criteo line \(3 fields, expected 40\)"):
        CriteoTSV([tmp_path / "bad.tsv"], SIZES).rows(0, 2)
    (tmp_path / "hex.tsv").write_text(good.replace(format(1003, "x"), "zz"))
    with pytest.raises(ValueError, match=r"hex.tsv:1: malformed Criteo line \(categorical id C1 is not hex"):
        CriteoTSV([tmp_path / "hex.tsv"], SIZES).rows(0, 1)


def test_resumable_loader_restarts_at_saved_position():
    loader = ResumableLoader(SyntheticCriteo(SIZES, 40, seed=3), rank=0, world_size=2, global_batch_size=8)
    it = iter(loader)
    seen = [next(it) for _ in range(3)]
    state = loader.state_dict()
    assert state == {"next_sample": 24, "global_batch_size": 8}
    fresh = ResumableLoader(SyntheticCriteo(SIZES, 40, seed=3), rank=1, world_size=2, global_batch_size=8)
    fresh.load_state_dict(state)
    rest = list(fresh)
    assert len(rest) == 2
    expected = SyntheticCriteo(SIZES, 40, seed=3).rows(24, 32)[2][4:]
    assert torch.equal(rest[0].labels, expected)
    assert len(list(fresh)) == 5, "the next epoch starts from the beginning"
    assert seen[0].labels.shape == (4,)
    legacy = ResumableLoader(SyntheticCriteo(SIZES, 40, seed=3), rank=1, world_size=2, global_batch_size=8)
    legacy.load_state_dict({"next_batch": 3})
    assert torch.equal(next(iter(legacy)).labels, expected)


def test_global_batch_size_can_change_between_steps_without_losing_a_sample():
    source = SyntheticCriteo(SIZES, 64, seed=6)
    loader = ResumableLoader(source, rank=0, world_size=1, global_batch_size=8)
    labels = []
    for step, batch in enumerate(loader):
        labels.append(batch.labels)
        if step == 1:
            loader.global_batch_size = 16
    assert [len(x) for x in labels] == [8, 8, 16, 16, 16]
    assert torch.equal(torch.cat(labels), source.rows(0, 64)[2])


def test_validation_stream_has_other_samples_but_the_same_labelling():
    train = SyntheticCriteo(SIZES, 4096, seed=3)
    val = SyntheticCriteo(SIZES, 4096, seed=4, label_seed=3)
    assert not torch.equal(train.rows(0, 64)[1], val.rows(0, 64)[1])
    assert torch.equal(train._dense_weight, val._dense_weight) and torch.equal(train._id_salt, val._id_salt)
