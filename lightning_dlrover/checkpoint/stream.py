"""Reading one tensor of a ``torch.distributed.checkpoint`` (DCP) checkpoint into a plain preallocated tensor, in
one process without a process group, holding at most one block (:data:`BLOCK_BYTES`) besides the target.

``dcp.load(..., no_dist=True)`` also loads a checkpoint written at any world size and sharding into plain tensors
(and measured no second copy of a 512 MiB table either: bench/README.md, bench_export.py); this reader is kept for
what it adds: the bound on the memory besides the target is its own (one block), not a property of ``torch.load``'s
internals, one table is read at a time by its name, and a missing or truncated shard file is named before anything
is read (:meth:`DCPReader.check_files`). A chunk's bytes go from the file into the target in blocks of whole rows:
the chunk is a ``torch.save`` zip archive (one uncompressed storage, ``<archive>/data/0``) at a known offset of a
``.distcp`` file, and DCP clones a view before it saves it, so the storage holds exactly the chunk's elements,
contiguous. Anything else (a transformed or differently laid-out chunk) falls back to ``torch.load`` of that chunk.
"""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: The most bytes of a chunk held besides the target while it is copied in.
BLOCK_BYTES = 16 << 20


class CheckpointFileError(ValueError):
    """A file of a checkpoint is missing or shorter than the checkpoint's metadata says; names the file."""


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a tensor: where it sits in the tensor and in which file at which bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: Path
    offset: int
    length: int
    transformed: bool


class DCPReader:
    """The metadata of the DCP checkpoint directory ``path`` and :meth:`read_into` for any of its tensors."""

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.path = Path(path)
        if not (self.path / ".metadata").is_file():
            raise CheckpointFileError(
                f"{self.path / '.metadata'} is missing: {self.path} is not a complete torch.distributed.checkpoint "
                "directory (every save writes it last)."
            )
        try:
            metadata = FileSystemReader(str(self.path)).read_metadata()
        except Exception as err:  # a truncated or foreign file: unpickling fails in many ways
            raise CheckpointFileError(f"{self.path / '.metadata'} cannot be read ({type(err).__name__}: {err}); "
                                      "the checkpoint is damaged or incomplete.") from None
        self.tensors: dict[str, Any] = {k: v for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")}
        self.chunks: dict[str, list[Chunk]] = {}
        for index, info in metadata.storage_data.items():
            self.chunks.setdefault(index.fqn, []).append(Chunk(
                tuple(index.offset or ()), self._chunk_sizes(index.fqn, tuple(index.offset or ())),
                self.path / info.relative_path, info.offset, info.length, bool(info.transform_descriptors)))

    def _chunk_sizes(self, fqn: str, offsets: tuple[int, ...]) -> tuple[int, ...]:
        entry = self.tensors.get(fqn)
        for chunk in getattr(entry, "chunks", []):
            if tuple(chunk.offsets) == offsets:
                return tuple(chunk.sizes)
        return ()

    def shape(self, fqn: str) -> tuple[int, ...]:
        """The full (unsharded) shape of the tensor saved as ``fqn``."""
        return tuple(self.tensors[fqn].size)

    def dtype(self, fqn: str) -> torch.dtype:
        """Its dtype."""
        return self.tensors[fqn].properties.dtype

    def check_files(self, prefix: str = "") -> None:
        """Raises :class:`CheckpointFileError` naming the first file (of the tensors whose name starts with
        ``prefix``) that is missing or shorter than the metadata says it is."""
        needed: dict[Path, int] = {}
        for fqn, chunks in self.chunks.items():
            if fqn.startswith(prefix):
                for chunk in chunks:
                    needed[chunk.file] = max(needed.get(chunk.file, 0), chunk.offset + chunk.length)
        for file, size in sorted(needed.items()):
            if not file.is_file():
                raise CheckpointFileError(f"{file} is missing: the checkpoint's metadata lists it (one rank's "
                                          "shards). Copy the whole checkpoint directory, or export another checkpoint.")
            if (actual := file.stat().st_size) < size:
                raise CheckpointFileError(f"{file} is truncated: {actual} bytes, the checkpoint's metadata expects at "
                                          f"least {size}. Copy it again from where the job wrote it, or export "
                                          "another checkpoint.")

    def read_into(self, fqn: str, target: torch.Tensor) -> None:
        """Fills the plain tensor ``target`` (the full shape of ``fqn``) from every saved chunk of ``fqn``."""
        if tuple(target.shape) != self.shape(fqn):
            raise ValueError(f"{fqn}: the target has shape {tuple(target.shape)}, the checkpoint {self.shape(fqn)}")
        for chunk in self.chunks.get(fqn, []):
            region = target[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))]
            with open(chunk.file, "rb") as f:
                start = None if chunk.transformed else _storage_start(f, chunk, region)
                if start is None:
                    f.seek(chunk.offset)
                    region.copy_(torch.load(io.BytesIO(f.read(chunk.length)), map_location="cpu", weights_only=True))
                    continue
                f.seek(start)
                _copy_rows(f, region)


def _storage_start(f: Any, chunk: Chunk, region: torch.Tensor) -> int | None:
    """The file offset of the chunk's storage bytes, or ``None`` when the chunk is not one plain storage of exactly
    the region's elements."""
    f.seek(chunk.offset)
    try:
        archive = zipfile.ZipFile(_Slice(f, chunk.offset, chunk.length))
        storages = [i for i in archive.infolist() if "/data/" in i.filename and not i.filename.endswith("/")]
    except zipfile.BadZipFile:
        return None
    if len(storages) != 1 or storages[0].compress_type != zipfile.ZIP_STORED:
        return None
    info = storages[0]
    if info.file_size != region.numel() * region.element_size():
        return None
    f.seek(chunk.offset + info.header_offset)
    header = f.read(30)
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        return None
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return chunk.offset + info.header_offset + 30 + name_length + extra_length


def _copy_rows(f: Any, region: torch.Tensor) -> None:
    """Copies the row-major elements read from ``f`` into ``region`` (any strides), a block of rows at a time."""
    rows = region.shape[0] if region.dim() else 1
    view = region.reshape(rows, -1) if region.dim() != 2 else region
    if region.dim() > 2 and not region.is_contiguous():
        raise ValueError("chunks of tensors of more than two dimensions must cover whole rows")
    row_bytes = max(1, view.shape[1] * region.element_size())
    block_rows = max(1, BLOCK_BYTES // row_bytes)
    buffer = bytearray(min(rows, block_rows) * row_bytes)
    for start in range(0, rows, block_rows):
        count = min(block_rows, rows - start)
        data = memoryview(buffer)[: count * row_bytes]
        if f.readinto(data) != len(data):
            raise CheckpointFileError(f"{f.name} ended inside a tensor: the file is truncated.")
        block = torch.frombuffer(buffer, dtype=region.dtype, count=count * view.shape[1]).view(count, view.shape[1])
        view[start : start + count].copy_(block)


class _Slice(io.RawIOBase):
    """The bytes ``[offset, offset + length)`` of the open file ``f`` as a seekable read-only file."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        self.f, self.offset, self.length, self.position = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.position, 2: self.length}[whence]
        self.position = max(0, min(self.length, base + position))
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self.length - self.position)
        self.f.seek(self.offset + self.position)
        data = self.f.read(count)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)
