"""ElasticBatchScaler: arguments, and in real multi-process jobs the batch, LRs and samples across a grow."""

import json
import math
from collections import Counter

import pytest

from lightning_dlrover import ElasticBatchScaler
from tests.conftest import REPO, run

SCRIPT = REPO / "tests" / "elastic" / "elastic_job.py"


def test_bad_arguments_rejected():
    with pytest.raises(ValueError, match="min > max"):
        ElasticBatchScaler(512, 256)
    with pytest.raises(ValueError, match="policy='biggest'"):
        ElasticBatchScaler(64, 256, policy="biggest")
    with pytest.raises(ValueError, match="lr_rule='cubic'"):
        ElasticBatchScaler(64, 256, lr_rule="cubic")


def _job(tmp_path, *args):
    proc = run([SCRIPT, "--log", tmp_path / "samples", *args], tmp_path, timeout=400)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("scaler: "))
    return json.loads(line[len("scaler: "):])


@pytest.mark.slow
def test_grow_keep_per_rank_rescales_batch_and_lr_and_loses_no_sample(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _job(tmp_path, "--devices", "2", "--steps", "4", "--batch", "64", "--ckpt-dir", ckpt, "--ckpt-every", "4")
    assert first["world_size"] == 2 and first["global_batch"] == 64
    grown = _job(tmp_path, "--devices", "3", "--steps", "8", "--resume", ckpt / "epoch=0-step=4.ckpt")
    assert grown["world_size"] == 3 and grown["global_batch"] == 96  # 32 per rank kept
    factor = math.sqrt(96 / 64)
    assert grown["lrs"] == pytest.approx(sorted({round(0.05 * factor, 8)}))  # dense and fused embedding rates
    assert grown["history"][0]["reason"] == "world_size_changed"
    seen = Counter()
    for rank in range(3):
        path = tmp_path / f"samples.rank{rank}"
        for line in path.read_text().splitlines():
            seen.update(json.loads(line)["samples"])
    assert sum(seen.values()) == 4 * 64 + 4 * 96  # every step trained the global batch of its world size
    assert max(seen.values()) == 1  # no sample repeated across the batch change
