"""``export_checkpoint``: a strategy checkpoint (written at any world size and sharding) as an unsharded artefact a
plain Python process loads without this package or a process group.

The output directory holds ``model.pt`` (the unsharded module's ``state_dict``, plain tensors), ``config.json``
(the LightningModule's class path and hparams, the tables, the program's inputs, where it came from) and, unless
``program=False``, ``model.pt2`` (a ``torch.export`` program taking plain tensors: :mod:`.program`).

It streams: the module is built with its tables on the meta device and each table is read from the checkpoint's
shard files straight into its one unsharded tensor (:class:`~lightning_dlrover.checkpoint.stream.DCPReader`), so no
table is held twice while the checkpoint is read and ``model.pt`` written (measured: peak RSS = tables + 28 MiB at
1 GiB of tables). ``model.pt2`` is written the same way: ``torch.export.save`` alone copies each weight before
writing it (measured: + 1087 MiB at 1 GiB), :func:`~.program.save_program` writes each from its own memory.
``program=False`` (``--no-program``) leaves the program out.
"""

from __future__ import annotations

import importlib
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_dlrover import torchrec_glue
from lightning_dlrover.checkpoint import directory
from lightning_dlrover.checkpoint.plain import (
    CONFIG_FILE,
    MODEL_FILE,
    PROGRAM_FILE,
    BadCheckpoint,
    check_shapes,
    checkpoint_directory,
)
from lightning_dlrover.checkpoint.stream import DCPReader
from lightning_dlrover.export.program import ServingModule, example_inputs, export_program, save_program
from lightning_dlrover.export.quantized import QUANTIZE_DTYPES, QUANTIZED_FILE
from lightning_dlrover.export.quantized import quantize as quantize_tables
from lightning_dlrover.log import get_logger

log = get_logger(__name__)
#: ``meta.pt``'s entry naming the LightningModule's class (written by ``DLRoverStrategy.save_checkpoint``).
MODULE_CLASS_KEY = "dlrover_module_class"
FORMAT_VERSION = 1


def export_checkpoint(
    ckpt_path: str | Path,
    out: str | Path,
    *,
    module_class: str | None = None,
    dense_features: int | None = None,
    program: bool = True,
    quantize: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes the unsharded artefact of the strategy checkpoint ``ckpt_path`` into the directory ``out`` and returns
    it.

    Args:
        ckpt_path: a checkpoint directory ``DLRoverStrategy`` wrote (``.../last.ckpt``), dcp backend.
        out: the directory to write (created; it must not exist unless ``overwrite``).
        module_class: ``package.module.Class`` of the LightningModule, for checkpoints that do not name it
            (written before this option existed, or of a class defined in a script's ``__main__``).
        dense_features: dense features per sample of the program's input, when the module has no
            ``export_dense_features`` attribute.
        program: also write ``model.pt2`` (the ``torch.export`` program).
        quantize: ``"int8"``: also write ``model_int8.pt``, the module with row-wise int8 tables
            (:mod:`.quantized`; served through TorchRec).
        overwrite: replace ``out`` if it exists.

    Raises:
        BadCheckpoint: the path is no checkpoint directory (or a file in one), or the checkpoint is of another
            model config (naming the table and both shapes); ``CheckpointFileError``: a shard file is missing or
            truncated (naming it).
    """
    path, out = checkpoint_directory(ckpt_path), Path(out)
    info = directory.read_info(path)
    if info.get("backend", "dcp") != "dcp":
        raise BadCheckpoint(
            f"{path} was written by the {info['backend']!r} checkpoint backend; export reads 'dcp' checkpoints. Load "
            "it into a job with DLRoverStrategy(checkpoint_backend='dcp') (any backend loads) and save it again "
            "(Trainer.save_checkpoint), or train with the default backend."
        )
    if int((info.get("incremental") or {}).get("link", 0)):
        raise BadCheckpoint(
            f"{path} is a delta of an incremental checkpoint chain (link {info['incremental']['link']}): it holds only "
            "the embedding rows changed since the previous link. Export the chain's full checkpoint, or load this one "
            "into a job (DLRoverStrategy restores the chain) and save it with Trainer.save_checkpoint after a fit "
            "without incremental_checkpoint_every."
        )
    if quantize is not None and quantize not in QUANTIZE_DTYPES:
        raise ValueError(f"quantize={quantize!r} is not one of {sorted(QUANTIZE_DTYPES)}.")
    if out.exists() and not overwrite:
        raise BadCheckpoint(f"{out} exists; choose another --out or pass overwrite=True (--overwrite).")
    reader = DCPReader(path / directory.SHARDED_DIR)
    meta = directory.read_meta(path)
    class_path = module_class or meta.get(MODULE_CLASS_KEY)
    hparams = dict(meta.get("hyper_parameters") or {})
    # LightningCLI records how it built the module beside the arguments; Lightning's own loading drops these too
    class_path = class_path or hparams.get("_class_path")
    hparams = {k: v for k, v in hparams.items() if k not in ("_instantiator", "_class_path")}
    module = build_module(class_path, hparams, path)
    saved = {fqn.removeprefix("model."): reader.shape(fqn) for fqn in reader.tensors if fqn.startswith("model.")}
    check_shapes({k: tuple(v.shape) for k, v in module.state_dict().items()}, saved, path, class_path)
    reader.check_files("model.")

    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    load_streaming(module, reader)
    module.eval()
    torch.save(module.state_dict(), staging / MODEL_FILE)
    tables = torchrec_glue.embedding_tables(module)
    features = [feature for table in tables for feature in table.features]
    rows = {feature: table.rows for table in tables for feature in table.features}
    dense = dense_features if dense_features is not None else getattr(module, "export_dense_features", None)
    config: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "module_class": class_path,
        "hparams": hparams,
        "tables": {t.name: {"rows": t.rows, "dim": t.dim, "features": list(t.features), "pooling": t.pooling,
                            "kind": t.kind} for t in tables},
        "source": {"checkpoint": str(path.resolve()), "global_step": info.get("global_step"),
                   "world_size": info.get("world_size"), "backend": "dcp"},
        "files": {"state_dict": MODEL_FILE},
    }
    if program:
        if dense is None:
            raise BadCheckpoint(f"{type(module).__name__} does not say how many dense features a sample has: pass "
                                "dense_features=N (--dense-features N), or set `export_dense_features = N` on the "
                                "class; or leave the program out (program=False, --no-program).")
        serving = ServingModule(module, features)
        inputs = example_inputs(features, dense, rows)
        save_program(export_program(serving, inputs), staging / PROGRAM_FILE)
        config["files"]["program"] = PROGRAM_FILE
        config["program_inputs"] = {
            "dense": ["batch", dense, "float32"], "values": ["ids", "int64"], "lengths": ["len(features) * batch",
                                                                                        "int32"],
            "features": features,
        }
    if quantize is not None:  # last: it swaps the module's tables for int8 ones in place
        torch.save(quantize_tables(module, quantize).state_dict(), staging / QUANTIZED_FILE)
        config["files"]["quantized"] = QUANTIZED_FILE
        config["quantized"] = {"dtype": quantize, "scheme": "row-wise: int8 codes, an fp16 scale and bias per row "
                               "(torchrec.inference.modules.quantize_embeddings)"}
    (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str) + "\n")
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    staging.rename(out)
    return out


def build_module(class_path: str | None, hparams: Mapping[str, Any], path: Path) -> nn.Module:
    """The LightningModule ``class_path`` built from ``hparams`` (its tables on the meta device, as the strategy
    expects them); raises :class:`BadCheckpoint` saying what to pass when it cannot be."""
    if not class_path:
        raise BadCheckpoint(f"{path}/{directory.META_FILE} does not name the LightningModule's class (a checkpoint "
                            "written before export existed): pass module_class='package.module.Class' "
                            "(--module-class).")
    module_name, _, name = class_path.rpartition(".")
    if module_name == "__main__":
        raise BadCheckpoint(f"{path} was written by a LightningModule defined in a script ({class_path}), which "
                            "cannot be imported: pass module_class='package.module.Class' (--module-class).")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise BadCheckpoint(f"cannot import the LightningModule class {class_path!r} of {path} ({err}); make its "
                            "module importable (PYTHONPATH) or pass module_class= (--module-class).") from None
    try:
        return cls(**hparams)
    except (TypeError, ValueError) as err:
        raise BadCheckpoint(f"{class_path}(**hparams) failed with the checkpoint's hparams {dict(hparams)}: {err}. "
                            "A module whose __init__ takes arguments must call self.save_hyperparameters().") from None


def load_streaming(module: nn.Module, reader: DCPReader) -> None:
    """Fills ``module`` from the checkpoint: dense tensors in place, each meta-device table (one at a time) into a
    new plain tensor the module then holds."""
    tables = []
    for key, value in module.state_dict().items():
        if value.is_meta:
            tables.append(key)
        else:
            reader.read_into(f"model.{key}", value)
    for key in tables:
        tensor = torch.empty(reader.shape(f"model.{key}"), dtype=reader.dtype(f"model.{key}"))
        reader.read_into(f"model.{key}", tensor)
        module.load_state_dict({key: tensor}, strict=False, assign=True)
        log.debug(f"export: {key} {list(tensor.shape)} read")
