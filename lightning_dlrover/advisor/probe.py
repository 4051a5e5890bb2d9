"""Stage 2's profiling window: which configurations a running job tries, and what each measured."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from lightning_dlrover.advisor.resources import Machine, ResourceConfig, SearchSpace


def probe_schedule(current: ResourceConfig, machine: Machine, space: SearchSpace, can_set_workers: bool,
                   can_set_batch: bool, max_probes: int) -> list[ResourceConfig]:
    """Configurations to try in the running job, one knob at a time from ``current`` (which comes first): every
    thread count that does not oversubscribe the node (and the current one), then, where a control exists, data
    workers and per-rank batches of ``space``. At most ``max_probes``."""
    g = current.ranks_per_node
    threads = space.threads_per_rank or tuple(t for t in range(1, machine.cores + 1))
    fits = [t for t in threads if g * t <= max(machine.cores, g)]
    schedule = [current]
    schedule += [current.with_(threads_per_rank=t) for t in fits]
    if can_set_workers:
        schedule += [current.with_(data_workers=d) for d in space.data_workers]
    if can_set_batch and space.batch_per_rank:
        for b in space.batch_per_rank:
            if space.global_batch is None or space.global_batch[0] <= b * current.world_size <= space.global_batch[1]:
                schedule.append(current.with_(batch_per_rank=b))
    unique: list[ResourceConfig] = []
    for config in schedule:
        if config not in unique:
            unique.append(config)
    return unique[:max(1, max_probes)]


@dataclass
class Segment:
    """Steps measured at one configuration on this rank (after its settle steps)."""

    config: ResourceConfig
    first_step: int
    seconds: list[float] = field(default_factory=list)
    data_wait: list[float] = field(default_factory=list)
    rss: list[float] = field(default_factory=list)
    cpu_start: tuple[float, float, float] | None = None  # runtime.cpu_snapshot at the first measured step
    cpu: tuple[float, float, float] = (0.0, 0.0, 0.0)  # job cpu s, busy s, wall s over the measured steps

    def local_stats(self) -> SegmentStats:
        """This rank's measurement of the segment (all zeros before its first measured step).

        Medians: on a shared machine a few steps are stretched by other programs (or a collective waiting on a
        descheduled peer); the steady-state step is what the model describes."""
        n = len(self.seconds)
        if n == 0:
            return SegmentStats(0.0, 0.0, 0.0, 0, (0.0, 0.0, 0.0))
        return SegmentStats(statistics.median(self.seconds), statistics.median(self.data_wait), max(self.rss), n,
                            self.cpu)


@dataclass(frozen=True)
class SegmentStats:
    """One rank's measurement of a :class:`Segment`, as gathered from every rank at its end."""

    step_s: float  # median step seconds
    data_wait_s: float  # median data wait seconds
    rss_bytes: float  # peak resident memory
    steps: int  # steps measured
    cpu: tuple[float, float, float]  # job cpu s, busy s, wall s over the measured steps
