"""What this machine lets the process use, read in one place: its cores (affinity mask capped by a cgroup CPU quota)
and its memory (cgroup limit, else physical memory).

Every package that sizes something by the machine (the data pipeline's start, the pipeline tuner's budget, the hot
spare's set-up, the advisor) asks here, so a container limited to 2 CPUs of a 64-core host is seen as 2 cores by all.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

#: Where the cgroup files are read: v2 ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``) and ``memory.max``,
#: else v1 ``cpu/cpu.cfs_quota_us`` + ``cpu/cpu.cfs_period_us`` and ``memory/memory.limit_in_bytes``.
CGROUP_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # a v1 memory limit this large means none


def affinity_cores() -> int:
    """Cores this process may be scheduled on (its CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup's CPU quota in cores (``None``: no quota, or no cgroup files readable)."""
    try:
        text = (root / "cpu.max").read_text().split()
        return None if text[0] == "max" else int(text[0]) / int(text[1])
    except (OSError, ValueError, IndexError, ZeroDivisionError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def available_cores(root: Path = CGROUP_ROOT) -> int:
    """Cores this process may use: the affinity mask, capped by a cgroup CPU quota (at least 1)."""
    cores = affinity_cores()
    if (quota := cpu_quota(root)) is not None:
        cores = min(cores, max(1, int(quota)))
    return max(1, cores)


def memory_limit_bytes(root: Path = CGROUP_ROOT) -> int:
    """The memory this process's cgroup may use, or the machine's physical memory when there is no limit."""
    physical = psutil.virtual_memory().total
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
            if text != "max" and int(text) < _NO_LIMIT:
                return min(int(text), physical)
        except (OSError, ValueError):
            continue
    return physical
