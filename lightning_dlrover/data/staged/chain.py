"""The pipeline as a chain of worker processes (used when assemble has workers in processes: see
:func:`~lightning_dlrover.data.staged.config.chained`).

Each stage with workers has that many processes; they take whole batches (a rank's chunks of one global batch)
from the queue of their stage and put what they made on the next stage's, so work passes from process to process
without going through the training process. A stage without workers runs in the processes of the next stage that
has some. The training process only plans (the chunks' byte ranges: a few hundred bytes per batch) and receives
assembled batches (numpy arrays through a pipe; :class:`~lightning_dlrover.data.staged.graph._Assembled`), which it
puts back in order by their sequence number. At most ``2 x workers`` batches are in flight; a rebuild (a
reconfiguration, a resume) starts a new chain at the loader's position, so order and resumption are the loader's.
"""

from __future__ import annotations

import functools
import os
import queue
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp
from torch._utils import ExceptionWrapper
from torchdata.nodes import BaseNode

from lightning_dlrover.data.staged.config import STAGES, PipelineConfig
from lightning_dlrover.data.staged.graph import Delivered, _Assembled, _Chunk, _pack
from lightning_dlrover.log import get_logger

log = get_logger(__name__)
_POLL_S = 0.1
#: Seconds a started worker process has to say it runs before it is taken for stuck in its fork and started again
#: (``$LIGHTNING_DLROVER_WORKER_START_S``); tries before the chain gives up.
START_S_ENV = "LIGHTNING_DLROVER_WORKER_START_S"
_START_TRIES = 3


def _each(fn: Callable[[_Chunk], _Chunk], chunks: list[_Chunk]) -> list[_Chunk]:
    return [fn(c) for c in chunks]


def _run(fns: Sequence[Callable[[Any], Any]], work: Any) -> Any:
    for fn in fns:
        work = fn(work)
    return work


def _worker(stage: str, fns: Sequence[Callable[[Any], Any]], in_q: Any, out_q: Any, stop: Any, parent: int,
            started: Any = None) -> None:
    """One worker process of ``stage``: says it runs on ``started`` (a pipe's end), then applies its (fused) stage
    functions to each batch of ``in_q``."""
    if started is not None:
        started.send_bytes(b"up")
        started.close()
    torch.set_num_threads(1)
    out_q.cancel_join_thread()  # a chain being stopped drops what it has not handed on
    while not stop.is_set() and os.getppid() == parent:
        try:
            seq, work = in_q.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        if not isinstance(work, ExceptionWrapper):
            try:
                work = _run(fns, work)
            except Exception:
                work = ExceptionWrapper(where=f"in the data pipeline's {stage} worker process")
        out_q.put((seq, work))


class ProcessChain(BaseNode[Delivered]):
    """The batches of ``source`` (a rank's chunks of each global batch, in order) read, parsed, transformed and
    assembled by a chain of worker processes, delivered in order (see the module docstring)."""

    def __init__(self, source: BaseNode[list[_Chunk]], config: PipelineConfig, stage_fns: dict[str, Callable]):
        super().__init__()
        if config.assemble < 1:
            raise ValueError(f"ProcessChain needs assemble workers; {config.short()} has none.")
        self.source, self.config, self.stage_fns = source, config, stage_fns
        self._workers: list[Any] = []
        self._in_q: Any = None  # written here (shutdown_nodes empties it); _out_q is read here and never drained:
        self._out_q: Any = None  # a worker stopped mid-write leaves half an item there, and the chain is dropped
        self._mp_stop: Any = None

    def _segments(self) -> list[tuple[str, int, list[Callable]]]:
        """(stage, workers, functions it runs) for each stage with workers, the stages without fused into them."""
        segments, pending = [], []
        for stage in STAGES:
            fn = _pack if stage == "assemble" else functools.partial(_each, self.stage_fns[stage])
            pending.append(fn)
            if self.config.workers[stage] > 0:
                segments.append((stage, self.config.workers[stage], pending))
                pending = []
        return segments

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._shutdown()
        self.source.reset()
        self._fed = self._next = 0
        self._done: dict[int, Any] = {}
        self._exhausted = False
        segments = self._segments()
        self._cap = 2 * sum(w for _, w, _ in segments)
        self._mp_stop = mp.Event()
        queues = [mp.Queue() for _ in range(len(segments) + 1)]
        self._in_q, self._out_q, self._between = queues[0], queues[-1], queues[1:-1]
        self._stage_of: dict[int, str] = {}
        starting = [self._fork(stage, fns, queues[k], queues[k + 1])
                    for k, (stage, workers, fns) in enumerate(segments) for _ in range(workers)]
        for started in starting:
            p = self._await_start(*started)
            self._workers.append(p)
            self._stage_of[p.pid] = started[0]

    def _fork(self, stage: str, fns: list[Callable], in_q: Any, out_q: Any) -> tuple:
        reader, writer = mp.Pipe(duplex=False)
        p = mp.Process(target=_worker, args=(stage, fns, in_q, out_q, self._mp_stop, os.getpid(), writer), daemon=True)
        p.start()
        writer.close()
        return stage, fns, in_q, out_q, p, reader

    def _await_start(self, stage: str, fns: list[Callable], in_q: Any, out_q: Any, p: Any, reader: Any) -> Any:
        """``p`` once it says it runs. A child forked while another thread of this process was creating or deleting
        its thread state can hang in CPython's after-fork code (3.11) before any of its Python runs: seen once in ~50
        chain rebuilds of a 2-rank job, whose rank then waited for its batch forever. Such a child is killed and
        forked again."""
        timeout = float(os.environ.get(START_S_ENV, "10"))
        for attempt in range(1, _START_TRIES + 1):
            if attempt > 1:
                *_, p, reader = self._fork(stage, fns, in_q, out_q)
            if reader.poll(timeout):  # a child that died at once reads as ready; next() reports it
                reader.close()
                return p
            reader.close()
            p.kill()
            p.join(timeout=5.0)
            again = "started it again" if attempt < _START_TRIES else "giving up"
            log.warning(f"a data pipeline {stage} worker process (pid {p.pid}) did not start within {timeout:g} s "
                        f"(stuck in its fork); {again} (try {attempt} of {_START_TRIES})")
        raise RuntimeError(
            f"the data pipeline's {stage} worker process did not start within {timeout:g} s in {_START_TRIES} tries; "
            f"if the machine is only very busy, raise ${START_S_ENV}, else run the stages inline (data.pipeline: "
            "all 0).")

    def _top_up(self) -> None:
        while not self._exhausted and self._fed - self._next < self._cap:
            try:
                chunks = next(self.source)
            except StopIteration:
                self._exhausted = True
                return
            self._in_q.put((self._fed, chunks))
            self._fed += 1

    def next(self) -> Delivered:
        self._top_up()
        while self._next not in self._done:
            if self._next >= self._fed:
                raise StopIteration
            try:
                seq, item = self._out_q.get(timeout=_POLL_S)
            except queue.Empty:
                if self._mp_stop.is_set():  # being shut down (e.g. from another thread than this prefetching one)
                    raise StopIteration from None
                dead = [p for p in self._workers if not p.is_alive()]
                if dead:
                    p = dead[0]
                    raise RuntimeError(
                        f"the data pipeline's {self._stage_of.get(p.pid, '?')} worker process (pid {p.pid}) exited "
                        f"with code {p.exitcode} (e.g. killed for memory); lower the pipeline's workers or its "
                        "memory_mb budget, or run the stages inline (data.pipeline: all 0).") from None
                continue
            self._done[seq] = item
        item = self._done.pop(self._next)
        self._next += 1
        self._top_up()
        if isinstance(item, ExceptionWrapper):
            item.reraise()
        assert isinstance(item, _Assembled)
        return item.delivered()

    def get_state(self) -> dict[str, Any]:
        return {}  # the loader resumes from its sample position (a new chain), not from this node's state

    def _shutdown(self) -> None:
        """Stops the worker processes and closes the queues (what :func:`~.graph.shutdown_nodes` has not done)."""
        if self._mp_stop is not None:
            self._mp_stop.set()
        for q in (self._in_q, self._out_q, *getattr(self, "_between", [])):
            if q is not None:
                q.cancel_join_thread()
        for p in self._workers:
            p.join(timeout=2 * _POLL_S + 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
        for q in (self._in_q, self._out_q, *getattr(self, "_between", [])):
            if q is not None:
                q.close()
        self._workers, self._in_q, self._out_q, self._between = [], None, None, []

    def __del__(self) -> None:
        try:
            self._shutdown()
        except Exception:  # at interpreter exit the queues may be gone already
            pass
