"""Sample-addressable sources of DLRM training data: synthetic Criteo-like data and real Criteo TSV files.

A source is a fixed sequence of samples: ``source.rows(a, b)`` returns samples ``[a, b)`` and nothing
else, so a loader can read exactly its own rank's rows of any global batch. Global batch ``g`` of size
``B`` starting at sample ``p`` covers samples ``[p, p + B)``; rank ``r`` of ``W`` gets
``[p + r * B / W, p + (r + 1) * B / W)``. The stream is therefore the same for any world size and any
sequence of batch sizes, and a position is a sample count.

Shapes: ``dense`` float32 ``[n, 13]`` (already ``log1p``-transformed), ``ids`` int64 ``[n, 26]`` (one id
per categorical feature, ``0 <= ids[:, f] < num_embeddings[f]``), ``labels`` float32 ``[n]`` in {0, 1}.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_dlrover.data.tsv_parse import parse_block, transform

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES = [f"int_{i}" for i in range(NUM_DENSE)]
SPARSE_NAMES = [f"cat_{i}" for i in range(NUM_SPARSE)]


class SampleSource(Protocol):
    """A deterministic sequence of Criteo-format samples that can be read from any position."""

    def __len__(self) -> int:
        """Number of samples in one epoch."""

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense ``[n, 13]``, ids ``[n, 26]`` and labels ``[n]`` of samples ``[start, stop)``."""


def rank_slice(global_batch_size: int, rank: int, world_size: int) -> slice:
    """The rows of a global batch that belong to ``rank``; raises if the batch does not divide evenly."""
    if global_batch_size % world_size:
        raise ValueError(
            f"data.global_batch_size={global_batch_size} is not divisible by the world size {world_size}; "
            f"choose a multiple of {world_size}."
        )
    per_rank = global_batch_size // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def make_batch(dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor) -> Batch:
    """Packs one-hot Criteo features into a TorchRec ``Batch``.

    Args:
        dense: float32 [B, 13], already transformed.
        ids: int64 [B, 26], one id per categorical feature.
        labels: float32 [B] in {0, 1}.
    """
    batch_size, num_sparse = ids.shape
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=SPARSE_NAMES[:num_sparse],
        values=ids.t().reshape(-1).contiguous(),
        lengths=torch.ones(num_sparse * batch_size, dtype=torch.int32),
    )
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


class SyntheticCriteo:
    """Criteo-like synthetic click data: 13 dense features, 26 categorical features, binary labels.

    Categorical ids follow a power law (``id = floor(N * u ** alpha)``, ``u ~ U(0, 1)``; larger ``alpha``
    means hotter rows), dense features are ``log1p`` of exponential counts as in the Criteo pre-processing,
    and the label is drawn from a fixed logistic function of the features so that a model can learn it
    (AUC well above 0.5). Samples are generated in blocks of :attr:`BLOCK`; block ``b`` depends on
    ``(seed, b)`` alone, so any range of samples is reproducible on its own.

    Args:
        num_embeddings_per_feature: table size of each of the 26 categorical features.
        num_samples: samples per epoch.
        seed: seed of the samples.
        alpha: power-law exponent of the ids (1.0 = uniform).
        label_seed: seed of the labelling function (default ``seed``); a validation stream takes another ``seed``
            and the training stream's ``label_seed`` so that it measures the same task.

    Example::

        source = SyntheticCriteo([1000] * 26, num_samples=4096)
        dense, ids, labels = source.rows(0, 512)   # [512, 13], [512, 26], [512]
    """

    BLOCK = 512

    def __init__(
        self,
        num_embeddings_per_feature: Sequence[int],
        num_samples: int,
        seed: int = 0,
        alpha: float = 1.5,
        label_seed: int | None = None,
    ) -> None:
        if len(num_embeddings_per_feature) != NUM_SPARSE:
            raise ValueError(
                f"num_embeddings_per_feature has {len(num_embeddings_per_feature)} entries; Criteo has {NUM_SPARSE}."
            )
        if alpha < 1.0:
            raise ValueError(f"alpha={alpha} must be >= 1.0 (1.0 gives uniform ids).")
        if num_samples < 0:
            raise ValueError(f"num_samples={num_samples} must be >= 0.")
        self.num_embeddings = torch.tensor(list(num_embeddings_per_feature), dtype=torch.float64)
        self.num_samples = num_samples
        self.seed = seed
        self.alpha = alpha
        weights = torch.Generator().manual_seed((seed if label_seed is None else label_seed) ^ 0x5EED)
        self._dense_weight = torch.randn(NUM_DENSE, generator=weights) * 0.3
        self._id_salt = torch.randint(1, 2**31 - 1, (NUM_SPARSE,), generator=weights, dtype=torch.int64)

    def __len__(self) -> int:
        return self.num_samples

    def _block(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n = self.BLOCK
        dense = torch.log1p(torch.empty(n, NUM_DENSE).exponential_(0.1, generator=gen))
        u = torch.rand(n, NUM_SPARSE, generator=gen, dtype=torch.float64)
        ids = (self.num_embeddings * u.pow(self.alpha)).long().clamp_max_(self.num_embeddings.long() - 1)
        # Each id has a fixed effect in [-0.5, 0.5): the signal the embeddings learn.
        id_effect = ((ids * self._id_salt) % 1000).float().div_(1000).sub_(0.5)
        logit = (dense - 2.3) @ self._dense_weight + id_effect.sum(dim=1) * 0.5
        labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
        return dense, ids, labels

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense ``[n, 13]``, ids ``[n, 26]`` and labels ``[n]`` of samples ``[start, stop)``."""
        check_range(start, stop, self.num_samples)
        first, last = start // self.BLOCK, (stop - 1) // self.BLOCK if stop > start else start // self.BLOCK
        blocks = [self._block(b) for b in range(first, last + 1)]
        offset = first * self.BLOCK
        return tuple(torch.cat(parts)[start - offset : stop - offset] for parts in zip(*blocks))


class CriteoTSV:
    """Criteo Kaggle/Terabyte day files: ``label \\t 13 integer features \\t 26 hex categorical features``.

    Missing values are empty fields. Dense features become ``log1p(max(x, 0))``; categorical hex strings
    are mapped to ``int(hex, 16) % num_embeddings`` (missing -> 0). Lines are parsed by the one rule of
    :mod:`~lightning_dlrover.data.tsv_parse`, the staged loader's too (e.g. a categorical field of more than 15 hex
    digits is a malformed line in both). The files are one sequence of samples
    in the given order; an index of line offsets (built on first use, one pass over the files) lets
    :meth:`rows` read any range directly.

    Args:
        paths: TSV files, read in the given order (one epoch = all of them).
        num_embeddings_per_feature: table size of each of the 26 categorical features.
    """

    def __init__(self, paths: Sequence[str | Path], num_embeddings_per_feature: Sequence[int]):
        self.paths = [Path(p) for p in paths]
        missing = [str(p) for p in self.paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"data.criteo_paths: no such file(s): {', '.join(missing)}")
        if len(num_embeddings_per_feature) != NUM_SPARSE:
            raise ValueError(
                f"num_embeddings_per_feature has {len(num_embeddings_per_feature)} entries; Criteo has {NUM_SPARSE}."
            )
        self.num_embeddings = list(num_embeddings_per_feature)
        self._offsets: list[np.ndarray] | None = None  # per file: start offset of every line, then the file size
        self._first_sample: list[int] = []

    def _index(self) -> list[np.ndarray]:
        if self._offsets is None:
            self._offsets, total = [], 0
            for path in self.paths:
                self._offsets.append(line_offsets(path))
                self._first_sample.append(total)
                total += len(self._offsets[-1]) - 1
        return self._offsets

    def __len__(self) -> int:
        return sum(len(o) - 1 for o in self._index())

    def byte_ranges(self, start: int, stop: int) -> list[tuple[Path, int, int, int]]:
        """``(file, first line number, byte offset, byte length)`` of the lines holding samples ``[start, stop)``;
        line numbers count from 1."""
        offsets = self._index()
        check_range(start, stop, len(self))
        ranges = []
        for path, first, file_offsets in zip(self.paths, self._first_sample, offsets):
            lo, hi = max(start - first, 0), min(stop - first, len(file_offsets) - 1)
            if lo < hi:
                ranges.append((path, lo + 1, int(file_offsets[lo]), int(file_offsets[hi] - file_offsets[lo])))
        return ranges

    def lines(self, start: int, stop: int) -> Iterator[tuple[Path, int, list[bytes]]]:
        """``(file, first line number, raw lines)`` covering samples ``[start, stop)``; line numbers count from 1."""
        for path, first_line, offset, length in self.byte_ranges(start, stop):
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(length)
            yield path, first_line, data.splitlines()

    def parse(
        self, lines: list[bytes], path: Path | str = "<lines>", first_line: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense [n, 13] float32, ids [n, 26] int64 and labels [n] float32 of TSV lines, by the one parsing rule of
        :mod:`~lightning_dlrover.data.tsv_parse` (the staged loader's): a malformed line raises
        :class:`~lightning_dlrover.data.tsv_parse.MalformedLine` naming ``path`` and its line number."""
        return transform(parse_block(b"\n".join(lines), str(path), first_line), self.num_embeddings)

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense ``[n, 13]``, ids ``[n, 26]`` and labels ``[n]`` of samples ``[start, stop)``."""
        parts = []
        for path, first_line, offset, length in self.byte_ranges(start, stop):
            with open(path, "rb") as f:
                f.seek(offset)
                parts.append(transform(parse_block(f.read(length), str(path), first_line), self.num_embeddings))
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(p) for p in zip(*parts)) if parts else self.parse([])


def line_offsets(path: Path, chunk: int = 1 << 24) -> np.ndarray:
    """Byte offset of the start of every line of ``path`` and, last, the file size (int64)."""
    starts, size = [np.zeros(1, dtype=np.int64)], 0
    with open(path, "rb") as f:
        while data := f.read(chunk):
            newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10).astype(np.int64)
            starts.append(newlines + size + 1)
            size += len(data)
    offsets = np.concatenate(starts)
    if offsets[-1] != size:  # a last line without a newline
        offsets = np.append(offsets, size)
    return offsets


def check_range(start: int, stop: int, num_samples: int) -> None:
    """Raises unless ``0 <= start <= stop <= num_samples``."""
    if not 0 <= start <= stop <= num_samples:
        raise IndexError(f"samples [{start}, {stop}) are outside the source's [0, {num_samples}).")
