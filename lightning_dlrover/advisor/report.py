"""What people read: the end-of-fit table and a PNG of measured points, the fitted model and the recommendation."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dlrover.advisor.model import JobShape, Observation, PerformanceModel
from lightning_dlrover.advisor.recommend import Recommendation
from lightning_dlrover.log import get_logger, rank_zero_report

log = get_logger(__name__)

if TYPE_CHECKING:
    from lightning_dlrover.advisor.window import RecommendedAt


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
    return [lines[0], "-" * len(lines[0]), *lines[1:]]


def summary_table(model: PerformanceModel, shape: JobShape, cores: int, measured: Sequence[Observation],
                  recommendation: Recommendation | None, findings: Sequence[str] = (), restart: str = "") -> str:
    """Measured vs predicted throughput per configuration, the recommendation and its expected gain, findings."""
    rows = []
    errors = []
    for o in measured:
        p = model.predict(o.config, o.shape, o.cores)
        err = 100 * (p.samples_per_sec - o.samples_per_sec) / o.samples_per_sec
        errors.append(abs(err))
        rows.append([o.config.short(), f"{o.samples_per_sec:.0f}", f"{p.samples_per_sec:.0f}", f"{err:+.0f}%",
                     f"{1000 * o.step_s:.1f}", f"{1000 * o.data_wait_s:.1f}"])
    lines = [f"ResourceAdvisor: model fitted on {model.fitted_on} measured configurations"
             + (f" (mean abs. error on this job's {len(errors)}: {sum(errors) / len(errors):.1f}%)" if errors else "")]
    if rows:
        lines += _table(["configuration", "measured/s", "predicted/s", "error", "step ms", "data ms"], rows)
    if recommendation is not None:
        r = recommendation
        lines.append(f"current:     {r.current.config.short()}: {r.current.samples_per_sec:.0f} samples/s predicted")
        lines.append(f"recommended: {r.best.config.short()}: {r.best.samples_per_sec:.0f} samples/s predicted "
                     f"({r.gain:.2f}x; {r.reason})")
    lines += [f"finding: {f}" for f in findings]
    if restart:
        lines.append(restart)
    return "\n".join(lines)


def plot(path: str | Path, model: PerformanceModel, shape: JobShape, cores: int, measured: Sequence[Observation],
         recommendation: Recommendation, title: str = "") -> Path:
    """Writes a PNG: (left) predicted vs measured throughput of the measured configurations; (right) predicted
    throughput of every candidate configuration, best first, with the measured points, the current configuration
    and the recommendation marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 2]})
    if measured:
        x = [o.samples_per_sec for o in measured]
        y = [model.predict(o.config, o.shape, o.cores).samples_per_sec for o in measured]
        top = max(x + y) * 1.05
        left.plot([0, top], [0, top], color="grey", lw=1, ls="--", label="prediction = measurement")
        left.scatter(x, y, color="tab:blue", zorder=3, label="measured configurations")
        mape = sum(abs(b - a) / a for a, b in zip(x, y)) / len(x) * 100
        left.set_title(f"fit: mean abs. error {mape:.1f}%")
        left.set_xlim(0, top)
        left.set_ylim(0, top)
    left.set_xlabel("measured samples/s")
    left.set_ylabel("predicted samples/s")
    left.legend(loc="upper left", fontsize=8)

    candidates = sorted(recommendation.candidates, key=lambda p: -p.samples_per_sec)
    labels = [p.config.short() for p in candidates]
    right.plot(range(len(candidates)), [p.samples_per_sec for p in candidates], color="tab:orange", marker=".",
               label="model (candidates)")
    index = {p.config: i for i, p in enumerate(candidates)}
    mx = [index[o.config] for o in measured if o.config in index]
    my = [o.samples_per_sec for o in measured if o.config in index]
    right.scatter(mx, my, color="tab:blue", zorder=3, label="measured")
    if recommendation.best.config in index:
        i = index[recommendation.best.config]
        right.scatter([i], [recommendation.best.samples_per_sec], marker="*", s=300, color="tab:green", zorder=4,
                      label=f"recommended: {recommendation.best.config.short()}")
    if recommendation.current.config in index:
        i = index[recommendation.current.config]
        right.scatter([i], [recommendation.current.samples_per_sec], marker="X", s=120, color="tab:red", zorder=4,
                      label=f"current: {recommendation.current.config.short()}")
    if len(labels) <= 48:
        right.set_xticks(range(len(labels)), labels, rotation=75, fontsize=6)
    right.set_ylabel("samples/s")
    right.set_title("predicted throughput of each configuration")
    right.legend(fontsize=8)
    fig.suptitle(title or "ResourceAdvisor")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_reports(out: Path, model: PerformanceModel, shape: JobShape, cores: int, measured: Sequence[Observation],
                  recommendation: Recommendation, findings: Sequence[str], restart: str, replan: Any,
                  recommended_at: RecommendedAt | None, title: str) -> Path:
    """Prints the :func:`summary_table` and writes it, the :func:`plot` and ``advice.json`` (the recommendation,
    model, findings and re-plan) under ``out``; returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    table = summary_table(model, shape, cores, measured, recommendation, findings, restart)
    if replan is not None and replan.worthwhile:
        table += "\n" + replan.constraints_yaml()
    rank_zero_report(log, table)
    (out / "advisor_report.txt").write_text(table + "\n")
    png = plot(out / "advisor_model.png", model, shape, cores, measured, recommendation, title)
    r = recommendation
    advice = {"current": r.current.config.to_dict(), "recommended": r.best.config.to_dict(),
              "predicted_samples_per_sec": {"current": r.current.samples_per_sec,
                                            "recommended": r.best.samples_per_sec},
              "gain": r.gain, "reason": r.reason, "restart": restart, "model": model.to_dict(),
              "findings": list(findings),
              "plot": str(png), "recommended_at_step": recommended_at.step if recommended_at else None,
              "recommended_after_s": recommended_at.elapsed_s if recommended_at else None,
              "replan": None if replan is None else {
                  "imbalance_before": replan.imbalance_before, "imbalance_after": replan.imbalance_after,
                  "pooling_factors": replan.pooling_factors}}
    (out / "advice.json").write_text(json.dumps(advice, indent=2))
    return out
