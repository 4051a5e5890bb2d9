"""Stage 3 of one running job: per-rank windows of measured steps gathered every few steps, fed to the detectors,
and the measured per-table load behind hot ranks and the re-plan advice."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import psutil
import torch.distributed as dist

from lightning_dlrover import control_plane
from lightning_dlrover.advisor.detectors import (
    OOMForecaster,
    RankWindow,
    StepSample,
    StragglerDetector,
    communication_message,
    hot_ranks,
)
from lightning_dlrover.advisor.replan import LookupCounter, ReplanAdvice, rank_loads, replan
from lightning_dlrover.advisor.signature import TableSpec

#: Called with (message, event kind or None, global step, event fields) for every finding.
Report = Callable[[str, "str | None", int, dict[str, Any]], None]


class PeerFailed(RuntimeError):
    """Raised on every rank at an advisor collective some rank joined as failed: the advisor steps back everywhere."""


_held = [0]  # collectives this process joined through :func:`meet` (the advisor counts those of one hook)


def held() -> int:
    """How many advisor collectives this process has joined so far."""
    return _held[0]


def meet(world_size: int, value: Any, failed: bool = False) -> list[Any]:
    """Every rank's ``value`` (one ``all_gather_object`` when ``world_size > 1``), each sent with whether its
    advisor failed; raises :class:`PeerFailed` (after the collective) when any rank did, on every rank alike."""
    _held[0] += 1
    if world_size == 1 or not dist.is_initialized():
        out = [(failed, value)]
    else:
        out = [None] * world_size
        dist.all_gather_object(out, (failed, value), group=control_plane.group())
    bad = [rank for rank, (f, _) in enumerate(out) if f]
    if bad:
        raise PeerFailed(f"the advisor failed on rank(s) {bad}; it steps back on every rank to keep them in step")
    return [v for _, v in out]


def gather(world_size: int, value: Any) -> list[Any]:
    """Every rank's ``value`` (a collective when ``world_size > 1``; see :func:`meet`)."""
    return meet(world_size, value)


def broadcast(world_size: int, value: Any) -> Any:
    """Rank 0's ``value`` on every rank (an all-gather, so that every rank also says whether it failed: :func:`meet`)."""
    return meet(world_size, value)[0]


def children_memory() -> tuple[tuple[int, float], ...]:
    """``(pid, resident bytes)`` of every process descending from this one (data workers; under Lightning's launcher
    rank 0's descendants are also the other ranks of its node and theirs: sum them with
    :func:`~lightning_dlrover.advisor.detectors.node_children_bytes`, which counts each process once)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            out.append((child.pid, float(child.memory_info().rss)))
        except psutil.Error:
            pass
    return tuple(out)


def node_total_bytes(processes: Iterable[tuple[int, float, Iterable[tuple[int, float]]]]) -> float:
    """Memory of one node's ranks, each process counted once, from every rank's ``(pid, resident bytes,
    children_memory())``."""
    processes = list(processes)
    unique = {pid: value for _, _, children in processes for pid, value in children}
    unique.update({pid: value for pid, value, _ in processes})
    return float(sum(unique.values()))


def cpu_snapshot(machine_wide: bool) -> tuple[float, float, float]:
    """``(job, busy, wall)``: CPU seconds of this process and its children (data workers), CPU seconds the machine's
    cores this process may use were busy (``machine_wide`` only, else 0), and ``time.perf_counter()``. Differences
    of two snapshots give the cores other programs took: ``(busy - job of every rank on the node) / wall``."""
    proc = psutil.Process()
    times = proc.cpu_times()
    job = times.user + times.system
    for child in proc.children(recursive=True):
        try:
            t = child.cpu_times()
            job += t.user + t.system
        except psutil.Error:
            pass
    busy = 0.0
    if machine_wide:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        for cpu, t in enumerate(psutil.cpu_times(percpu=True)):
            if allowed is None or cpu in allowed:
                busy += t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return job, busy, time.perf_counter()


def background_cores(stats: Sequence[Sequence[float]], ranks_per_node: int, cores: float) -> float:
    """Cores other programs kept busy, mean over nodes, from every rank's ``[job cpu s, busy s, wall s]`` deltas
    (busy measured by each node's first rank only); within ``[0, cores - 0.25]``."""
    values = []
    for node in range(0, len(stats), ranks_per_node):
        group = stats[node : node + ranks_per_node]
        wall = group[0][2]
        if wall > 0:
            values.append((group[0][1] - sum(s[0] for s in group)) / wall)
    return min(max(sum(values) / len(values), 0.0), cores - 0.25) if values else 0.0


def checkpoint_staging_bytes(trainer: Any) -> float:
    """The memory the trainer's strategy will allocate for its next checkpoint save and does not hold yet
    (``DLRoverStrategy.checkpoint_staging_bytes``; 0 for other strategies)."""
    measure = getattr(trainer.strategy, "checkpoint_staging_bytes", None)
    return float(measure()) if callable(measure) else 0.0


class RuntimeWatch:
    """Collects this rank's steps, and at every :meth:`check` gathers all ranks' windows and runs the detectors
    (findings are reported on rank 0)."""

    def __init__(self, stragglers: StragglerDetector, oom: OOMForecaster, hot_factor: float,
                 tables: Sequence[TableSpec], features: Mapping[str, Sequence[str]],
                 placement: Mapping[str, list], report: Report) -> None:
        self.stragglers, self.oom, self.hot_factor = stragglers, oom, hot_factor
        self.tables, self.features, self.placement, self.report = tuple(tables), features, placement, report
        rows = {t.name: (t.rows, list(features.get(t.name, [t.name]))) for t in tables}
        self.lookups = LookupCounter(rows) if rows else None
        self.global_counts = None
        self._steps: list[StepSample] = []
        self._hot_reported: set[int] = set()
        #: Straggler checks skip windows starting at or before this step: the advisor's probes and changes (a data
        #: loader restarting with other workers, a thread pool resizing) slow ranks unevenly for a few steps.
        self.quiet_until = 0

    def add_step(self, sample: StepSample) -> None:
        self._steps.append(sample)

    def check(self, rank: int, ranks_per_node: int, world_size: int, step: int, staging_bytes: float = 0.0) -> None:
        """Gathers every rank's window since the last check (collective) and runs the detectors on rank 0
        (``staging_bytes``: this rank's memory for its next checkpoint save not allocated yet, see
        :func:`checkpoint_staging_bytes`)."""
        steps, self._steps = self._steps, []
        local = RankWindow.from_steps(rank, rank // ranks_per_node, steps, os.getpid(),
                                      children_memory()) if steps else None
        if local is not None and staging_bytes:
            local = replace(local, staging_bytes=float(staging_bytes))
        counts = self.lookups.counts.clone() if self.lookups is not None else None
        gathered = gather(world_size, (local, counts))
        if rank != 0:
            return
        windows = [w for w, _ in gathered if w is not None]
        if len(windows) == len(gathered) and windows[0].first_step > self.quiet_until:
            for s in self.stragglers.update(windows):
                self.report(s.message(), "straggler", step, dict(straggler_rank=s.rank, cause=s.cause, ratio=s.ratio,
                                                                  excess_ms=s.excess_ms, since_step=s.since_step))
            if (comm := self.stragglers.communication_bound(windows)) is not None:
                step_s = max(w.step_s for w in windows)
                nodes = len({w.node for w in windows})
                self.report(communication_message(comm, step_s, nodes), "straggler", step,
                            dict(straggler_rank=-1, cause="communication", ratio=comm / step_s, excess_ms=1000 * comm,
                                 since_step=windows[0].first_step))
        if windows:
            for f in self.oom.update(windows, max(w.step_s for w in windows)):
                self.report(f.message(), "oom_forecast", step, dict(
                    node=f.node, rss_bytes=f.rss_bytes, limit_bytes=f.limit_bytes, steps_to_oom=f.steps_to_oom,
                    growth_bytes_per_step=f.growth_bytes_per_step, seconds_to_oom=f.seconds_to_oom,
                    staging_bytes=f.staging_bytes))
        if self.lookups is not None and gathered[0][1] is not None:
            self.global_counts = sum(c for _, c in gathered)
            if self.placement:
                self._hot_ranks(world_size, step)

    def measured_tables(self) -> tuple[TableSpec, ...]:
        """The tables with their measured pooling factors (1.0 where nothing was measured)."""
        if self.lookups is None or self.global_counts is None:
            return self.tables
        factors = self.lookups.pooling_factors(self.global_counts)
        return tuple(replace(t, pooling_factor=factors.get(t.name, t.pooling_factor)) for t in self.tables)

    def _hot_ranks(self, world_size: int, step: int) -> None:
        tables = {t.name: t for t in self.measured_tables()}
        loads = rank_loads(self.placement, tuple(tables.values()), world_size)
        per_rank: dict[int, list[tuple[str, float]]] = {}
        for name, shards in self.placement.items():
            if name in tables:
                for rank, *_ in shards:
                    per_rank.setdefault(rank, []).append((name, tables[name].pooling_factor * tables[name].dim))
        for hot in hot_ranks(loads, per_rank, self.hot_factor):
            if hot.rank not in self._hot_reported:
                self._hot_reported.add(hot.rank)
                self.report(hot.message(), "hot_rank", step, dict(hot_rank=hot.rank, share=hot.share, ratio=hot.ratio,
                                                                  tables=list(hot.tables[:5])))

    def replan(self, world_size: int, local_world_size: int, batch_per_rank: int, sharding_types: Sequence[str],
               device: str) -> ReplanAdvice | None:
        """Re-plan advice from the measured pooling factors (``None`` before any check or without a plan)."""
        if self.lookups is None or not self.placement or self.global_counts is None:
            return None
        return replan(self.measured_tables(), self.features, world_size, local_world_size, batch_per_rank,
                      sharding_types or ("table_wise",), device=device, current_placement=self.placement,
                      hot_shares=self.lookups.hot_shares(self.global_counts))
