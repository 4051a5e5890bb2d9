"""What people read about a tuning run: the end-of-fit table and a PNG of throughput, workers and memory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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


def plot(path: str | Path, traces: Sequence[Trace], budget_memory: int | None = None, title: str = "") -> Path:
    """Writes a PNG: throughput per window (top), workers per stage and prefetch depth (middle, first trace),
    pipeline memory with the budget (bottom), against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for trace in traces:
        t = [p.t for p in trace.points]
        top.plot(t, [p.samples_per_s for p in trace.points], marker="o", ms=3, label=trace.tuner)
        bottom.plot(t, [p.memory_bytes / 2**20 for p in trace.points], label=trace.tuner)
    if traces and traces[0].points:
        t = [p.t for p in traces[0].points]
        for stage in STAGES:
            mid.step(t, [p.config.workers[stage] for p in traces[0].points], where="pre", label=f"{stage} workers")
        mid.step(t, [p.config.prefetch for p in traces[0].points], where="pre", linestyle="--", label="prefetch")
        mid.set_title(f"configuration of {traces[0].tuner}", fontsize=9)
    if budget_memory:
        bottom.axhline(budget_memory / 2**20, color="red", linestyle=":", label="memory budget")
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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
