"""EvalLoader and PredictionWriter's merge, in process: every sample exactly once, in input order, at any world size;
the same number of equally sized batches on every rank (a sharded model runs collectives in every forward)."""

import sys

import numpy as np
import pytest

from lightning_dlrover.checkpoint.directory import check_path
from lightning_dlrover.data import EvalLoader, SyntheticCriteo
from lightning_dlrover.models.predictions import RECORD, PredictionWriter, merge


@pytest.mark.parametrize(("samples", "world_size", "global_batch"), [(301, 1, 24), (301, 2, 24), (301, 3, 24),
                                                                   (5, 3, 6), (2, 3, 3), (512, 2, 8)])
def test_every_sample_once_in_order_equal_batches(samples, world_size, global_batch):
    source = SyntheticCriteo([50] * 26, samples, seed=1)
    dense, ids, labels = source.rows(0, samples)
    loaders = [EvalLoader(source, rank, world_size, global_batch) for rank in range(world_size)]
    seen = []
    for loader in loaders:
        batches = list(loader)
        assert len(batches) == len(loaders[0]) == len(list(loaders[0]))
        for batch in batches:
            assert batch.index.shape == (global_batch // world_size,)
            valid = batch.valid
            rows = batch.index[valid]
            assert (batch.dense_features[valid] == dense[rows]).all() and (batch.labels[valid] == labels[rows]).all()
            seen += rows.tolist()
    assert seen == list(range(samples))


def _part(path, index, probability):
    records = np.empty(len(index), RECORD)
    records["index"], records["probability"], records["label"] = index, probability, 1.0
    records.tofile(path)
    return path


def test_merge_orders_interleaved_parts_and_drops_repeats(tmp_path):
    """Parts as a DistributedSampler leaves them (ranks interleaved, the last sample repeated to even them out)."""
    parts = [_part(tmp_path / "0", [0, 2, 4], [0.0, 0.2, 0.4]), _part(tmp_path / "1", [1, 3, 0], [0.1, 0.3, 0.0])]
    assert merge(parts, tmp_path / "out.csv", "csv", with_label=False) == 5
    lines = (tmp_path / "out.csv").read_text().splitlines()
    assert lines[0] == "index,probability" and [line.split(",")[0] for line in lines[1:]] == ["0", "1", "2", "3", "4"]
    assert float(lines[4].split(",")[1]) == np.float32(0.3)


def test_parquet_without_pyarrow_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install pyarrow"):
        PredictionWriter("predictions.parquet")
    with pytest.raises(ImportError, match=r"pip install pyarrow"):
        PredictionWriter(format="parquet")
    assert PredictionWriter("predictions.csv").format == "csv"


def test_check_path_says_what_was_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*nope \(no such file or directory\); a "
                                                 r"DLRoverStrategy checkpoint is a directory holding meta.pt"):
        check_path(tmp_path / "nope")
    (tmp_path / "last.ckpt").mkdir()
    (tmp_path / "last.ckpt" / "meta.pt").write_bytes(b"")
    (tmp_path / "last.ckpt" / "dlrover.json").write_text("{}")
    assert check_path(tmp_path / "last.ckpt") == tmp_path / "last.ckpt"
    with pytest.raises(FileNotFoundError, match="is inside the checkpoint .*last.ckpt: pass the checkpoint directory"):
        check_path(tmp_path / "last.ckpt" / "dlrover.json")


def test_merge_writes_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    parts = [_part(tmp_path / "0", [0, 1], [0.25, 0.5]), _part(tmp_path / "1", [2], [0.75])]
    assert merge(parts, tmp_path / "out.parquet", "parquet", with_label=True) == 3
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column_names == ["index", "probability", "label"]
    assert table.column("index").to_pylist() == [0, 1, 2]
    assert table.column("probability").to_pylist() == [0.25, 0.5, 0.75]
