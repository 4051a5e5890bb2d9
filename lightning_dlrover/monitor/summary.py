"""Per-rank throughput statistics after warm-up (:class:`RankThroughput`, :class:`ThroughputSummary`) and the
running sums and process measurements they are computed from."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import psutil

from lightning_dlrover.monitor.timing import BUILTIN_SECTIONS

try:
    import resource
except ImportError:  # Windows
    resource = None

_MB = 1024 * 1024


@dataclass(frozen=True)
class RankThroughput:
    """One rank's measurements over the training steps after warm-up.

    Attributes:
        rank: global rank.
        steps: training steps measured.
        samples: samples those steps consumed.
        samples_per_sec: ``samples`` divided by the summed step time.
        step_ms_mean: mean step time (data wait included), milliseconds.
        step_ms_p50: median step time, milliseconds.
        step_ms_p90: 90th percentile step time, milliseconds.
        sections_ms: mean milliseconds per step of each section that was observed, i.e. the section's
            total time divided by ``steps``; sections the monitor could not see are absent.
        cpu_percent: CPU time of the trainer process (not its DataLoader workers) over wall time,
            in percent of one core.
        rss_bytes: resident set size at the end of training.
        peak_rss_bytes: peak resident set size of the process.
        cuda_max_allocated_bytes: ``torch.cuda.max_memory_allocated`` on CUDA, else ``None``.
    """

    rank: int
    steps: int
    samples: int
    samples_per_sec: float
    step_ms_mean: float
    step_ms_p50: float
    step_ms_p90: float
    sections_ms: dict[str, float]
    cpu_percent: float
    rss_bytes: int
    peak_rss_bytes: int
    cuda_max_allocated_bytes: int | None

    def section_share(self, name: str) -> float | None:
        """Fraction of the mean step time spent in section ``name``, or ``None`` if not observed."""
        if name not in self.sections_ms:
            return None
        return self.sections_ms[name] / self.step_ms_mean


@dataclass(frozen=True)
class ThroughputSummary:
    """Measurements of all ranks after a fit, as :attr:`ThroughputMonitor.summary_stats` exposes them.

    Attributes:
        ranks: one entry per rank, ordered by rank.
        warmup_steps: leading steps per rank left out of the statistics.
    """

    ranks: tuple[RankThroughput, ...]
    warmup_steps: int

    @property
    def samples_per_sec(self) -> float:
        """Global throughput: the sum of the ranks' samples per second."""
        return sum(r.samples_per_sec for r in self.ranks)

    @property
    def sections(self) -> list[str]:
        """Names of the sections observed on any rank, built-in sections first."""
        seen = [s for s in BUILTIN_SECTIONS if any(s in r.sections_ms for r in self.ranks)]
        for r in self.ranks:
            seen += [s for s in r.sections_ms if s not in seen]
        return seen

    def format_table(self) -> str:
        """Render one row per rank plus a global row as a fixed-width text table."""
        sections = self.sections
        cuda = any(r.cuda_max_allocated_bytes is not None for r in self.ranks)
        header = ["rank", "samples/s", "step ms", "p50 ms", "p90 ms"]
        header += [f"{s} ms (%)" for s in sections] + ["cpu %", "peak rss MB"]
        header += ["cuda max MB"] if cuda else []
        rows = [header]
        for r in self.ranks:
            row = [str(r.rank), f"{r.samples_per_sec:.1f}", f"{r.step_ms_mean:.2f}"]
            row += [f"{r.step_ms_p50:.2f}", f"{r.step_ms_p90:.2f}"]
            row += [_section_cell(r, s) for s in sections]
            row += [f"{r.cpu_percent:.0f}", f"{r.peak_rss_bytes / _MB:.0f}"]
            if cuda:
                row += ["-" if r.cuda_max_allocated_bytes is None else f"{r.cuda_max_allocated_bytes / _MB:.0f}"]
            rows.append(row)
        total = ["all", f"{self.samples_per_sec:.1f}"] + ["-"] * (3 + len(sections))
        total += [f"{sum(r.cpu_percent for r in self.ranks):.0f}"]
        total += [f"{sum(r.peak_rss_bytes for r in self.ranks) / _MB:.0f}"]
        total += ["-"] if cuda else []
        rows.append(total)
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        title = f"Throughput over {self.ranks[0].steps} steps per rank (after {self.warmup_steps} warm-up steps)"
        return "\n".join([title, *lines])


def _section_cell(stats: RankThroughput, name: str) -> str:
    share = stats.section_share(name)
    return "-" if share is None else f"{stats.sections_ms[name]:.2f} ({100 * share:.0f}%)"


@dataclass
class _Totals:
    """Sums over a run of steps, with the process CPU time and wall clock at its start."""

    process: psutil.Process
    steps: int = 0
    samples: int = 0
    seconds: float = 0.0
    sections: dict[str, float] = field(default_factory=dict)
    cpu_start: float = field(init=False)
    wall_start: float = field(init=False)

    def __post_init__(self) -> None:
        self.cpu_start = _cpu_seconds(self.process)
        self.wall_start = time.perf_counter()

    def add(self, seconds: float, sections: Mapping[str, float], samples: int) -> None:
        """Add one step."""
        self.steps += 1
        self.samples += samples
        self.seconds += seconds
        for name, value in sections.items():
            self.sections[name] = self.sections.get(name, 0.0) + value

    def samples_per_sec(self) -> float:
        """Samples divided by the summed step time."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def cpu_percent(self) -> float:
        """Process CPU time since the start over wall time since the start, in percent of one core."""
        wall = time.perf_counter() - self.wall_start
        return 100.0 * (_cpu_seconds(self.process) - self.cpu_start) / wall if wall > 0 else 0.0


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _memory_bytes(process: psutil.Process) -> tuple[int, int]:
    """Current and peak resident set size of ``process`` (the current process)."""
    info = process.memory_info()
    peak = getattr(info, "peak_wset", info.rss)  # Windows reports its own peak
    if resource is not None:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = max(peak, maxrss if sys.platform == "darwin" else maxrss * 1024)  # Linux: KiB
    return info.rss, peak
