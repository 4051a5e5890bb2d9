"""How long this process waits in collectives, and which work of an add-on to leave out of a step.

:func:`install` wraps the ``torch.distributed`` collectives that Python code calls (TorchRec's all-to-alls, Lightning's
and the strategy's reductions and broadcasts) so that each one's interval, from the call to its completion (for an
``async_op`` call: its future's completion), is recorded; :func:`collective_seconds` is the time covered by those
intervals between two instants (overlapping calls counted once). A rank that others wait for spends little time
there; the ranks waiting for it spend its lateness there. Collectives issued from C++ (DDP's gradient all-reduce)
are not seen.

:func:`add_on_work` marks work of an add-on (the resource advisor's fits, gathers and broadcasts) that runs inside
the training loop; :class:`~lightning_dlrover.monitor.ThroughputMonitor` takes it out of the step it fell in
(wall, thread-busy and collective seconds), so that what the advisor measures is not its own work.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

#: The collectives wrapped by :func:`install` (those of them ``torch.distributed`` has).
TRACED = ("all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
          "reduce_scatter_tensor", "broadcast", "barrier", "all_gather_object", "broadcast_object_list", "gather",
          "scatter", "reduce", "gather_object")

_intervals: deque[tuple[float, float]] = deque(maxlen=4096)  # (start, end) perf_counter seconds, by start
_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_users = [0]


def _record(start: float, end: float) -> None:
    with _lock:
        _intervals.append((start, end))


def _traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        future = None
        if kwargs.get("async_op") and result is not None:
            try:
                future = result.get_future()
            except (AttributeError, RuntimeError):  # a backend without futures: the call itself is what we see
                future = None
        if future is None:
            _record(start, time.perf_counter())
        else:
            future.then(lambda _: _record(start, time.perf_counter()))
        return result

    call.__lightning_dlrover_traced__ = fn  # type: ignore[attr-defined]
    return call


def install() -> None:
    """Starts timing collectives in this process (idempotent; one :func:`uninstall` per call ends it)."""
    import torch.distributed as dist

    _users[0] += 1
    if _originals:
        return
    for name in TRACED:
        fn = getattr(dist, name, None)
        if fn is not None and not hasattr(fn, "__lightning_dlrover_traced__"):
            _originals[name] = fn
            setattr(dist, name, _traced(fn))


def uninstall() -> None:
    """Undoes one :func:`install`; the last one restores ``torch.distributed``'s functions."""
    import torch.distributed as dist

    _users[0] = max(0, _users[0] - 1)
    if _users[0]:
        return
    for name, fn in _originals.items():
        setattr(dist, name, fn)
    _originals.clear()
    with _lock:
        _intervals.clear()


def installed() -> bool:
    """Whether collectives are being timed."""
    return bool(_originals)


def collective_seconds(start: float, end: float) -> float:
    """Seconds between ``start`` and ``end`` (``time.perf_counter()``) that this process had a collective in flight
    (a call made, not yet complete), overlapping collectives counted once."""
    with _lock:
        spans = sorted((max(a, start), min(b, end)) for a, b in _intervals if b > start and a < end)
    total, reach = 0.0, start
    for a, b in spans:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


@dataclass
class AddOnWork:
    """Seconds of add-on work not yet taken out of a step: wall, thread-busy (see
    :func:`~lightning_dlrover.monitor.steps.thread_busy_seconds`) and in collectives."""

    wall: float = 0.0
    busy: float = 0.0
    collective: float = 0.0


_add_on = AddOnWork()


@contextmanager
def add_on_work() -> Iterator[None]:
    """Marks the enclosed block as an add-on's own work (on the training thread): the step it runs in is measured
    without it. Nested blocks count once."""
    from lightning_dlrover.monitor.steps import thread_busy_seconds

    if getattr(_depth, "n", 0):
        yield
        return
    _depth.n = 1
    start, busy = time.perf_counter(), thread_busy_seconds()
    try:
        yield
    finally:
        _depth.n = 0
        end = time.perf_counter()
        _add_on.wall += end - start
        _add_on.busy += max(0.0, thread_busy_seconds() - busy)
        _add_on.collective += collective_seconds(start, end) if installed() else 0.0


_depth = threading.local()


def pop_add_on_work() -> AddOnWork:
    """The add-on work since the last call, and start afresh."""
    global _add_on
    out, _add_on = _add_on, AddOnWork()
    return out


def add_on_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates a callback hook whose whole run is add-on work (see :func:`add_on_work`)."""

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        with add_on_work():
            return hook(*args, **kwargs)

    return run
