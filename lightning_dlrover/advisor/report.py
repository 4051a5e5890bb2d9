"""What people read: the end-of-fit table and a PNG of measured points, the fitted model and the recommendation."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
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


#: Fewest measured points for a held-out (leave-one-out) error; with fewer only the in-sample error is shown.
MIN_HELD_OUT_POINTS = 3


def _pct(predicted: float, measured: float) -> float:
    return 100 * (predicted - measured) / measured


def _mean_abs(values: Sequence[float]) -> float:
    return sum(abs(v) for v in values) / len(values)


@dataclass(frozen=True)
class FitErrors:
    """How far the model is from the measured points, in % of the measured throughput (signed, per point).

    Attributes:
        in_sample: the fitted model's error on each point it was fitted on (a residual, not an accuracy: with as
            many terms as points it is ~0).
        held_out: leave-one-out: each point predicted by the model refitted without it (``None`` with fewer than
            :data:`MIN_HELD_OUT_POINTS` points, or when a point was all the fit had).
        held_out_predicted: those leave-one-out predictions in samples/s (``None`` with ``held_out``).
    """

    in_sample: tuple[float, ...]
    held_out: tuple[float, ...] | None = None
    held_out_predicted: tuple[float, ...] | None = None

    def text(self) -> str:
        """One line for people: the held-out error, else the in-sample error labelled as such and why."""
        n = len(self.in_sample)
        if not n:
            return "no measured configuration to check the model against"
        if self.held_out is not None:
            return (f"held-out error {_mean_abs(self.held_out):.1f}% (leave-one-out over {n} measured configurations;"
                    f" in-sample {_mean_abs(self.in_sample):.1f}%)")
        return (f"not enough data for a held-out error ({n} measured configuration(s), leave-one-out needs "
                f">= {MIN_HELD_OUT_POINTS}); in-sample error {_mean_abs(self.in_sample):.1f}% is not accuracy")

    def to_dict(self) -> dict[str, Any]:
        return {"points": len(self.in_sample),
                "in_sample_mean_abs_pct": _mean_abs(self.in_sample) if self.in_sample else None,
                "held_out_mean_abs_pct": _mean_abs(self.held_out) if self.held_out else None,
                "held_out_method": "leave-one-out" if self.held_out else None}


def fit_errors(model: PerformanceModel, measured: Sequence[Observation]) -> FitErrors:
    """In-sample and (with >= :data:`MIN_HELD_OUT_POINTS` points) leave-one-out errors of ``model`` on ``measured``:
    each point is left out of what ``model`` was fitted on (``model.observations``, its prior kept) and predicted
    by the refitted model."""
    in_sample = tuple(_pct(model.predict(o.config, o.shape, o.cores).samples_per_sec, o.samples_per_sec)
                      for o in measured)
    if len(measured) < MIN_HELD_OUT_POINTS:
        return FitErrors(in_sample)
    fitted = list(model.observations) or list(measured)
    held_out, predicted = [], []
    for o in measured:
        rest = list(fitted)
        i = next((i for i, f in enumerate(rest) if f is o), None)
        if i is None and o in rest:
            i = rest.index(o)
        if i is not None:
            del rest[i]
        if not rest:
            return FitErrors(in_sample)
        p = PerformanceModel(ridge=model.ridge, prior=model.prior).fit(rest).predict(o.config, o.shape, o.cores)
        predicted.append(p.samples_per_sec)
        held_out.append(_pct(p.samples_per_sec, o.samples_per_sec))
    return FitErrors(in_sample, tuple(held_out), tuple(predicted))


def summary_table(model: PerformanceModel, shape: JobShape, cores: int, measured: Sequence[Observation],
                  recommendation: Recommendation | None, findings: Sequence[str] = (), restart: str = "",
                  errors: FitErrors | None = None) -> str:
    """Measured vs predicted throughput per configuration (in-sample and, with enough points, held-out error),
    the recommendation and its expected gain, findings, and the restart the recommendation needs (a ``restart``
    text is left out when the recommendation keeps the configuration: it belongs to an earlier decision)."""
    errors = errors or fit_errors(model, measured)
    rows = []
    for i, o in enumerate(measured):
        p = model.predict(o.config, o.shape, o.cores)
        row = [o.config.short(), f"{o.samples_per_sec:.0f}", f"{p.samples_per_sec:.0f}", f"{errors.in_sample[i]:+.0f}%"]
        if errors.held_out is not None:
            row.append(f"{errors.held_out[i]:+.0f}%")
        rows.append(row + [f"{1000 * o.step_s:.1f}", f"{1000 * o.data_wait_s:.1f}"])
    lines = [f"ResourceAdvisor: model fitted on {model.fitted_on} measured configurations"
             + (f"; {errors.text()}" if rows else "")]
    if rows:
        header = ["configuration", "measured/s", "predicted/s", "in-sample err"]
        header += ["held-out err"] if errors.held_out is not None else []
        lines += _table(header + ["step ms", "data ms"], rows)
    if recommendation is not None:
        r = recommendation
        lines.append(f"current:     {r.current.config.short()}: {r.current.samples_per_sec:.0f} samples/s predicted")
        if r.changed:
            lines.append(f"recommended: {r.best.config.short()}: {r.best.samples_per_sec:.0f} samples/s predicted "
                         f"({r.gain:.2f}x; {r.reason})")
        else:
            lines.append(f"recommended: keep {r.best.config.short()} ({r.reason})")
    lines += [f"finding: {f}" for f in findings]
    if restart and (recommendation is None or recommendation.changed):
        lines.append(restart)
    return "\n".join(lines)


@dataclass(frozen=True)
class PlotData:
    """What the two panels of :func:`plot` show.

    Left: ``measured`` (x) against ``predicted`` (in-sample) and ``held_out`` (leave-one-out, if any) samples/s,
    titled ``left_title``. Right: the candidates' ``labels`` and predicted ``candidates`` samples/s, best first;
    measured points at candidate positions ``measured_at``/``measured_at_y``; the recommended and current
    configurations' positions (``None`` when not among the candidates).
    """

    measured: tuple[float, ...]
    predicted: tuple[float, ...]
    held_out: tuple[float, ...] | None
    left_title: str
    measured_label: str
    labels: tuple[str, ...]
    candidates: tuple[float, ...]
    measured_at: tuple[int, ...]
    measured_at_y: tuple[float, ...]
    best_at: int | None
    current_at: int | None


def plot_data(model: PerformanceModel, measured: Sequence[Observation], recommendation: Recommendation,
              errors: FitErrors | None = None, measured_label: str = "measured configurations") -> PlotData:
    """The series and labels of :func:`plot`'s panels."""
    errors = errors or fit_errors(model, measured)
    candidates = sorted(recommendation.candidates or (recommendation.current,), key=lambda p: -p.samples_per_sec)
    index = {p.config: i for i, p in enumerate(candidates)}
    return PlotData(
        measured=tuple(o.samples_per_sec for o in measured),
        predicted=tuple(model.predict(o.config, o.shape, o.cores).samples_per_sec for o in measured),
        held_out=errors.held_out_predicted, left_title="fit: " + errors.text(), measured_label=measured_label,
        labels=tuple(p.config.short() for p in candidates), candidates=tuple(p.samples_per_sec for p in candidates),
        measured_at=tuple(index[o.config] for o in measured if o.config in index),
        measured_at_y=tuple(o.samples_per_sec for o in measured if o.config in index),
        best_at=index.get(recommendation.best.config), current_at=index.get(recommendation.current.config))


def plot(path: str | Path, model: PerformanceModel, shape: JobShape, cores: int, measured: Sequence[Observation],
         recommendation: Recommendation, title: str = "", errors: FitErrors | None = None,
         measured_label: str = "measured configurations") -> Path:
    """Writes a PNG of :func:`plot_data`: (left) predicted (in-sample and held-out) vs measured throughput of the
    measured configurations; (right) predicted throughput of every candidate configuration, best first, with the
    measured points, the current configuration and the recommendation marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = plot_data(model, measured, recommendation, errors, measured_label)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 2]})
    if data.measured:
        top = max(data.measured + data.predicted + (data.held_out or ())) * 1.05
        left.plot([0, top], [0, top], color="grey", lw=1, ls="--", label="prediction = measurement")
        left.scatter(data.measured, data.predicted, color="tab:blue", zorder=3, label=f"{measured_label} (in-sample)")
        if data.held_out is not None:
            left.scatter(data.measured, data.held_out, color="tab:purple", marker="s", zorder=3,
                         label="held out (leave-one-out)")
        left.set_xlim(0, top)
        left.set_ylim(0, top)
        left.legend(loc="lower right", fontsize=8)
    else:
        left.text(0.5, 0.5, "no measured configuration", ha="center", va="center", transform=left.transAxes)
    left.set_title(data.left_title, fontsize=8, wrap=True)
    left.set_xlabel("measured samples/s")
    left.set_ylabel("predicted samples/s")

    right.plot(range(len(data.candidates)), data.candidates, color="tab:orange", marker=".", label="model (candidates)")
    if data.measured_at:
        right.scatter(data.measured_at, data.measured_at_y, color="tab:blue", zorder=3, label=measured_label)
    r = recommendation
    if data.best_at is not None:
        right.scatter([data.best_at], [r.best.samples_per_sec], marker="*", s=300, color="tab:green", zorder=4,
                      label=f"recommended: {r.best.config.short()}")
    if data.current_at is not None:
        right.scatter([data.current_at], [r.current.samples_per_sec], marker="X", s=120, color="tab:red", zorder=4,
                      label=f"current: {r.current.config.short()}")
    if len(data.labels) <= 48:
        right.set_xticks(range(len(data.labels)), data.labels, rotation=75, fontsize=6)
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
    errors = fit_errors(model, measured)
    table = summary_table(model, shape, cores, measured, recommendation, findings, restart, errors)
    if replan is not None and replan.worthwhile:
        table += "\n" + replan.constraints_yaml()
    rank_zero_report(log, table)
    (out / "advisor_report.txt").write_text(table + "\n")
    png = plot(out / "advisor_model.png", model, shape, cores, measured, recommendation, title, errors)
    r = recommendation
    advice = {"current": r.current.config.to_dict(), "recommended": r.best.config.to_dict(),
              "predicted_samples_per_sec": {"current": r.current.samples_per_sec,
                                            "recommended": r.best.samples_per_sec},
              "gain": r.gain, "reason": r.reason, "restart": restart if r.changed else "", "model": model.to_dict(),
              "fit_error": errors.to_dict(),
              "findings": list(findings),
              "plot": str(png), "recommended_at_step": recommended_at.step if recommended_at else None,
              "recommended_after_s": recommended_at.elapsed_s if recommended_at else None,
              "replan": None if replan is None else {
                  "imbalance_before": replan.imbalance_before, "imbalance_after": replan.imbalance_after,
                  "pooling_factors": replan.pooling_factors}}
    (out / "advice.json").write_text(json.dumps(advice, indent=2))
    return out
