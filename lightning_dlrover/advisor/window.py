"""Stage 2 of one running job: the profiling window. The job tries the configurations of a probe schedule live, one
segment of steps each, every rank measures its steps, and at the window's end rank 0 fits the performance model on
those measurements (and the history's) and recommends a configuration."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_dlrover.advisor import control
from lightning_dlrover.advisor.model import Observation, PerformanceModel
from lightning_dlrover.advisor.probe import Segment, probe_schedule
from lightning_dlrover.advisor.recommend import Recommendation, recommend
from lightning_dlrover.advisor.resources import Machine, ResourceConfig, SearchSpace
from lightning_dlrover.advisor.runtime import background_cores, cpu_snapshot, gather

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_dlrover.advisor.config import AdvisorConfig
    from lightning_dlrover.advisor.model import JobShape


@dataclass(frozen=True)
class RecommendedAt:
    """When the window's recommendation was made."""

    step: int  # global step
    elapsed_s: float  # seconds since the first step


class ProfilingWindow:
    """The probe schedule of one fit, its segments and observations, and (rank 0) the model and recommendation
    fitted at its end."""

    def __init__(self, config: AdvisorConfig) -> None:
        self.config = config
        self.schedule: list[ResourceConfig] = []
        self.segments: list[Segment] = []
        #: One observation per probe (every rank), the cores other programs kept busy (last measured).
        self.observations: list[Observation] = []
        self.background = 0.0
        self._probes: tuple[int | None, int] = (None, 0)  # (first step of the window, probes): its collectives
        #: The model, its recommendation and when it was made (rank 0), ``None`` before the window's end.
        self.model: PerformanceModel | None = None
        self.recommendation: Recommendation | None = None
        self.recommended_at: RecommendedAt | None = None

    def reset(self) -> None:
        """Forgets the last fit's schedule and measurements (its model and recommendation stay until replaced)."""
        self.segments, self.schedule = [], []
        self.observations = []
        self.background = 0.0
        self._probes = (None, 0)

    def plan(self, current: ResourceConfig, machine: Machine, space: SearchSpace, shape: JobShape,
             controls: list[Any], can_set_workers: bool, can_set_batch: bool) -> None:
        """Schedules the probes from ``current`` (none with ``profile_steps=0``) for this job."""
        self.machine, self.space, self.shape, self.controls = machine, space, shape, controls
        if self.config.profile_steps:
            probes = max(1, self.config.profile_steps // self.config.probe_steps)
            self.schedule = probe_schedule(current, machine, space, can_set_workers, can_set_batch, probes)
        self._probes = (None, len(self.schedule))

    def collectives_at(self, step: int) -> int:
        """How many advisor collectives :meth:`measure` at ``step`` (and the recommendation after it) hold: a gather
        at each probe's end, a broadcast at the window's end; known from the schedule alone, so a rank whose advisor
        failed can still tell when the others meet."""
        first, probes = self._probes
        if first is None:  # the window starts at the first step measured: this one
            self._probes = first, _ = step, probes
        done, rest = divmod(step - first + 1, self.config.probe_steps)
        if rest or not 1 <= done <= probes:
            return 0
        return 2 if done == probes else 1

    def measure(self, trainer: Trainer, step: int, seconds: float, data: float, rss: float,
                current: ResourceConfig) -> bool:
        """Adds one step of this rank to the window; at a probe's end gathers every rank's measurement (collective)
        and moves on to the next probe. Returns ``True`` at the window's end, the live knobs back at ``current``."""
        if not self.schedule:
            return False
        settle_steps, probe_steps = self.config.settle_steps, self.config.probe_steps
        if not self.segments:
            self.segments.append(Segment(self.schedule[0], step))
            self._probes = (step, len(self.schedule))
        segment = self.segments[-1]
        machine_wide = trainer.local_rank == 0
        if step - segment.first_step + 1 == settle_steps or (settle_steps == 0 and segment.cpu_start is None):
            segment.cpu_start = cpu_snapshot(machine_wide)
        if step - segment.first_step >= settle_steps:
            segment.seconds.append(seconds)
            segment.data_wait.append(data)
            segment.rss.append(rss)
        if step - segment.first_step + 1 < probe_steps:
            return False
        if segment.cpu_start is not None:
            end = cpu_snapshot(machine_wide)
            segment.cpu = tuple(b - a for a, b in zip(segment.cpu_start, end))
        stats = gather(trainer.world_size, segment.local_stats())
        step_s = max(s.step_s for s in stats)
        self.background = background_cores([s.cpu for s in stats], trainer.num_devices, self.machine.cores)
        self.observations.append(Observation(segment.config, self.shape, self.machine.cores - self.background, step_s,
                                             sum(s.data_wait_s for s in stats) / len(stats),
                                             max(s.rss_bytes for s in stats)))
        done = len(self.segments)
        if done < len(self.schedule):
            nxt = self.schedule[done]
            control.apply_live(control.live_changes(segment.config, nxt, self.controls), self.controls)
            self.segments.append(Segment(nxt, step + 1))
            return False
        self.schedule = []
        control.apply_live(control.live_changes(segment.config, current, self.controls), self.controls)
        return True

    def fit_and_recommend(self, current: ResourceConfig, prior: PerformanceModel | None,
                          past: list[Observation]) -> ResourceConfig:
        """Rank 0, at the window's end: fits the model on the window's and the ``past`` observations (from
        ``prior``) and returns the recommended configuration."""
        c = self.config
        self.model = PerformanceModel(prior=prior).fit(self.observations + past)
        self.recommendation = recommend(
            self.model, self.shape, self.machine, current, self.space, c.objective, c.target_samples_per_sec,
            c.cost_per_node_hour, c.cost_per_core_hour, extrapolate=c.extrapolate,
            available_cores=self.typical_free_cores())
        return self.recommendation.best.config

    def typical_free_cores(self) -> float:
        """Cores per node the job can expect for the rest of the fit: the median over the window's probes (one
        probe's fraction of a second says little about the next minutes on a shared machine)."""
        own = [o.cores for o in self.observations]
        return statistics.median(own) if own else self.machine.cores - self.background
