"""A resumable per-rank loader over a :class:`~lightning_dlrover.data.sources.SampleSource` (the in-process loader;
the staged one, :class:`~lightning_dlrover.data.staged.PipelinedLoader`, extends it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchrec.datasets.utils import Batch

from lightning_dlrover.data.sources import SampleSource, make_batch, rank_slice


class ResumableLoader:
    """Iterates one rank's rows of the global batches of a :class:`SampleSource` and remembers how far it got.

    Global batch ``g`` covers samples ``[p, p + B)`` where ``p`` is the position (a sample count) and ``B``
    the global batch size; this rank reads only its ``B / world_size`` rows of it. The position is a sample
    count, so it stays exact when the world size or the global batch size changes between steps. A trailing
    partial global batch is dropped at the end of an epoch.

    Its ``state_dict`` (``{"next_sample": int, "global_batch_size": int}``) is saved by Lightning in every
    checkpoint and by the strategy in every commit; after ``load_state_dict`` the next iteration starts at
    that sample, on any world size, with the loader's own (configured) global batch size.

    Args:
        source: the samples.
        rank: this process's rank.
        world_size: number of ranks sharing each global batch.
        global_batch_size: samples per step summed over all ranks; must be divisible by ``world_size``.
    """

    def __init__(self, source: SampleSource, rank: int, world_size: int, global_batch_size: int) -> None:
        if global_batch_size < 1:
            raise ValueError(f"data.global_batch_size={global_batch_size} must be positive.")
        self.source, self.rank, self.world_size = source, rank, world_size
        self.global_batch_size = global_batch_size
        self._next_sample = 0
        self._resume_from = 0

    def __len__(self) -> int:
        """Full global batches in one epoch at the current global batch size."""
        return len(self.source) // self.global_batch_size

    def __iter__(self) -> Iterator[Batch]:
        # Checked here, not at construction: a batch scaler may set a batch this world size divides before then.
        rank_slice(self.global_batch_size, self.rank, self.world_size)
        start, self._resume_from = self._resume_from, 0
        self._next_sample = start
        total = len(self.source)
        while True:
            batch_size = self.global_batch_size
            if self._next_sample + batch_size > total:
                return
            rows = rank_slice(batch_size, self.rank, self.world_size)
            first = self._next_sample
            batch = make_batch(*self.source.rows(first + rows.start, first + rows.stop))
            self._next_sample = first + batch_size
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Position in the epoch as a sample count, and the global batch size in use."""
        return {"next_sample": self._next_sample, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next iteration start at sample ``state["next_sample"]`` (or the legacy ``next_batch``)."""
        if "next_sample" in state:
            position = int(state["next_sample"])
        else:  # checkpoints written before positions were sample counts
            position = int(state["next_batch"]) * self.global_batch_size
        if position + self.global_batch_size > len(self.source):
            position = 0  # the saved epoch was complete
        self._resume_from = self._next_sample = position
