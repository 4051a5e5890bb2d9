"""A staged, parallel, resumable Criteo TSV pipeline on ``torchdata.nodes``.

    plan (sample ranges) -> read (byte ranges) -> parse (vectorised TSV) -> transform (hash, log1p, user)
        -> assemble (KeyedJaggedTensor batch) -> prefetch

:class:`PipelinedLoader` yields exactly the batches :class:`~lightning_dlrover.data.ResumableLoader` yields over
the same :class:`~lightning_dlrover.data.CriteoTSV` (same rows, same order, same bytes) at any parallelism and
world size: the plan stage turns the loader's position (a sample count) into this rank's row ranges of the
upcoming global batches, split into chunks, and every stage keeps order. Its position is the loader's
``next_sample``; a change of parallelism (:meth:`PipelinedLoader.reconfigure`) or of the global batch size
rebuilds the stages at the current position, so nothing is lost or repeated.

With assemble workers in processes (the default method), the stages run as a chain of worker processes
(:mod:`~lightning_dlrover.data.staged.chain`): each stage with workers in processes of its own, handing whole
batches to the next, a stage without workers in the processes of the next one that has some; this process plans
and receives assembled batches only. Otherwise each stage is a ``ParallelMapper`` with its own worker count (0:
run inline in the puller) and method: processes for parse and transform (the GIL would serialise them), threads
for read and assemble, every batch passing through this process between stages. Queues are bounded (each stage,
or the chain, holds at most ``2 x workers`` items in flight; the prefetcher ``prefetch`` batches).

The configuration is in :mod:`~lightning_dlrover.data.staged.config`, the node graph (stages, build, shutdown) in
:mod:`~lightning_dlrover.data.staged.graph`; this module is the loader over it. Their public names are importable
from :mod:`lightning_dlrover.data.staged`. (The pipeline's tuner is :mod:`lightning_dlrover.pipeline_tuner`.)
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torchdata.nodes import BaseNode
from torchrec.datasets.utils import Batch

from lightning_dlrover.data.loader import ResumableLoader
from lightning_dlrover.data.sources import CriteoTSV, rank_slice
from lightning_dlrover.data.staged.config import STAGES, Method, PipelineConfig
from lightning_dlrover.data.staged.graph import Delivered, build_graph, shutdown_nodes, worker_processes
from lightning_dlrover.data.tsv_parse import MalformedLine, OnError, UserTransform
from lightning_dlrover.log import get_logger
from lightning_dlrover.monitor.events import emit

__all__ = ["PipelineStats", "PipelinedLoader", "pipelined_loader"]
log = get_logger(__name__)


@dataclass
class PipelineStats:
    """Counters since the loader was made: batches and samples delivered, seconds the consumer waited,
    busy seconds per stage, resets, skipped malformed lines."""

    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    busy: dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    resets: int = 0
    reset_s: float = 0.0
    skipped: int = 0
    batch_bytes: int = 0

    def copy(self) -> PipelineStats:
        return dataclasses.replace(self, busy=dict(self.busy))


class PipelinedLoader(ResumableLoader):
    """:class:`ResumableLoader` over a :class:`CriteoTSV`, produced by the staged parallel pipeline.

    Args:
        source: the TSV samples.
        rank, world_size, global_batch_size: as for :class:`ResumableLoader`.
        config: workers per stage and prefetch depth (change it later with :meth:`reconfigure`).
        chunk_rows: rows per work item (a rank's batch is split into chunks that flow through the stages).
        on_error: ``"raise"`` on a malformed line (the error names file and line) or ``"skip"`` it (counted in
            ``stats.skipped``; its batch is one sample short). Skips are reported: a warning at the first one of
            each file, and at the end of each epoch (or the start of the next) and by :meth:`report_skipped` a
            ``data_skipped`` event and a warning per file with the count.
        user_transforms: functions ``(dense, ids, labels) -> (dense, ids, labels)`` applied after the built-in
            transform (must be picklable by reference, e.g. module-level functions, for process workers).
        methods: per-stage ``"thread"`` or ``"process"`` (default: processes for parse, transform and assemble;
            assemble in processes makes every staffed stage a process of the chain, see above).
    """

    def __init__(self, source: CriteoTSV, rank: int, world_size: int, global_batch_size: int,
                 config: PipelineConfig = PipelineConfig(), chunk_rows: int = 2048, on_error: OnError = "raise",
                 user_transforms: Sequence[UserTransform] = (), methods: dict[str, Method] | None = None) -> None:
        super().__init__(source, rank, world_size, global_batch_size)
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows={chunk_rows} must be >= 1.")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r}: use 'raise' or 'skip'.")
        bad = set(methods or {}) - set(STAGES)
        if bad:
            raise ValueError(f"methods has unknown stages {sorted(bad)}; stages are {list(STAGES)}.")
        self.chunk_rows, self.on_error = chunk_rows, on_error
        self.user_transforms, self.methods = list(user_transforms), dict(methods or {})
        self._config = config
        self._pending: PipelineConfig | None = None
        self._graph: BaseNode[Delivered] | None = None
        self._graph_key: tuple | None = None
        self._lock = threading.Lock()
        self.stats = PipelineStats()
        self.skipped_lines: list[tuple[str, int]] = []
        self._unreported: dict[str, list] = {}  # file -> [count, first line, its reason] since the last report
        self._warned: set[str] = set()

    @property
    def config(self) -> PipelineConfig:
        """The configuration in use (or about to be, after a :meth:`reconfigure`)."""
        return self._pending or self._config

    def reconfigure(self, config: PipelineConfig) -> None:
        """Uses ``config`` from the next batch on: the stages are rebuilt at the current sample position."""
        with self._lock:
            self._pending = config if config != self._config else None

    def worker_pids(self) -> list[int]:
        """Process ids of the live stage worker processes."""
        return [p.pid for p in worker_processes(self._graph) if p.is_alive()] if self._graph is not None else []

    def close(self) -> None:
        """Stops the pipeline's threads and processes (a later iteration restarts them)."""
        if self._graph is not None:
            shutdown_nodes(self._graph)
        self._graph, self._graph_key = None, None

    def _rebuild(self) -> None:
        t0 = time.perf_counter()
        had_graph = self._graph is not None
        self.close()
        with self._lock:
            if self._pending is not None:
                self._config, self._pending = self._pending, None
        self._graph = build_graph(self.source, self.rank, self.world_size, self.global_batch_size, self._next_sample,
                                  self._config, self.chunk_rows, self.on_error, self.user_transforms, self.methods)
        self._graph.reset()
        self._graph_key = (self._next_sample, self.global_batch_size, self.world_size, self.rank)
        if had_graph:
            self.stats.resets += 1
            self.stats.reset_s += time.perf_counter() - t0

    def __iter__(self) -> Iterator[Batch]:
        rank_slice(self.global_batch_size, self.rank, self.world_size)  # as ResumableLoader: before the first batch
        start, self._resume_from = self._resume_from, 0
        self._next_sample = start
        self.close()
        # The trainer stops after len(self) batches, so the epoch before may not have reached its end below.
        self.report_skipped("epoch")
        total = len(self.source)
        try:
            while self._next_sample + self.global_batch_size <= total:
                if self._graph is None or self._pending is not None:
                    self._rebuild()
                t0 = time.perf_counter()
                item = next(self._graph)
                self.stats.wait_s += time.perf_counter() - t0
                if item.batch_start != self._next_sample or item.batch_size != self.global_batch_size:
                    self.close()  # the global batch size changed since these batches were planned
                    continue
                if item.error is not None:
                    raise MalformedLine(*item.error)
                self._next_sample += item.batch_size
                stats = self.stats
                stats.batches += 1
                stats.samples += len(item.batch.labels)
                stats.batch_bytes = item.nbytes
                for stage, seconds in item.busy.items():
                    stats.busy[stage] += seconds
                if item.skipped:
                    stats.skipped += len(item.skipped)
                    self._note_skipped(item.skipped)
                yield item.batch
            self.report_skipped("epoch")
        finally:
            self.close()

    def _note_skipped(self, skipped: list[tuple[str, int, str]]) -> None:
        for path, line, reason in skipped:
            self.skipped_lines.append((path, line))
            entry = self._unreported.setdefault(path, [0, line, reason])
            entry[0] += 1
            if path not in self._warned:
                self._warned.add(path)
                log.warning(f"lightning_dlrover: {path}:{line}: skipped a malformed Criteo line ({reason}) as "
                            "on_error='skip' says; its batch is one sample short. Further skips of this file are "
                            "counted and reported at the end of the epoch (data_skipped events).")

    def report_skipped(self, period: str = "fit") -> int:
        """Reports the malformed lines skipped since the last report (the loader does at the end of each epoch):
        per file a ``data_skipped`` event (the first line, its reason, the count) and a warning; returns the count.

        Args:
            period: what the count covers, for the warning (``"epoch"``, ``"fit"``).
        """
        unreported, self._unreported = self._unreported, {}
        for path, (count, line, reason) in sorted(unreported.items()):
            emit("data_skipped", file=path, line=line, reason=reason, count=count)
            log.warning(f"lightning_dlrover: skipped {count} malformed line{'s' * (count != 1)} of {path} in this "
                        f"{period} (first: line {line}, {reason}; on_error='skip').")
        if period == "fit" and self.stats.skipped:
            log.warning(f"lightning_dlrover: this fit skipped {self.stats.skipped} malformed line"
                        f"{'s' * (self.stats.skipped != 1)} in all (the data_skipped events list them per file and "
                        "epoch); fix or remove them, or keep data.pipeline.on_error: skip.")
        return sum(count for count, _, _ in unreported.values())


def pipelined_loader(source: CriteoTSV, rank: int, world_size: int, global_batch_size: int,
                     settings: dict[str, Any], unnamed: PipelineConfig | None = None) -> PipelinedLoader:
    """A :class:`PipelinedLoader` from a settings dict (``data.pipeline`` of the data module): workers per stage,
    ``prefetch``, and optionally ``chunk_rows`` and ``on_error``. Settings that name no stage and no ``prefetch``
    give ``unnamed`` (the machine's start, :func:`~.config.for_machine`; default ``PipelineConfig()``); named ones
    fill the rest from ``PipelineConfig()``."""
    settings = dict(settings)
    extra = {k: settings.pop(k) for k in ("chunk_rows", "on_error") if k in settings}
    unknown = set(settings) - {*STAGES, "prefetch"}
    if unknown:
        raise ValueError(f"data.pipeline has unknown keys {sorted(unknown)}; use {[*STAGES, 'prefetch', 'chunk_rows', 'on_error']}.")
    config = PipelineConfig(**settings) if settings or unnamed is None else unnamed
    return PipelinedLoader(source, rank, world_size, global_batch_size, config, **extra)
