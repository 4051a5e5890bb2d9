"""What people read about a tuning run: the end-of-fit table and a PNG of throughput, workers and memory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_dlrover.data.staged import STAGES
from lightning_dlrover.pipeline_tuner.harness import Trace


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain right-aligned text table."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def summary(trace: Trace, budget_cpus: int, budget_memory: int) -> str:
    """End-of-fit summary: what the tuner started with and chose, the gain, its decisions, memory vs budget."""
    start = trace.points[0].config.short() if trace.points else "-"
    first, final = trace.start_samples_per_s(), trace.final_samples_per_s()
    rows = [[p.t and f"{p.t:.1f}", p.config.short(), f"{p.samples_per_s:.0f}", f"{p.wait_fraction:.2f}",
             f"{p.memory_bytes / 2**20:.0f}", p.reason] for p in trace.points]
    lines = [f"PipelineTuner ({trace.tuner}): start {start} at {first:.0f} samples/s -> chose "
             f"{trace.final.short() if trace.final else '-'} at {final:.0f} samples/s "
             f"({final / first if first else 0:.2f}x); {len(trace.points)} windows, {trace.resets} pipeline resets "
             f"({trace.reset_s:.1f} s); peak pipeline memory {trace.peak_memory / 2**20:.0f} MiB of "
             f"{budget_memory / 2**20:.0f} MiB budget; CPU budget {budget_cpus} workers"]
    if rows:
        lines.append(table(["t s", "config", "samples/s", "wait", "mem MiB", "decision"], rows))
    return "\n".join(lines)


#: Decision reasons (``TracePoint.reason``, the ``reason`` of ``pipeline_decision`` events) that end a tuner's search:
#: the RL agent's, the hill climber's, the grid's.
CONVERGED = ("converged after", ": stop at ", "grid best")
#: Decision reasons of a change taken back.
UNDO = ("undo",)
#: Vertical offset between stages' worker lines (equal counts stay visible side by side).
_STAGE_OFFSET = 0.07
_MARKERS = ("o", "s", "^", "D")


def marks(trace: Trace) -> tuple[float | None, list[float]]:
    """When ``trace`` converged (its first converging decision, or ``None``) and when it undid a change."""
    converged = next((p.t for p in trace.points if any(c in p.reason for c in CONVERGED)), None)
    return converged, [p.t for p in trace.points if p.reason.startswith(UNDO)]


def figure(traces: Sequence[Trace], budget_memory: int | None = None, title: str = "") -> Any:
    """The matplotlib figure :func:`plot` writes: throughput per window from 0 (top), with convergence and undone
    changes marked; workers per stage, each stage offset a little and with its own marker so equal counts stay
    apart, and prefetch depth (middle, first trace); pipeline memory on its own scale, with its share of the budget
    on the right axis and the budget line when it is within sight (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    peak = 0.0
    for trace in traces:
        t = [p.t for p in trace.points]
        line, = top.plot(t, [p.samples_per_s for p in trace.points], marker="o", ms=3, label=trace.tuner)
        memory = [p.memory_bytes / 2**20 for p in trace.points]
        bottom.plot(t, memory, color=line.get_color(), marker=".", label=f"{trace.tuner} pipeline memory")
        peak = max([peak, *memory])
        converged, undone = marks(trace)
        if converged is not None:
            top.axvline(converged, color=line.get_color(), linestyle="--", alpha=0.7,
                        label=f"{trace.tuner} converged ({converged:.0f} s)")
        if undone:
            rates = {p.t: p.samples_per_s for p in trace.points}
            top.scatter(undone, [rates[u] for u in undone], marker="x", s=60, color="red", zorder=3,
                        label=f"{trace.tuner} undo ({len(undone)})")
    top.set_ylim(bottom=0)
    if traces and traces[0].points:
        points = traces[0].points
        t = [p.t for p in points]
        for i, stage in enumerate(STAGES):
            offset = (i - (len(STAGES) - 1) / 2) * _STAGE_OFFSET
            mid.step(t, [p.config.workers[stage] + offset for p in points], where="pre", marker=_MARKERS[i], ms=4,
                     label=f"{stage} workers")
        mid.step(t, [p.config.prefetch for p in points], where="pre", linestyle="--", color="black", alpha=0.6,
                 label="prefetch depth")
        mid.set_title(f"configuration of {traces[0].tuner} (stages offset by {_STAGE_OFFSET} to stay apart)",
                      fontsize=9)
    mid.set_ylim(bottom=-0.5)
    top_mib = max(peak * 1.25, 1.0)
    if budget_memory:
        budget_mib = budget_memory / 2**20
        if budget_mib <= top_mib * 1.6:  # within sight of the measured memory: draw it, on the same scale
            top_mib = max(top_mib, budget_mib * 1.05)
            bottom.axhline(budget_mib, color="red", linestyle=":", label=f"memory budget ({budget_mib:.0f} MiB)")
        else:
            bottom.set_title(f"memory budget {budget_mib:.0f} MiB, off this scale: peak {peak:.0f} MiB = "
                             f"{100 * peak / budget_mib:.1f}% of it", fontsize=9)
        right = bottom.secondary_yaxis("right", functions=(lambda m: 100 * m / budget_mib,
                                                           lambda pct: pct * budget_mib / 100))
        right.set_ylabel("% of budget")
    bottom.set_ylim(0, top_mib)
    top.set_ylabel("samples/s")
    mid.set_ylabel("workers / depth")
    bottom.set_ylabel("pipeline MiB")
    bottom.set_xlabel("seconds")
    for ax in (top, mid, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    if title:
        top.set_title(title)
    fig.tight_layout()
    return fig


def plot(path: str | Path, traces: Sequence[Trace], budget_memory: int | None = None, title: str = "") -> Path:
    """Writes :func:`figure` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = figure(traces, budget_memory, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
