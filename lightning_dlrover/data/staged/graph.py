"""The ``torchdata.nodes`` graph of the data pipeline (see :mod:`lightning_dlrover.data.staged`): the work items
that flow through it, each stage's function, how the graph is built and how its threads and processes are stopped.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.queues
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode, ParallelMapper, Prefetcher
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_dlrover.data.sources import SPARSE_NAMES, CriteoTSV, rank_slice
from lightning_dlrover.data.staged.config import DEFAULT_METHODS, STAGES, Method, PipelineConfig, chained
from lightning_dlrover.data.tsv_parse import MalformedLine, OnError, RawRows, UserTransform, parse_block, transform


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
    skipped: list[tuple[str, int, str]] = field(default_factory=list)  # (path, line, reason) of dropped lines
    error: tuple[str, int, str, bytes] | None = None  # a malformed line: (path, line, reason, text)


@dataclass
class Delivered:
    """An assembled batch and what it cost: ``busy`` seconds per stage, ``skipped`` (file, line, reason) of the
    malformed lines dropped from it."""

    batch: Batch
    batch_start: int
    batch_size: int
    busy: dict[str, float]
    skipped: list[tuple[str, int, str]]
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
        chunk.skipped.extend((path, line, reason) for line, reason in zip(raw.skipped, raw.skip_reasons))
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


@dataclass
class _Assembled:
    """An assembled batch as numpy arrays and the ``KeyedJaggedTensor``'s per-key sums: what an assemble worker
    process sends (pickled arrays through the pipe cost the receiving process less than shared-memory tensors at
    these sizes: ``bench/README.md``), turned into the ``Batch`` by :meth:`delivered` without a tensor operation."""

    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None  # dense, values (key-major), lengths, labels
    keys: list[str]
    length_per_key: list[int]
    batch_start: int
    batch_size: int
    busy: dict[str, float]
    skipped: list[tuple[str, int, str]]
    error: tuple[str, int, str, bytes] | None = None

    def delivered(self) -> Delivered:
        if self.error is not None:
            return Delivered(None, self.batch_start, self.batch_size, {}, [], 0, self.error)  # type: ignore[arg-type]
        dense, values, lengths, labels = (torch.from_numpy(a) for a in self.arrays)
        offsets = [0]
        for n in self.length_per_key:
            offsets.append(offsets[-1] + n)
        # What KeyedJaggedTensor.from_lengths_sync (make_batch) builds, the sums computed by the assembler.
        rows = len(labels)
        kjt = KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths, stride=rows,
                                stride_per_key=[rows] * len(self.keys), length_per_key=self.length_per_key,
                                offset_per_key=offsets)
        nbytes = dense.nbytes + values.nbytes + labels.nbytes
        return Delivered(Batch(dense_features=dense, sparse_features=kjt, labels=labels), self.batch_start,
                         self.batch_size, self.busy, self.skipped, nbytes)


def _pack(chunks: list[_Chunk]) -> _Assembled:
    """Assembles one rank's batch from its chunks in numpy (the work of the assemble stage)."""
    first = chunks[0]
    skipped = [s for c in chunks for s in c.skipped]
    error = next((c.error for c in chunks if c.error is not None), None)
    if error is not None:
        return _Assembled(None, [], [], first.batch_start, first.batch_size, {}, skipped, error)
    t0 = time.perf_counter()
    if len(chunks) == 1:
        dense, ids, labels = first.payload
    else:
        dense, ids, labels = (np.concatenate(parts) for parts in zip(*(c.payload for c in chunks)))
    rows, num_sparse = ids.shape
    values = np.ascontiguousarray(ids.T).reshape(-1)
    lengths = np.ones(num_sparse * rows, dtype=np.int32)
    length_per_key = lengths.reshape(num_sparse, rows).sum(axis=1).tolist()
    busy = {s: sum(c.busy.get(s, 0.0) for c in chunks) for s in STAGES}
    busy["assemble"] = time.perf_counter() - t0
    return _Assembled((np.ascontiguousarray(dense), values, lengths, np.ascontiguousarray(labels)),
                      SPARSE_NAMES[:num_sparse], length_per_key, first.batch_start, first.batch_size, busy, skipped)


def _assemble(chunks: list[_Chunk]) -> Delivered:
    return _pack(chunks).delivered()


def _bind(fn: Any, *args: Any) -> Any:
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


def worker_processes(node: Any) -> list[multiprocessing.process.BaseProcess]:
    """The stage worker processes of a ``torchdata.nodes`` graph."""
    return _processes(_walk(node))


def _mp_queues(objs: list[Any], names: tuple[str, ...] = ("_in_q", "_intermed_q")) -> list[multiprocessing.queues.Queue]:
    """The queues between this process and worker processes (``_in_q``: written here, ``_intermed_q``: read here)."""
    return [q for obj in objs for name in names
            if isinstance(q := getattr(obj, name, None), multiprocessing.queues.Queue)]


def _drain(queues: list[multiprocessing.queues.Queue], timeout: float) -> bool:
    """Takes one item from each queue that has one within ``timeout``; whether any had one."""
    drained = False
    for q in queues:
        try:
            q.get(timeout=timeout)
            drained = True
        except (queue.Empty, OSError, EOFError, ValueError):
            pass
    return drained


def shutdown_nodes(node: Any, wait_s: float = 2.0) -> None:
    """Stops every thread and worker process of a ``torchdata.nodes`` graph: all stop events first, worker
    processes given ``wait_s`` to exit (then terminated), the queues between processes emptied and closed, then
    the threads joined.

    Nothing is left for the interpreter's exit to wait on: a queue's feeder thread in this process may be half-way
    through writing an item (a 655 KB block of parsed rows) into a pipe that no worker reads any more, and
    multiprocessing joins feeder threads at exit; so their joins are cancelled and the queues read empty here."""
    objs = _walk(node)
    for obj in objs:
        for name in ("_stop", "_mp_stop"):
            event = getattr(obj, name, None)
            if event is not None and hasattr(event, "set"):
                event.set()
    queues = _mp_queues(objs)
    for q in queues:
        q.cancel_join_thread()
    processes = _processes(objs)
    # A worker exits once its input queue is empty and its results are flushed into the pipe: read both meanwhile.
    deadline = time.monotonic() + wait_s
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        if not _drain(queues, 0.005):
            for process in processes:
                process.join(timeout=0.005)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=wait_s)
        if process.is_alive():
            process.kill()
            process.join(timeout=wait_s)
    # No worker reads now: empty what this process's feeder threads still hold (each read lets one write finish).
    # Only the queues written here: a result queue may hold half an item from a terminated worker.
    inputs, deadline, timeout = _mp_queues(objs, ("_in_q",)), time.monotonic() + wait_s, 0.002
    while time.monotonic() < deadline and _drain(inputs, timeout):
        timeout = 0.02  # a feeder thread had items: give it time to write the next
    for q in queues:
        q.close()
    for obj in objs:
        if hasattr(obj, "_shutdown"):
            obj._shutdown()
    for obj in objs:  # a worker forked later inherits these objects: leave its finalizers nothing to wait for
        if getattr(obj, "_workers", None):
            obj._workers = []


def build_graph(source: CriteoTSV, rank: int, world_size: int, batch_size: int, start: int, config: PipelineConfig,
                chunk_rows: int, on_error: OnError = "raise", user_transforms: Sequence[UserTransform] = (),
                methods: dict[str, Method] | None = None) -> BaseNode[Delivered]:
    """The node graph that delivers this rank's batches from sample ``start`` on, under ``config``: a
    ``ParallelMapper`` per stage, or, when assemble has workers in processes, a
    :class:`~lightning_dlrover.data.staged.chain.ProcessChain`; then a ``Prefetcher`` if ``config.prefetch``."""
    methods = {**DEFAULT_METHODS, **(methods or {})}
    node: BaseNode = _Plan(source, rank, world_size, batch_size, start, chunk_rows)
    fns = {"read": _read, "parse": _bind(_parse, on_error),
           "transform": _bind(_transform, list(source.num_embeddings), list(user_transforms))}
    if chained(config, methods):  # worker processes pass batches to each other; this process only receives
        from lightning_dlrover.data.staged.chain import ProcessChain

        node = ProcessChain(_Group(node), config, fns)
    else:
        for stage in ("read", "parse", "transform"):
            node = ParallelMapper(node, fns[stage], num_workers=getattr(config, stage), in_order=True,
                                  method=methods[stage])
        node = ParallelMapper(_Group(node), _assemble, num_workers=config.assemble, in_order=True,
                              method=methods["assemble"])
    if config.prefetch > 0:
        node = Prefetcher(node, prefetch_factor=config.prefetch)
    return node
