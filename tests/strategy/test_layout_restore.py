"""Checkpoints restore across column layouts: a table saved table-wise restores into a column-wise plan (4 column
shards per table) and back, and a column-wise one into table-wise, for full checkpoints and incremental chains, in
real 2-rank jobs. Row-wise Adagrad keeps one momentum per row and column shard (``k * rows`` values), which the
backend alone cannot restore into another number of column shards (``Size mismatch``); see
:mod:`lightning_dlrover.checkpoint.layout` for the conversion and what is exact.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dlrover.checkpoint.stream import DCPReader
from tests.conftest import digests, train_forked

pytestmark = pytest.mark.slow
COLUMN_WISE = ["--sharding-types", "column_wise", "--min-partition", "4"]  # 16 columns: 4 shards of 4 per table
TABLE = "dlrm.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight"
MOMENTUM = f"fused_optimizer.{TABLE}.t_cat_0.momentum1"


def read(checkpoint, fqn: str) -> torch.Tensor:
    reader = DCPReader(checkpoint / "sharded")
    out = torch.empty(reader.shape(fqn), dtype=reader.dtype(fqn))
    reader.read_into(fqn, out)
    return out


def test_table_wise_chain_into_column_wise_and_back_is_exact(tmp_path):
    """A table-wise chain (full at step 2, delta at step 4) restores into the column-wise plan, which saves it again;
    that checkpoint restores into the table-wise plan with the digest of the table-wise run at step 4, and step 5
    ends as in that run."""
    first = digests(train_forked(tmp_path, "--steps", "5", "--ckpt-dir", str(tmp_path / "tw"), "--ckpt-every", "2",
                          "--incremental", "4", "--digest-every", "2").stdout)
    train_forked(tmp_path, "--steps", "4", *COLUMN_WISE, "--resume", str(tmp_path / "tw" / "epoch=0-step=4.ckpt"),
          "--save-after", str(tmp_path / "cw.ckpt"))
    assert read(tmp_path / "cw.ckpt", MOMENTUM).numel() == 4 * read(tmp_path / "cw.ckpt", f"model.{TABLE}").shape[0]
    back = digests(train_forked(tmp_path, "--steps", "5", "--resume", str(tmp_path / "cw.ckpt")).stdout)
    assert back["4"] == first["4"], "table-wise, column-wise and back: the state of step 4, bit for bit"
    assert back["end"] == first["end"]


def test_column_wise_into_table_wise_averages_the_momenta_by_columns(tmp_path):
    """A column-wise checkpoint of a trained model restores into the table-wise plan: the weights are the saved ones
    and each row's momentum is the mean of its 4 column shards' (the exact row-wise momentum of the whole row); the
    job trains on."""
    train_forked(tmp_path, "--steps", "4", *COLUMN_WISE, "--ckpt-dir", str(tmp_path / "cw"), "--ckpt-every", "4")
    saved = tmp_path / "cw" / "epoch=0-step=4.ckpt"
    train_forked(tmp_path, "--steps", "5", "--resume", str(saved), "--save-after", str(tmp_path / "tw.ckpt"))
    # the table-wise job trained one step (step 5) before it saved: compare the rows step 5 did not touch
    weight, momentum = read(tmp_path / "tw.ckpt", f"model.{TABLE}"), read(tmp_path / "tw.ckpt", MOMENTUM)
    saved_weight, saved_momentum = read(saved, f"model.{TABLE}"), read(saved, MOMENTUM)
    rows = weight.shape[0]
    expected = saved_momentum.view(4, rows).to(torch.float64).mean(0).to(momentum.dtype)
    untouched = (weight == saved_weight).all(1)
    assert untouched.sum() > rows // 2, "most rows are not looked up in one step"
    assert torch.equal(momentum[untouched], expected[untouched])
    assert not torch.equal(saved_momentum.view(4, rows)[0], saved_momentum.view(4, rows)[1]), \
        "the column shards' momenta differ: the mean is a real conversion"
