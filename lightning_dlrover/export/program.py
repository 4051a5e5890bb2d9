"""The serving program of an export: a ``torch.export`` program (``model.pt2``) of the unsharded model, taking plain
tensors (dense features, sparse ids and their lengths), that a server runs with ``torch`` alone.

The user's module is called with a TorchRec ``KeyedJaggedTensor`` built inside the program: ``export_forward(dense,
sparse)`` when the LightningModule defines it (``DLRMModule`` does), else ``module(dense, sparse)``. TorchRec's
unsharded collections trace to ATen operators only (``embedding_bag``, ``index``, ``split_with_sizes`` ...), which
:func:`export_program` checks, so loading the program needs neither TorchRec nor FBGEMM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

#: Operator namespaces a program may use and still run with ``torch`` alone.
TORCH_NAMESPACES = ("aten", "prims")


class ServingModule(nn.Module):
    """``forward(dense [B, D] float, values [N] int64, lengths [F * B] int32) -> module's output``: the sparse
    input in TorchRec's ``KeyedJaggedTensor`` layout, feature-major (``lengths[f * B + b]``: ids of feature
    ``features[f]`` for sample ``b``; ``values``: those ids in the same order)."""

    def __init__(self, module: nn.Module, features: list[str]) -> None:
        super().__init__()
        self.module = module
        self.features = list(features)

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> Any:
        from torchrec import KeyedJaggedTensor

        sparse = KeyedJaggedTensor(keys=self.features, values=values, lengths=lengths)
        call = getattr(self.module, "export_forward", None)
        return call(dense, sparse) if call is not None else self.module(dense, sparse)


def example_inputs(features: list[str], dense_features: int, rows: dict[str, int], batch: int = 4,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded inputs of ``batch`` samples, 1 or 2 ids per feature below each feature's table size ``rows``."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 3, (len(features) * batch,), generator=g, dtype=torch.int32)
    values = torch.cat([torch.randint(0, rows[f], (int(lengths[i * batch:(i + 1) * batch].sum()),), generator=g)
                        for i, f in enumerate(features)])
    return torch.randn(batch, dense_features, generator=g, dtype=dtype), values, lengths


def export_program(serving: ServingModule, inputs: tuple[torch.Tensor, ...]) -> torch.export.ExportedProgram:
    """``serving`` exported with a dynamic batch and number of ids; raises ``RuntimeError`` naming the operators
    that would need more than ``torch`` to run, and when the program's output differs from the module's."""
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    ids = torch.export.Dim("ids", min=1, max=1 << 30)
    features = len(serving.features)
    shapes = {"dense": {0: batch}, "values": {0: ids}, "lengths": {0: features * batch}}
    # Without it the tracer assumes a batch of more than one sample (a contiguity check guards batch != 1) and the
    # program refuses a single request; torch's export docs name this switch for the 0/1 specialisation.
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        program = torch.export.export(serving, inputs, dynamic_shapes=shapes, strict=False)
    foreign = sorted({str(node.target) for node in program.graph.nodes if node.op == "call_function"
                      and getattr(node.target, "namespace", None) not in (None, *TORCH_NAMESPACES)})
    if foreign:
        raise RuntimeError(f"the exported program calls {foreign}, which a server would need more than torch to "
                           "run; export with program=False (--no-program) and serve the state dict.")
    with torch.no_grad():
        if not _same(program.module()(*inputs), serving(*inputs)):
            raise RuntimeError("the exported program's output differs from the module's on the example inputs.")
    return program


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def save_program(program: torch.export.ExportedProgram, path: str | Path) -> None:
    """``torch.export.save(program, path)`` with each weight written from its own memory, not through a copy.

    ``torch.export.save`` (torch 2.13) turns every weight into a ``bytes`` object before writing it
    (``pt2_archive._package._get_raw_tensor_bytes``), so saving a program holds up to twice its largest table
    (measured: +513 MiB for a 256 MiB table). The archive's writer also takes a tensor's storage, as ``torch.save``
    uses it: while this saves, the weights reach the writer that way. The file is the one ``torch.export.save``
    writes; a torch without these functions saves through ``torch.export.save`` unchanged.
    """
    try:
        from torch.export.pt2_archive import _package
        get_bytes, write_bytes = _package._get_raw_tensor_bytes, _package.PT2ArchiveWriter.write_bytes
    except (ImportError, AttributeError):
        torch.export.save(program, str(path))
        return

    class _InPlace(bytes):
        """An empty ``bytes`` (the writer checks the type) carrying the CPU tensor whose storage is to be written."""

        tensor: torch.Tensor

    def raw(tensor: torch.Tensor) -> bytes:
        if _package._is_fake_tensor(tensor) or not tensor.data_ptr():
            return get_bytes(tensor)
        marker = _InPlace()
        marker.tensor = tensor.cpu()
        return marker

    def write(writer: Any, name: str, data: bytes) -> None:
        if isinstance(data, _InPlace):
            storage = data.tensor.untyped_storage()
            writer.archive_file.write_record(name, storage, storage.nbytes())
        else:
            write_bytes(writer, name, data)

    _package._get_raw_tensor_bytes, _package.PT2ArchiveWriter.write_bytes = raw, write
    try:
        torch.export.save(program, str(path))
    finally:
        _package._get_raw_tensor_bytes, _package.PT2ArchiveWriter.write_bytes = get_bytes, write_bytes
