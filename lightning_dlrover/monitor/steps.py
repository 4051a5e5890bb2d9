"""One training step of one rank as a record (what :class:`ThroughputMonitor` measured), for the resource advisor."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

_SCHEDSTAT = Path("/proc/thread-self/schedstat")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class StepRecord:
    """One training step on this rank.

    Attributes:
        index: 1-based count of training steps this monitor measured in the current fit.
        start_time: Unix time (seconds) at which the step's forward began (after its data wait): when this rank
            was ready to compute. Comparable across ranks of one machine; across machines, up to clock skew.
        seconds: wall time of the step, data wait included.
        samples: samples in this rank's batch.
        sections: wall seconds per section (``data_wait``, ``forward``, ``backward``, ``optimizer``, strategy
            sections such as ``parity``).
        busy_seconds: time the main thread was running or runnable (on-CPU plus run-queue wait where the kernel
            reports it, else on-CPU) from the start of the forward to the end of the step: its own compute, as
            opposed to time blocked waiting (on peers in a collective, on I/O, asleep).
        rss_bytes: resident set size of the process at the end of the step.
        data_busy_seconds: like ``busy_seconds``, over the data wait (the loader's work in this process, callbacks
            between steps), as opposed to waiting there (for worker processes, storage, or peers: Lightning
            synchronises ranks once between two steps).
        collective_seconds: wall seconds of the step (data wait included) with a collective of this process in
            flight (:mod:`~lightning_dlrover.monitor.collectives`; 0 unless they are timed): waiting for peers and
            transfers. The rank the others wait for has the least.
        add_on_seconds: wall seconds of add-on work (the resource advisor's) taken out of this step's ``seconds``,
            ``data_wait``, busy and collective seconds.
    """

    index: int
    start_time: float
    seconds: float
    samples: int
    sections: dict[str, float] = field(default_factory=dict)
    busy_seconds: float = 0.0
    rss_bytes: int = 0
    data_busy_seconds: float = 0.0
    collective_seconds: float = 0.0
    add_on_seconds: float = 0.0


def thread_busy_seconds() -> float:
    """Seconds the calling thread has been on a CPU or waiting for one (``/proc/thread-self/schedstat``, when
    the kernel keeps those statistics), else its CPU time."""
    try:
        on_cpu, run_wait, _ = _SCHEDSTAT.read_text().split()
        total = int(on_cpu) + int(run_wait)
        if total > 0:
            return total / 1e9
    except (OSError, ValueError):
        pass
    return time.thread_time()


def rss_bytes() -> int:
    """Resident set size of this process (``/proc/self/statm``; psutil elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process().memory_info().rss
