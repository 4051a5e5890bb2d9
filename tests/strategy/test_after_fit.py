"""After fit: ``test`` reports log loss, AUC, calibration and NE over the whole test set at any world size, and
``predict`` writes one prediction per sample, in input order, exactly once, at any world size (issue #21)."""

import json
import math
import re
import sys

import numpy as np
import pytest
import torch
import yaml
from torchmetrics.functional.classification import binary_auroc

from lightning_dlrover.data.generate import GeneratorConfig, write_day_file
from tests.conftest import REPO, forked, run, together

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "scripts" / "after_fit.py"
SAMPLES = 301  # not a multiple of any batch: every rank's last batch is padded, slices differ by one at 2 and 3 ranks
METRICS = re.compile(r"^test metrics: (\{.*\})$", re.MULTILINE)
sys.path.insert(0, str(SCRIPT.parent))
from after_fit import SIZES  # noqa: E402


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A held-out TSV day of 301 samples; a 2-rank fit of 4 steps saving a checkpoint, then its test metrics and
    predictions (same process, same ranks)."""
    tmp = tmp_path_factory.mktemp("after-fit")
    tsv = tmp / "day_1.tsv"
    write_day_file(tsv, SAMPLES, GeneratorConfig(max_vocab=1000, seed=5))
    out = run(forked(SCRIPT, "--devices", "2", "--fit-steps", "4", "--ckpt", tmp / "ckpt", "--tsv", tsv,
                     "--out", tmp / "p2.csv"), tmp).stdout
    return tmp, tsv, json.loads(METRICS.search(out).group(1))


def _cli(tmp, tsv, *args):
    config = {
        "seed_everything": 3,
        "trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
                    "default_root_dir": str(tmp / "cli"), "enable_model_summary": False,
                    "strategy": {"class_path": "lightning_dlrover.DLRoverStrategy",
                                 "init_args": {"sharding_types": ["table_wise"]}}},
        "model": {"num_embeddings_per_feature": SIZES, "embedding_dim": 8, "dense_arch_layer_sizes": [16, 8],
                  "over_arch_layer_sizes": [16, 1]},
        "data": {"global_batch_size": 24, "seed": 3, "test_criteo_paths": [str(tsv)]},
    }
    (tmp / "cli.yaml").write_text(yaml.safe_dump(config))
    return run(["-m", "lightning_dlrover", args[0], "--config", tmp / "cli.yaml", *args[1:]], tmp, check=False)


def _predictions(path):
    table = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
    assert path.read_text().splitlines()[0] == "index,probability,label"
    return table[:, 0].astype(np.int64), table[:, 1], table[:, 2]


def _single_process_metrics(probability, label):
    p, y = torch.tensor(probability, dtype=torch.float64), torch.tensor(label, dtype=torch.float64)
    loss = torch.nn.functional.binary_cross_entropy(p, y).item()
    ctr = y.mean().item()
    entropy = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
    return {"test/loss": loss, "test/auc": binary_auroc(p.float(), y.long()).item(),
            "test/calibration": p.mean().item() / ctr, "test/ne": loss / entropy}


def test_test_and_predict_at_1_2_3_ranks(fitted):
    """The CLI's ``predict`` at 1 rank, and the strategy's at 2 and 3 ranks, write every sample of the day exactly once
    in file order with its label; the probabilities agree (to 1e-6: the dense MLP's float32 matmuls see other per-rank
    batch shapes, so a few differ in the last bit). ``test`` at 1 (CLI), 2 and 3 ranks reports the log loss, AUC,
    calibration and NE a single process computes from the 1-rank predictions of the same samples."""
    tmp, tsv, metrics2 = fitted
    # three independent jobs reading the checkpoint, at once (the CLI's each in a directory of its own)
    (tmp / "predict").mkdir()
    (tmp / "test").mkdir()
    out3, predicted, tested = together(
        lambda: run(forked(SCRIPT, "--devices", "3", "--ckpt", tmp / "ckpt", "--tsv", tsv, "--out", tmp / "p3.csv"),
                    tmp).stdout,
        lambda: _cli(tmp / "predict", tsv, "predict", "--ckpt_path", tmp / "ckpt", "--predictions.out", tmp / "p1.csv"),
        lambda: _cli(tmp / "test", tsv, "test", "--ckpt_path", tmp / "ckpt"))
    metrics3 = json.loads(METRICS.search(out3).group(1))
    assert predicted.returncode == 0, predicted.stdout[-3000:]
    assert tested.returncode == 0, tested.stdout[-3000:]
    metrics1 = {name: float(value) for name, value in re.findall(r"^\s*(test/\w+)\s+([-0-9.eE+]+)\s*$",
                                                                    tested.stdout, re.MULTILINE)}
    labels = np.array([float(line.split(b"\t")[0]) for line in tsv.read_bytes().splitlines()])

    index1, probability1, label1 = _predictions(tmp / "p1.csv")
    assert index1.tolist() == list(range(SAMPLES))
    assert (label1 == labels).all()
    for name in ("p2.csv", "p3.csv"):
        index, probability, label = _predictions(tmp / name)
        assert index.tolist() == list(range(SAMPLES)), f"{name}: every sample once, in input order"
        assert (label == labels).all()
        np.testing.assert_allclose(probability, probability1, rtol=0, atol=1e-6, err_msg=name)

    expected = _single_process_metrics(probability1, label1)
    for ranks, metrics in ((1, metrics1), (2, metrics2), (3, metrics3)):
        assert set(metrics) == set(expected), f"{ranks} rank(s): {metrics}"
        for name, value in expected.items():
            assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{ranks} rank(s): {name}"


def test_bad_ckpt_path_is_one_line_naming_the_directory(fitted):
    """``--ckpt_path`` at a file inside the checkpoint directory: one line on stderr naming the directory to pass,
    before any rank starts (no traceback, exit status 2)."""
    tmp, tsv, _ = fitted
    proc = _cli(tmp, tsv, "predict", "--ckpt_path", tmp / "ckpt" / "dlrover.json")
    assert proc.returncode == 2
    assert f"is inside the checkpoint {tmp / 'ckpt'}: pass the checkpoint directory itself" in proc.stdout
    assert "Traceback" not in proc.stdout and "Restoring states" not in proc.stdout


def test_a_users_own_model_predicts_every_sample_once(tmp_path):
    """The user's model (an EmbeddingCollection with SGD, BatchNorm and Dropout in eval mode, its own DataLoader whose
    padding repeats samples) fitted on 2 ranks predicts each of its 101 samples once, in order, from its checkpoint
    at 3 ranks and at 1 rank, with the same probabilities (to 1e-6; bit-equal when measured)."""
    script = REPO / "tests" / "scripts" / "user_model_predict.py"
    run(forked(script, "--devices", "2", "--fit-steps", "3", "--root", tmp_path, "--out", tmp_path / "fit.csv"),
        tmp_path)
    together(lambda: run(forked(script, "--devices", "3", "--root", tmp_path, "--out", tmp_path / "p3.csv"), tmp_path),
             lambda: run([script, "--devices", "1", "--root", tmp_path, "--out", tmp_path / "p1.csv"], tmp_path))
    index3, probability3, _ = _predictions(tmp_path / "p3.csv")
    index1, probability1, _ = _predictions(tmp_path / "p1.csv")
    assert index3.tolist() == index1.tolist() == _predictions(tmp_path / "fit.csv")[0].tolist() == list(range(101))
    assert len(np.unique(probability1)) > 50, "the model's output depends on its inputs"
    np.testing.assert_allclose(probability3, probability1, rtol=0, atol=1e-6)
