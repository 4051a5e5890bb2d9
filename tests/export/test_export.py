"""Export of a strategy checkpoint for serving, and import of the export into a fit: real multi-process fits (gloo,
CPU), the artefact loaded in fresh processes that cannot import this package (and, for the ``torch.export``
program, neither TorchRec nor FBGEMM), predictions compared bit for bit with the sharded model's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, forked, run

pytestmark = pytest.mark.slow

JOB = REPO / "tests" / "scripts" / "export_job.py"

#: The server: torch only (importing this package, TorchRec or FBGEMM fails), the program on each rank's samples,
#: with the rank's intra-op thread count (a GEMM's float sums depend on how its reduction is split over threads).
SERVE = """
import sys, torch
for name in ("lightning_dlrover", "torchrec", "fbgemm_gpu"):
    sys.modules[name] = None
program = torch.export.load(sys.argv[1] + "/model.pt2").module()
for path in sys.argv[2:]:
    s = torch.load(path, weights_only=True)
    torch.set_num_threads(int(s["threads"]))
    with torch.inference_mode():
        out = program(s["dense"], s["values"], s["lengths"])
    print(path, "equal" if torch.equal(out, s["logits"]) else f"DIFFERS {(out - s['logits']).abs().max().item()}")
"""

#: A TorchRec user's path: the unsharded DLRM rebuilt from config.json, model.pt loaded into it (no lightning_dlrover).
STATE_DICT_DLRM = """
import json, sys, torch
sys.modules["lightning_dlrover"] = None
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM
config = json.load(open(sys.argv[1] + "/config.json"))
hp = config["hparams"]
tables = [EmbeddingBagConfig(name=name, embedding_dim=t["dim"], num_embeddings=t["rows"], feature_names=t["features"])
          for name, t in config["tables"].items()]
model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
             dense_in_features=13, dense_arch_layer_sizes=hp["dense_arch_layer_sizes"],
             over_arch_layer_sizes=hp["over_arch_layer_sizes"])
state = torch.load(sys.argv[1] + "/model.pt", weights_only=True)
model.load_state_dict({k.removeprefix("dlrm."): v for k, v in state.items()}, assign=True)
model.eval()
features = [f for t in config["tables"].values() for f in t["features"]]
for path in sys.argv[2:]:
    s = torch.load(path, weights_only=True)
    torch.set_num_threads(int(s["threads"]))
    with torch.inference_mode():
        out = model(s["dense"], KeyedJaggedTensor(keys=features, values=s["values"], lengths=s["lengths"])).squeeze(-1)
    print(path, "equal" if torch.equal(out, s["logits"]) else f"DIFFERS {(out - s['logits']).abs().max().item()}")
"""


def plain_python(code: str, *args: Path, cwd: Path) -> str:
    """Runs ``code`` in a fresh interpreter without this repository on ``PYTHONPATH``; returns its output."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def job(tmp: Path, *args: str) -> Path:
    """Runs tests/scripts/export_job.py; returns its predictions directory."""
    preds = tmp / "preds"
    run(forked(JOB, "--preds", preds, *args), tmp, timeout=240)
    return preds


def assert_all_equal(output: str, ranks: int) -> None:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == ranks and all(line.endswith(" equal") for line in lines), output


@pytest.fixture(scope="module")
def dlrm_export(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(checkpoint, predictions, export) of our DLRM fitted at 2 ranks, table-wise, exported by the command line."""
    tmp = tmp_path_factory.mktemp("dlrm")
    preds = job(tmp, "--devices", "2", "--model", "dlrm", "--sharding-types", "table_wise", "--ckpt", str(tmp / "ckpt"))
    out = run(["-m", "lightning_dlrover", "export", "--ckpt_path", tmp / "ckpt", "--out", tmp / "export"], tmp)
    assert "exported" in out.stdout
    return tmp / "ckpt", preds, tmp / "export"


def test_dlrm_of_2_ranks_exports_to_a_program_and_a_state_dict_that_predict_as_the_sharded_model(dlrm_export):
    ckpt, preds, export = dlrm_export
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "model.pt", "model.pt2"]
    ranks = sorted(preds.glob("rank*.pt"))
    assert_all_equal(plain_python(SERVE, export, *ranks, cwd=export.parent), 2)
    assert_all_equal(plain_python(STATE_DICT_DLRM, export, *ranks, cwd=export.parent), 2)


def test_own_model_of_3_ranks_with_a_shared_table_exports_and_predicts_as_the_sharded_model(tmp_path):
    """An EmbeddingCollection whose table serves two features, column-wise at 3 ranks; exported by the function."""
    from lightning_dlrover.export import export_checkpoint

    preds = job(tmp_path, "--devices", "3", "--model", "shared", "--sharding-types", "column_wise",
                "--ckpt", str(tmp_path / "ckpt"))
    export = export_checkpoint(tmp_path / "ckpt", tmp_path / "export")
    assert_all_equal(plain_python(SERVE, export, *sorted(preds.glob("rank*.pt")), cwd=tmp_path), 3)


def test_import_shards_an_export_of_2_ranks_onto_3_ranks_and_predicts_as_the_exported_model(tmp_path, dlrm_export):
    """``DLRoverStrategy(init_from=export)`` at 3 ranks, column-wise (the export came from 2 ranks, table-wise): the
    first forward's predictions are the exported program's."""
    _, _, export = dlrm_export
    preds = job(tmp_path, "--devices", "3", "--model", "dlrm", "--sharding-types", "column_wise", "--steps", "0",
                "--init-from", str(export))
    assert_all_equal(plain_python(SERVE, export, *sorted(preds.glob("rank*.pt")), cwd=tmp_path), 3)


def test_bad_input_is_named_with_what_was_expected(tmp_path, dlrm_export):
    from lightning_dlrover.checkpoint.plain import load_plain_into
    from lightning_dlrover.export import BadCheckpoint, CheckpointFileError, export_checkpoint
    from lightning_dlrover.strategy import DLRoverStrategy
    from tests.scripts.export_models import WiderDLRM

    ckpt, _, export = dlrm_export
    # the command line, given a file inside the checkpoint: one line, exit status 2, no traceback
    proc = run(["-m", "lightning_dlrover", "export", "--ckpt_path", ckpt / "dlrover.json", "--out", tmp_path / "x"],
               tmp_path, check=False)
    assert proc.returncode == 2, proc.stdout
    assert f"is a file inside the strategy checkpoint {ckpt}: pass the directory {ckpt}" in proc.stdout
    assert "Traceback" not in proc.stdout
    with pytest.raises(BadCheckpoint, match="inside the export .*: pass the directory"):
        DLRoverStrategy(init_from=export / "config.json")
    # a truncated shard file, a missing one: named
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    shard = broken / "sharded" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointFileError, match=rf"{shard} is truncated: 1000 bytes"):
        export_checkpoint(broken, tmp_path / "out1")
    shard.unlink()
    with pytest.raises(CheckpointFileError, match=rf"{shard} is missing"):
        export_checkpoint(broken, tmp_path / "out2")
    # a checkpoint of the other backend, a path that is not there
    snapshot = tmp_path / "snapshot"
    shutil.copytree(ckpt, snapshot)
    (snapshot / "dlrover.json").write_text((ckpt / "dlrover.json").read_text().replace('"dcp"', '"torchsnapshot"'))
    with pytest.raises(BadCheckpoint, match="written by the 'torchsnapshot' checkpoint backend; export reads 'dcp'"):
        export_checkpoint(snapshot, tmp_path / "out4")
    with pytest.raises(BadCheckpoint, match="does not exist; expected a strategy checkpoint directory"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "out5")
    # another model config (export: the class named; import: the model given): the table and both shapes
    other = r"another model config: table 't_cat_3': .* has shape \[61, 8\] there, \[161, 8\] in "
    with pytest.raises(BadCheckpoint, match=other):
        export_checkpoint(ckpt, tmp_path / "out3", module_class="tests.scripts.export_models.WiderDLRM")
    sizes = [40 + 7 * i for i in range(26)]
    with pytest.raises(BadCheckpoint, match=other):
        load_plain_into(WiderDLRM(sizes, embedding_dim=8, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1]),
                        export)
    assert not any((tmp_path / f"out{i}").exists() for i in (1, 2, 3, 4, 5)), "nothing written for a bad checkpoint"


def test_save_program_writes_the_file_torch_export_save_writes(tmp_path):
    """``save_program`` writes each weight from its own memory; the archive is byte for byte ``torch.export.save``'s and
    loads to the same outputs."""
    import torch

    from lightning_dlrover.export.program import save_program

    class Lookup(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(1000, 16))
            self.bias = torch.nn.Parameter(torch.randn(16))
            self.register_buffer("empty", torch.empty(0))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.table[ids] + self.bias + self.empty.sum()

    module, ids = Lookup(), torch.tensor([3, 999, 0])
    program = torch.export.export(module, (ids,))
    (tmp_path / "ours").mkdir(), (tmp_path / "torch").mkdir()  # the archive's records are named after its file
    save_program(program, tmp_path / "ours" / "model.pt2")
    torch.export.save(program, tmp_path / "torch" / "model.pt2")
    assert (tmp_path / "ours" / "model.pt2").read_bytes() == (tmp_path / "torch" / "model.pt2").read_bytes()
    assert torch.equal(torch.export.load(tmp_path / "ours" / "model.pt2").module()(ids), module(ids))


#: The quantised module of an export (this package's loader), on each rank's samples: the largest logit difference.
SERVE_INT8 = """
import sys, torch
from torchrec import KeyedJaggedTensor
from lightning_dlrover.export import load_quantized
module = load_quantized(sys.argv[1])
features = [f for t in __import__("json").load(open(sys.argv[1] + "/config.json"))["tables"].values()
            for f in t["features"]]
for path in sys.argv[2:]:
    s = torch.load(path, weights_only=True)
    with torch.inference_mode():
        out = module.export_forward(s["dense"], KeyedJaggedTensor(keys=features, values=s["values"],
                                                                  lengths=s["lengths"])).squeeze(-1)
    print(path, (out - s["logits"]).abs().max().item(), s["logits"].abs().max().item())
"""


def test_int8_export_predicts_within_its_quantisation_error_in_half_the_bytes(tmp_path, dlrm_export):
    """``--quantize int8``: row-wise int8 tables (TorchRec's inference quantisation) beside the fp32 artefact; the
    loaded module's logits stay within the quantisation error of the sharded model's (measured: 4e-4 of logits up to
    0.15). Rows of dim 8 take 8 code bytes and 4 of scale and bias, padded to 16: half of fp32's 32."""
    import torch

    ckpt, preds, _ = dlrm_export
    out = run(["-m", "lightning_dlrover", "export", "--ckpt_path", ckpt, "--out", tmp_path / "int8", "--no-program",
               "--quantize", "int8"], tmp_path)
    assert "exported" in out.stdout
    export = tmp_path / "int8"
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "model.pt", "model_int8.pt"]
    fp32, int8 = (torch.load(export / name, weights_only=True) for name in ("model.pt", "model_int8.pt"))
    tables = [k for k in fp32 if "embedding_bags" in k]
    assert tables and all(int8[k].dtype == torch.uint8 for k in tables)
    table_bytes = {name: sum(s[k].numel() * s[k].element_size() for k in tables) for name, s in (("fp32", fp32),
                                                                                                 ("int8", int8))}
    assert table_bytes["int8"] <= table_bytes["fp32"] / 2, table_bytes
    lines = plain_python(SERVE_INT8, export, *sorted(preds.glob("rank*.pt")), cwd=tmp_path).splitlines()
    assert len(lines) == 2 and all(float(line.split()[1]) < 1e-2 for line in lines), lines
