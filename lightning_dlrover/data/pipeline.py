"""A staged, parallel, resumable Criteo TSV pipeline on ``torchdata.nodes``.

    plan (sample ranges) -> read (byte ranges) -> parse (vectorised TSV) -> transform (hash, log1p, user)
        -> assemble (KeyedJaggedTensor batch) -> prefetch

:class:`PipelinedLoader` yields exactly the batches :class:`~lightning_dlrover.data.ResumableLoader` yields over
the same :class:`~lightning_dlrover.data.CriteoTSV` (same rows, same order, same bytes) at any parallelism and
world size: the plan stage turns the loader's position (a sample count) into this rank's row ranges of the
upcoming global batches, split into chunks, and every stage keeps order. Its position is the loader's
``next_sample``; a change of parallelism (:meth:`PipelinedLoader.reconfigure`) or of the global batch size
rebuilds the stages at the current position, so nothing is lost or repeated.

Each stage is a ``ParallelMapper`` with its own worker count (0: run inline in the puller) and method:
processes for parse and transform (the GIL would serialise them), threads for read and assemble. Queues are
bounded (each stage holds at most ``2 x workers`` items in flight; the prefetcher ``prefetch`` batches).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.queues
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torchdata.nodes import BaseNode, ParallelMapper, Prefetcher
from torchrec.datasets.utils import Batch

from lightning_dlrover.data.datamodule import ResumableLoader
from lightning_dlrover.data.sources import CriteoTSV, make_batch, rank_slice
from lightning_dlrover.data.tsv_parse import MalformedLine, OnError, RawRows, UserTransform, parse_block, transform

STAGES = ("read", "parse", "transform", "assemble")
Method = Literal["thread", "process"]
DEFAULT_METHODS: dict[str, Method] = {"read": "thread", "parse": "process", "transform": "process", "assemble": "thread"}


@dataclass(frozen=True)
class PipelineConfig:
    """Workers per stage (0: the stage runs inline in the thread that pulls from it) and prefetch depth in batches."""

    read: int = 1
    parse: int = 1
    transform: int = 1
    assemble: int = 1
    prefetch: int = 2

    def __post_init__(self) -> None:
        for name in (*STAGES, "prefetch"):
            if getattr(self, name) < 0:
                raise ValueError(f"PipelineConfig.{name}={getattr(self, name)} must be >= 0.")

    @property
    def workers(self) -> dict[str, int]:
        return {s: getattr(self, s) for s in STAGES}

    @property
    def total_workers(self) -> int:
        return sum(self.workers.values())

    def replace(self, **changes: int) -> PipelineConfig:
        return dataclasses.replace(self, **changes)

    def short(self) -> str:
        return "r{read} p{parse} t{transform} a{assemble} q{prefetch}".format(**dataclasses.asdict(self))


#: The in-process configuration: every stage inline, nothing prefetched (today's loader with the fast parse).
INLINE = PipelineConfig(0, 0, 0, 0, 0)


@dataclass
class _Chunk:
    """One piece of one rank's share of a global batch, as it moves through the stages."""

    batch_start: int
    batch_size: int
    part: int
    parts: int
    ranges: list[tuple[str, int, int, int]]
    payload: Any = None
    busy: dict[str, float] = field(default_factory=dict)
    skipped: list[tuple[str, int]] = field(default_factory=list)
    error: tuple[str, int, str, bytes] | None = None  # a malformed line: (path, line, reason, text)


@dataclass
class Delivered:
    """An assembled batch and what it cost: ``busy`` seconds per stage, ``skipped`` (file, line) pairs."""

    batch: Batch
    batch_start: int
    batch_size: int
    busy: dict[str, float]
    skipped: list[tuple[str, int]]
    nbytes: int
    error: tuple[str, int, str, bytes] | None = None


class _Plan(BaseNode[_Chunk]):
    """This rank's row ranges of global batches from a sample position on, in chunks of at most ``chunk_rows``."""

    def __init__(self, source: CriteoTSV, rank: int, world_size: int, batch_size: int, start: int, chunk_rows: int):
        super().__init__()
        self.source, self.rank, self.world_size = source, rank, world_size
        self.batch_size, self.start, self.chunk_rows = batch_size, start, chunk_rows
        self._total = len(source)
        self._pending: list[_Chunk] = []
        self._position = start

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._position = int(initial_state["position"]) if initial_state else self.start
        self._pending = []

    def next(self) -> _Chunk:
        if not self._pending:
            if self._position + self.batch_size > self._total:
                raise StopIteration
            rows = rank_slice(self.batch_size, self.rank, self.world_size)
            first, last = self._position + rows.start, self._position + rows.stop
            bounds = list(range(first, last, self.chunk_rows)) + [last]
            parts = len(bounds) - 1
            self._pending = [
                _Chunk(self._position, self.batch_size, i, parts,
                       [(str(p), line, off, n) for p, line, off, n in self.source.byte_ranges(a, b)])
                for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
            ]
            self._position += self.batch_size
        return self._pending.pop(0)

    def get_state(self) -> dict[str, Any]:
        return {"position": self._position}


class _Group(BaseNode[list[_Chunk]]):
    """Collects the chunks of one batch (they arrive in order)."""

    def __init__(self, source: BaseNode[_Chunk]):
        super().__init__()
        self.source = source

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.source.reset()

    def next(self) -> list[_Chunk]:
        chunks = [next(self.source)]
        while len(chunks) < chunks[0].parts:
            chunks.append(next(self.source))
        return chunks

    def get_state(self) -> dict[str, Any]:
        return {}


def _read(chunk: _Chunk) -> _Chunk:
    t0 = time.perf_counter()
    blocks = []
    for path, first_line, offset, length in chunk.ranges:
        with open(path, "rb") as f:
            f.seek(offset)
            blocks.append((path, first_line, f.read(length)))
    chunk.payload = blocks
    chunk.busy["read"] = time.perf_counter() - t0
    return chunk


def _parse(on_error: OnError, chunk: _Chunk) -> _Chunk:
    t0 = time.perf_counter()
    parts = []
    for path, first_line, data in chunk.payload:
        try:
            raw = parse_block(data, path, first_line, on_error)
        except MalformedLine as err:  # raised by the loader, in order, as a MalformedLine (not a wrapped error)
            chunk.error, chunk.payload = (err.path, err.line, err.reason, err.text), None
            return chunk
        chunk.skipped.extend((path, line) for line in raw.skipped)
        parts.append(raw)
    if len(parts) == 1:
        chunk.payload = parts[0]
    else:
        chunk.payload = RawRows(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("labels", "dense", "hex_ids")))
    chunk.busy["parse"] = time.perf_counter() - t0
    return chunk


def _transform(num_embeddings: Sequence[int], user_transforms: Sequence[UserTransform], chunk: _Chunk) -> _Chunk:
    if chunk.error is not None:
        return chunk
    t0 = time.perf_counter()
    # numpy, not tensors, between processes: tensors would travel as shared-memory handles (slower for these sizes).
    chunk.payload = tuple(t.numpy() for t in transform(chunk.payload, num_embeddings, user_transforms))
    chunk.busy["transform"] = time.perf_counter() - t0
    return chunk


def _assemble(chunks: list[_Chunk]) -> Delivered:
    error = next((c.error for c in chunks if c.error is not None), None)
    if error is not None:
        return Delivered(None, chunks[0].batch_start, chunks[0].batch_size, {}, [], 0, error)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    if len(chunks) == 1:
        dense, ids, labels = (torch.from_numpy(a) for a in chunks[0].payload)
    else:
        dense, ids, labels = (torch.from_numpy(np.concatenate(parts)) for parts in zip(*(c.payload for c in chunks)))
    batch = make_batch(dense, ids, labels)
    busy = {s: sum(c.busy.get(s, 0.0) for c in chunks) for s in STAGES}
    busy["assemble"] = time.perf_counter() - t0
    nbytes = dense.nbytes + ids.nbytes + labels.nbytes
    return Delivered(batch, chunks[0].batch_start, chunks[0].batch_size, busy,
                     [s for c in chunks for s in c.skipped], nbytes)


def _bind(fn: Any, *args: Any) -> Any:
    import functools

    return functools.partial(fn, *args)


def _walk(node: Any) -> list[Any]:
    """Every object of a ``torchdata.nodes`` graph reachable through ``_it`` and ``source``."""
    found, stack, seen = [], [node], set()
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        found.append(obj)
        stack.extend(getattr(obj, name, None) for name in ("_it", "source"))
    return found


def _processes(objs: list[Any]) -> list[multiprocessing.process.BaseProcess]:
    return [w for obj in objs for w in getattr(obj, "_workers", []) or []
            if isinstance(w, multiprocessing.process.BaseProcess)]


def shutdown_nodes(node: Any) -> None:
    """Stops every thread and worker process of a ``torchdata.nodes`` graph: all stop events first, worker
    processes given a second to exit (then terminated), then the threads joined."""
    objs = _walk(node)
    for obj in objs:
        for name in ("_stop", "_mp_stop"):
            event = getattr(obj, name, None)
            if event is not None and hasattr(event, "set"):
                event.set()
    # A worker exits only once its results are flushed into the pipe: drain the result queues meanwhile.
    queues = [q for obj in objs if isinstance(q := getattr(obj, "_intermed_q", None), multiprocessing.queues.Queue)]
    processes = _processes(objs)
    deadline = time.monotonic() + 2.0
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        drained = False
        for q in queues:
            try:
                q.get(timeout=0.005)
                drained = True
            except (queue.Empty, OSError, EOFError, ValueError):
                pass
        if not drained:
            for process in processes:
                process.join(timeout=0.005)
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=2.0)
    for obj in objs:
        if hasattr(obj, "_shutdown"):
            obj._shutdown()
    for obj in objs:  # a worker forked later inherits these objects: leave its finalizers nothing to wait for
        if getattr(obj, "_workers", None):
            obj._workers = []


def build_graph(source: CriteoTSV, rank: int, world_size: int, batch_size: int, start: int, config: PipelineConfig,
                chunk_rows: int, on_error: OnError = "raise", user_transforms: Sequence[UserTransform] = (),
                methods: dict[str, Method] | None = None) -> BaseNode[Delivered]:
    """The node graph that delivers this rank's batches from sample ``start`` on, under ``config``."""
    methods = {**DEFAULT_METHODS, **(methods or {})}
    node: BaseNode = _Plan(source, rank, world_size, batch_size, start, chunk_rows)
    fns = {"read": _read, "parse": _bind(_parse, on_error),
           "transform": _bind(_transform, list(source.num_embeddings), list(user_transforms))}
    for stage in ("read", "parse", "transform"):
        node = ParallelMapper(node, fns[stage], num_workers=getattr(config, stage), in_order=True,
                              method=methods[stage])
    node = ParallelMapper(_Group(node), _assemble, num_workers=config.assemble, in_order=True,
                          method=methods["assemble"])
    if config.prefetch > 0:
        node = Prefetcher(node, prefetch_factor=config.prefetch)
    return node


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
            ``stats.skipped``; its batch is one sample short).
        user_transforms: functions ``(dense, ids, labels) -> (dense, ids, labels)`` applied after the built-in
            transform (must be picklable by reference, e.g. module-level functions, for process workers).
        methods: per-stage ``"thread"`` or ``"process"`` (default: processes for parse and transform).
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
        return [p.pid for p in _processes(_walk(self._graph)) if p.is_alive()] if self._graph is not None else []

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
                    self.skipped_lines.extend(item.skipped)
                yield item.batch
        finally:
            self.close()


def pipelined_loader(source: CriteoTSV, rank: int, world_size: int, global_batch_size: int,
                     settings: dict[str, Any]) -> PipelinedLoader:
    """A :class:`PipelinedLoader` from a settings dict (``data.pipeline`` of the data module): workers per stage,
    ``prefetch``, and optionally ``chunk_rows`` and ``on_error``."""
    settings = dict(settings)
    extra = {k: settings.pop(k) for k in ("chunk_rows", "on_error") if k in settings}
    unknown = set(settings) - {*STAGES, "prefetch"}
    if unknown:
        raise ValueError(f"data.pipeline has unknown keys {sorted(unknown)}; use {[*STAGES, 'prefetch', 'chunk_rows', 'on_error']}.")
    return PipelinedLoader(source, rank, world_size, global_batch_size, PipelineConfig(**settings), **extra)
