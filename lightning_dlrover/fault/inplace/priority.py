"""The CPU priority of hot spares: the lowest while they wait, the ranks' own once one takes a lost rank.

A hot spare imports torch, Lightning and TorchRec beside the ranks it may one day replace; on a machine whose cores
the ranks use, that start-up competes with training. The launcher starts its spares under Linux's ``SCHED_IDLE``
policy (they run only on a core nobody else wants) and a spare handed a rank is switched back to ``SCHED_OTHER``,
every one of its threads, by the launcher as it hands it the rank (:func:`restore` with its pid: a spare still importing on a busy
machine would otherwise finish its start-up at idle priority) and again by itself (:func:`restore`); its nice value,
the launcher's, is unchanged by the switches.

``SCHED_IDLE`` ranks a thread only against the threads of its own scheduling group, and every worker runs in a session
of its own (as under ``torchrun``), which Linux's autogroup scheduler makes a group of its own with an equal share of
the CPU. So a waiting spare's group is also given the lowest weight (autogroup nice 19, ``/proc/<pid>/autogroup``) and a
promoted spare gives its group the ranks' weight again (nice 0; lowering a group's nice to 0 needs no privilege). Where
the kernel has no autogroups (or they are off) ``SCHED_IDLE`` alone does it.

Leaving ``SCHED_IDLE`` is a privilege: the kernel allows it only with ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` hard limit
of at least ``20 - nice`` (``ulimit -e``). Without either, a promoted spare would train at idle priority and slow the
whole job down, so the launcher then starts its spares at normal priority and says why once
(:func:`can_restore`).
"""

from __future__ import annotations

import os
import resource
import time

#: The capability that lets a process raise its scheduling priority (bit 23 of ``CapEff``).
CAP_SYS_NICE = 23


def _has_cap_sys_nice() -> bool:
    try:
        with open("/proc/self/status") as status:
            caps = next((line.split()[1] for line in status if line.startswith("CapEff:")), "0")
        return bool(int(caps, 16) >> CAP_SYS_NICE & 1)
    except OSError:
        return False


def can_restore() -> str | None:
    """``None`` when a process started by this one could leave ``SCHED_IDLE`` again; else why it could not."""
    if not hasattr(os, "SCHED_IDLE"):
        return "this OS has no SCHED_IDLE scheduling policy"
    if _has_cap_sys_nice():
        return None
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    _, hard = resource.getrlimit(resource.RLIMIT_NICE)
    if hard == resource.RLIM_INFINITY or hard >= 20 - nice:
        return None
    return (f"leaving SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE hard limit >= {20 - nice} (it is {hard}; "
            f"raise it with `ulimit -e {20 - nice}` as root, or `nice` in /etc/security/limits.conf)")


def lower(pid: int) -> str | None:
    """Puts process ``pid`` (a spare just started: one thread) under ``SCHED_IDLE``, its autogroup at the lowest
    weight; ``None``, or why not."""
    set_group_nice(pid, IDLE_GROUP_NICE)
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except OSError as err:
        return f"the OS refused SCHED_IDLE ({err})"
    return None


#: The autogroup nice of a waiting spare's session (the lowest weight, 15 against a rank's 1024).
IDLE_GROUP_NICE = 19


def group_nice(pid: int | str = "self") -> int | None:
    """The nice value of process ``pid``'s autogroup; ``None`` without autogroups."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return int(f.read().split("nice")[1])
    except (OSError, IndexError, ValueError):
        return None


def set_group_nice(pid: int | str, nice: int, tries: int = 30) -> bool:
    """Sets the nice value of process ``pid``'s autogroup (its session's CPU weight); whether it did. The kernel
    accepts one change every 0.1 s from a process without ``CAP_SYS_ADMIN`` (``EAGAIN``): retried ``tries`` times;
    none is made when the group already has ``nice`` (a spare forked from the zygote lowers its own group first)."""
    if group_nice(pid) == nice:
        return True
    for _ in range(tries):
        try:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(nice))
            return True
        except BlockingIOError:
            time.sleep(0.1)
        except OSError:  # no autogroups, or the process ended
            return False
    return False


def restore(pid: int | None = None) -> str | None:
    """Puts every thread of process ``pid`` (default: this process) back under ``SCHED_OTHER`` if it is under
    ``SCHED_IDLE`` and its autogroup back to nice 0; ``None``, or why it could not (the process then runs at idle
    priority). The launcher calls it with a spare's pid as it hands the spare a rank (a spare still importing on a busy
    machine would otherwise finish its start-up at idle priority, maybe for minutes); the spare calls it again itself."""
    target = "self" if pid is None else pid
    if (group_nice(target) or 0) > 0:
        set_group_nice(target, 0)
    if not hasattr(os, "SCHED_IDLE"):
        return None
    try:
        threads = [int(tid) for tid in os.listdir(f"/proc/{target}/task")]
    except OSError:
        threads = [pid or 0]
    try:
        _raise_nice_limit(pid or 0)
    except (OSError, ValueError):
        pass  # the check below says what the OS refused
    for tid in threads:
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except OSError as err:
            return f"the OS refused SCHED_OTHER ({err})"
    return None


def _raise_nice_limit(pid: int) -> None:
    """Raises process ``pid``'s (0: this one's) soft ``RLIMIT_NICE`` to the hard one (the kernel checks the soft
    limit)."""
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NICE)
    if soft != hard:
        resource.prlimit(pid, resource.RLIMIT_NICE, (hard, hard))
