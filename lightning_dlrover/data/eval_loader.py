"""Evaluation and prediction over every sample of a :class:`~lightning_dlrover.data.sources.SampleSource` exactly once.

Training drops a trailing partial global batch and reads each global batch striped over the ranks; evaluation must
see every sample once, at any world size. Rank ``r`` of ``W`` reads the contiguous slice ``[N*r//W, N*(r+1)//W)`` of
the ``N`` samples in batches of ``global_batch_size / W``. A TorchRec-sharded model runs collectives in every
forward, so every rank runs the same number of batches of the same size: short batches are padded by repeating a
sample, and each batch carries the global ``index`` of its rows (``-1`` for padding), which the model's test and
predict steps use to leave padding out. Nothing is gathered: each rank's predictions are its slice's, in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torchrec.datasets.utils import Batch

from lightning_dlrover.data.sources import SampleSource, make_batch, rank_slice


@dataclass
class IndexedBatch(Batch):
    """A TorchRec ``Batch`` with the global sample index of each row: int64 ``[B]``, ``-1`` for a padding row."""

    index: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> IndexedBatch:
        moved = super().to(device, non_blocking)
        return IndexedBatch(moved.dense_features, moved.sparse_features, moved.labels,
                            self.index.to(device=device, non_blocking=non_blocking))

    def pin_memory(self) -> IndexedBatch:
        pinned = super().pin_memory()
        return IndexedBatch(pinned.dense_features, pinned.sparse_features, pinned.labels, self.index.pin_memory())

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        self.index.record_stream(stream)

    @property
    def valid(self) -> torch.Tensor:
        """Bool ``[B]``: the rows that are samples (not padding)."""
        return self.index >= 0


def eval_slice(num_samples: int, rank: int, world_size: int) -> tuple[int, int]:
    """The samples ``[start, stop)`` rank ``rank`` of ``world_size`` evaluates: contiguous, in rank order, each
    sample on exactly one rank, sizes differing by at most one."""
    return num_samples * rank // world_size, num_samples * (rank + 1) // world_size


def eval_batch_count(num_samples: int, world_size: int, batch_size: int) -> int:
    """Batches every rank runs: enough for the largest slice (``ceil(N / W)`` samples)."""
    largest = -(-num_samples // world_size)
    return -(-largest // batch_size)


class EvalLoader:
    """One rank's batches of a :class:`SampleSource` for ``test`` and ``predict``: every sample exactly once over
    all ranks, in input order within a rank, the same number of equally sized batches on every rank (see the module
    docstring). Yields :class:`IndexedBatch`.

    Args:
        source: the samples.
        rank: this process's rank.
        world_size: number of ranks.
        global_batch_size: samples per step summed over all ranks; must be divisible by ``world_size``.
    """

    def __init__(self, source: SampleSource, rank: int, world_size: int, global_batch_size: int) -> None:
        rows = rank_slice(global_batch_size, rank, world_size)
        self.source, self.rank, self.world_size = source, rank, world_size
        self.batch_size = rows.stop - rows.start
        self.start, self.stop = eval_slice(len(source), rank, world_size)

    def __len__(self) -> int:
        return eval_batch_count(len(self.source), self.world_size, self.batch_size)

    def __iter__(self) -> Iterator[IndexedBatch]:
        total, size = len(self.source), self.batch_size
        for number in range(len(self)):
            first = self.start + number * size
            last = min(first + size, self.stop)
            count = max(last - first, 0)
            filler = min(first, total - 1) if count == 0 else first  # a sample to repeat for padding
            dense, ids, labels = self.source.rows(first, last) if count else self.source.rows(filler, filler + 1)
            index = torch.arange(first, first + count, dtype=torch.int64)
            if count < size:
                pad = size - count
                dense, ids, labels = (torch.cat([t[:count], t[:1].expand(pad, *t.shape[1:])]) for t in (dense, ids, labels))
                index = torch.cat([index, torch.full((pad,), -1, dtype=torch.int64)])
            batch = make_batch(dense, ids, labels)
            yield IndexedBatch(batch.dense_features, batch.sparse_features, batch.labels, index)
