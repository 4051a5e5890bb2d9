"""Sources of DLRM training batches: synthetic Criteo-like data and real Criteo TSV files.

Both produce the same stream for any world size: global batch ``g`` holds samples
``[g * B, (g + 1) * B)`` and rank ``r`` of ``W`` receives rows ``[r * B / W, (r + 1) * B / W)`` of it,
so a run that changes world size (or resumes from a checkpoint) sees the same data at the same step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES = [f"int_{i}" for i in range(NUM_DENSE)]
SPARSE_NAMES = [f"cat_{i}" for i in range(NUM_SPARSE)]


class BatchSource(Protocol):
    """A deterministic, restartable stream of global batches, sliced per rank."""

    global_batch_size: int

    def __len__(self) -> int:
        """Number of global batches in one epoch."""

    def iter_rank_batches(self, start: int, rank: int, world_size: int) -> Iterator[Batch]:
        """Yields rank ``rank``'s slice of global batches ``start, start + 1, ...`` to the end of the epoch."""


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
    (AUC well above 0.5). Global batch ``g`` is generated from ``(seed, g)`` alone.

    Args:
        num_embeddings_per_feature: table size of each of the 26 categorical features.
        global_batch_size: samples per step summed over all ranks.
        num_batches: global batches per epoch.
        seed: seed of the whole stream.
        alpha: power-law exponent of the ids (1.0 = uniform).
    """

    def __init__(
        self,
        num_embeddings_per_feature: Sequence[int],
        global_batch_size: int,
        num_batches: int,
        seed: int = 0,
        alpha: float = 1.5,
    ) -> None:
        if len(num_embeddings_per_feature) != NUM_SPARSE:
            raise ValueError(
                f"num_embeddings_per_feature has {len(num_embeddings_per_feature)} entries; Criteo has {NUM_SPARSE}."
            )
        if alpha < 1.0:
            raise ValueError(f"alpha={alpha} must be >= 1.0 (1.0 gives uniform ids).")
        self.num_embeddings = torch.tensor(list(num_embeddings_per_feature), dtype=torch.float64)
        self.global_batch_size = global_batch_size
        self.num_batches = num_batches
        self.seed = seed
        self.alpha = alpha
        weights = torch.Generator().manual_seed(seed ^ 0x5EED)
        self._dense_weight = torch.randn(NUM_DENSE, generator=weights) * 0.3
        self._id_salt = torch.randint(1, 2**31 - 1, (NUM_SPARSE,), generator=weights, dtype=torch.int64)

    def __len__(self) -> int:
        return self.num_batches

    def global_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense [B, 13] float32, ids [B, 26] int64 and labels [B] float32 of global batch ``index``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        batch = self.global_batch_size
        dense = torch.log1p(torch.empty(batch, NUM_DENSE).exponential_(0.1, generator=gen))
        u = torch.rand(batch, NUM_SPARSE, generator=gen, dtype=torch.float64)
        ids = (self.num_embeddings * u.pow(self.alpha)).long().clamp_max_(self.num_embeddings.long() - 1)
        # Each id has a fixed effect in [-0.5, 0.5): the signal the embeddings learn.
        id_effect = ((ids * self._id_salt) % 1000).float().div_(1000).sub_(0.5)
        logit = (dense - 2.3) @ self._dense_weight + id_effect.sum(dim=1) * 0.5
        labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
        return dense, ids, labels

    def iter_rank_batches(self, start: int, rank: int, world_size: int) -> Iterator[Batch]:
        rows = rank_slice(self.global_batch_size, rank, world_size)
        for index in range(start, self.num_batches):
            dense, ids, labels = self.global_batch(index)
            yield make_batch(dense[rows], ids[rows], labels[rows])


class CriteoTSV:
    """Criteo Kaggle/Terabyte day files: ``label \\t 13 integer features \\t 26 hex categorical features``.

    Missing values are empty fields. Dense features become ``log1p(max(x, 0))``; categorical hex strings
    are mapped to ``int(hex, 16) % num_embeddings`` (missing -> 0). Files are read in order; a trailing
    partial global batch is dropped.

    Args:
        paths: TSV files, read in the given order (one epoch = all of them).
        num_embeddings_per_feature: table size of each of the 26 categorical features.
        global_batch_size: samples per step summed over all ranks.
    """

    def __init__(self, paths: Sequence[str | Path], num_embeddings_per_feature: Sequence[int], global_batch_size: int):
        self.paths = [Path(p) for p in paths]
        missing = [str(p) for p in self.paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"data.criteo_paths: no such file(s): {', '.join(missing)}")
        if len(num_embeddings_per_feature) != NUM_SPARSE:
            raise ValueError(
                f"num_embeddings_per_feature has {len(num_embeddings_per_feature)} entries; Criteo has {NUM_SPARSE}."
            )
        self.num_embeddings = list(num_embeddings_per_feature)
        self.global_batch_size = global_batch_size
        self._num_batches: int | None = None

    def __len__(self) -> int:
        if self._num_batches is None:
            lines = sum(sum(1 for _ in open(p, "rb")) for p in self.paths)
            self._num_batches = lines // self.global_batch_size
        return self._num_batches

    def _lines(self) -> Iterator[bytes]:
        for path in self.paths:
            with open(path, "rb") as f:
                yield from f

    def parse(self, lines: list[bytes]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense [n, 13] float32, ids [n, 26] int64 and labels [n] float32 of TSV lines."""
        n = len(lines)
        labels = torch.empty(n)
        dense = torch.empty(n, NUM_DENSE)
        ids = torch.empty(n, NUM_SPARSE, dtype=torch.int64)
        for row, line in enumerate(lines):
            fields = line.rstrip(b"\r\n").split(b"\t")
            if len(fields) != 1 + NUM_DENSE + NUM_SPARSE:
                raise ValueError(f"malformed Criteo line with {len(fields)} fields (expected 40): {line[:80]!r}")
            labels[row] = float(fields[0])
            dense[row] = torch.tensor([math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1 : 1 + NUM_DENSE]])
            ids[row] = torch.tensor(
                [int(h, 16) % m if h else 0 for h, m in zip(fields[1 + NUM_DENSE :], self.num_embeddings)]
            )
        return dense, ids, labels

    def iter_rank_batches(self, start: int, rank: int, world_size: int) -> Iterator[Batch]:
        rows = rank_slice(self.global_batch_size, rank, world_size)
        lines = self._lines()
        for _ in range(start * self.global_batch_size):
            next(lines, None)
        while True:
            chunk = [line for _, line in zip(range(self.global_batch_size), lines)]
            if len(chunk) < self.global_batch_size:
                return
            yield make_batch(*self.parse(chunk[rows]))
