"""Row-wise int8 embedding tables for serving (``model_int8.pt``), through TorchRec's inference quantisation.

``quantize_embeddings(module, dtype=torch.qint8)`` (``torchrec.inference.modules``) swaps each unsharded
``EmbeddingBagCollection`` / ``EmbeddingCollection`` for TorchRec's quantised one: every row is stored as int8 codes
with its own fp16 scale and bias (FBGEMM's 8-bit row-wise format, rows padded to 16 bytes) and looked up by FBGEMM's
CPU/GPU kernels, which dequantise into fp32 outputs. The dense layers stay fp32. This is the path a TorchRec user
serves a quantised DLRM with, so loading ``model_int8.pt`` needs TorchRec and FBGEMM (``model.pt2`` does not).

Example::

    from lightning_dlrover.export import load_quantized
    module = load_quantized("exported")          # the LightningModule, tables int8, in eval mode
    logits = module.export_forward(dense, kjt)   # or module(batch)

    # without this package: build the same module, then
    from torchrec.inference.modules import quantize_embeddings
    quantize_embeddings(module, dtype=torch.qint8, inplace=True, output_dtype=torch.float)
    module.load_state_dict(torch.load("exported/model_int8.pt", weights_only=True))
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

#: File of the quantised module's ``state_dict`` in an export.
QUANTIZED_FILE = "model_int8.pt"
#: ``export_checkpoint(quantize=...)`` / ``--quantize`` choices: table dtype.
QUANTIZE_DTYPES = {"int8": torch.qint8}


def quantize(module: nn.Module, dtype: str = "int8") -> nn.Module:
    """Swaps ``module``'s embedding collections for TorchRec's row-wise quantised ones, in place; returns it."""
    from torchrec.inference.modules import quantize_embeddings

    if dtype not in QUANTIZE_DTYPES:
        raise ValueError(f"quantize={dtype!r} is not one of {sorted(QUANTIZE_DTYPES)}.")
    quantize_embeddings(module, dtype=QUANTIZE_DTYPES[dtype], inplace=True, output_dtype=torch.float)
    return module


def load_quantized(directory: str | Path) -> nn.Module:
    """The LightningModule of an export written with ``quantize="int8"``, its tables int8, in eval mode.

    Raises:
        FileNotFoundError: ``directory`` holds no ``model_int8.pt`` (export again with ``--quantize int8``).
    """
    from lightning_dlrover.checkpoint.plain import CONFIG_FILE
    from lightning_dlrover.export.artefact import build_module

    directory = Path(directory)
    if not (directory / QUANTIZED_FILE).is_file():
        raise FileNotFoundError(f"{directory} holds no {QUANTIZED_FILE}: export with quantize='int8' (--quantize "
                                "int8).")
    config = json.loads((directory / CONFIG_FILE).read_text())
    module = build_module(config["module_class"], config["hparams"], directory)
    # The quantiser reads float tables: uninitialised ones do, as the saved codes overwrite what it makes of them.
    for key, value in module.state_dict().items():
        if value.is_meta:
            module.load_state_dict({key: torch.empty(value.shape, dtype=value.dtype)}, strict=False, assign=True)
    quantize(module, config["quantized"]["dtype"])
    module.load_state_dict(torch.load(directory / QUANTIZED_FILE, weights_only=True))
    return module.eval()
