"""The tuner's PNG: stages with equal worker counts stay apart, memory is readable against its budget, throughput
starts at 0, convergence and undone changes are marked."""

from lightning_dlrover.data.staged import PipelineConfig
from lightning_dlrover.pipeline_tuner.harness import Trace, TracePoint
from lightning_dlrover.pipeline_tuner.report import figure, marks, plot

BUDGET = int(5.8e9)


def _trace() -> Trace:
    configs = [PipelineConfig(1, 1, 1, 1, 2), PipelineConfig(1, 2, 1, 1, 2), PipelineConfig(1, 1, 1, 1, 2),
               PipelineConfig(1, 1, 1, 1, 3), PipelineConfig(1, 1, 1, 1, 3), PipelineConfig(1, 1, 1, 1, 3)]
    reasons = ["add parse (bottleneck parse)", "undo: -8.0% after add parse", "add prefetch (bottleneck trainer)",
               "stay (bottleneck trainer)", "converged after 4 decisions: best r1 p1 t1 a1 q3",
               "converged: keeping the best configuration"]
    rates = [52_000, 47_000, 53_000, 56_000, 56_500, 56_200]
    memory = [40, 62, 41, 48, 48, 49]
    points = [TracePoint(2.0 * (i + 1), c, r, m * 2**20, 0.01, {}, None, why, 0)
              for i, (c, why, r, m) in enumerate(zip(configs, reasons, rates, memory))]
    return Trace("rl", points, final=configs[-1])


def test_png_shows_stages_memory_throughput_and_the_tuners_turns(tmp_path):
    trace = _trace()
    assert marks(trace) == (10.0, [4.0])
    top, mid, bottom = figure([trace], BUDGET).axes[:3]
    # Throughput from 0, convergence and the undo marked.
    assert top.get_ylim()[0] == 0
    labels = top.get_legend_handles_labels()[1]
    assert any(label.startswith("rl converged") for label in labels) and "rl undo (1)" in labels
    # Four stages, three of them with the same worker count all along: no two lines coincide.
    stages = [line.get_ydata() for line in mid.get_lines() if line.get_label().endswith("workers")]
    assert len(stages) == 4 and len({tuple(y) for y in stages}) == 4
    # Memory (40-62 MiB) on its own scale, not flattened against a 5.8 GB budget; the budget as a share on the right.
    low, high = bottom.get_ylim()
    assert low == 0 and 62 <= high <= 2 * 62
    assert "% of budget" in [ax.get_ylabel() for ax in bottom.child_axes]
    assert plot(tmp_path / "tuner.png", [trace], BUDGET).stat().st_size > 10_000
