"""Choosing a configuration from the fitted model: the most throughput within the machine's resources, or the
cheapest configuration that reaches a throughput target."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lightning_dlrover.advisor.model import JobShape, PerformanceModel, Prediction
from lightning_dlrover.advisor.resources import Machine, ResourceConfig, SearchSpace

Objective = Literal["throughput", "cost"]


@dataclass(frozen=True)
class Recommendation:
    """The advisor's choice and what it expects of it.

    Attributes:
        current: the model's prediction for the configuration the job runs with.
        best: the chosen configuration's prediction (``current`` when no candidate is better by ``min_gain``).
        objective: ``throughput`` or ``cost``.
        gain: predicted throughput of ``best`` over ``current`` (1.0: no change).
        reason: one sentence on why ``best`` was chosen.
        candidates: every candidate's prediction, best first.
        excluded: ``(config, why)`` of candidates that were left out (memory, outside the measured range).
    """

    current: Prediction
    best: Prediction
    objective: str
    gain: float
    reason: str
    candidates: tuple[Prediction, ...] = ()
    excluded: tuple[tuple[ResourceConfig, str], ...] = field(default=())

    @property
    def changed(self) -> bool:
        return self.best.config != self.current.config


def cost_per_hour(config: ResourceConfig, cost_per_node_hour: float, cost_per_core_hour: float) -> float:
    """Price of running ``config`` for an hour: nodes, plus cores used (threads and workers of every rank)."""
    cores = config.world_size * (config.threads_per_rank + config.data_workers)
    return config.nodes * cost_per_node_hour + cores * cost_per_core_hour


def recommend(
    model: PerformanceModel,
    shape: JobShape,
    machine: Machine,
    current: ResourceConfig,
    space: SearchSpace,
    objective: Objective = "throughput",
    target_samples_per_sec: float | None = None,
    cost_per_node_hour: float = 1.0,
    cost_per_core_hour: float = 0.0,
    memory_margin: float = 0.2,
    min_gain: float = 0.05,
    extrapolate: bool = False,
    available_cores: float | None = None,
) -> Recommendation:
    """Predicts every candidate of ``space`` (and ``current``) and picks one.

    ``objective="throughput"``: the most samples/s, if it beats ``current`` by more than ``min_gain`` (else
    ``current``: a change costs a restart or a warm-up). ``objective="cost"``: the lowest
    :func:`cost_per_hour` among those predicted to reach ``target_samples_per_sec`` (the fastest if none does).
    Candidates whose predicted memory per node exceeds ``(1 - memory_margin)`` of the machine's, and (unless
    ``extrapolate``) those outside the measured world sizes and data workers, are excluded. Predictions use
    ``available_cores`` per node (default: the machine's; less when other programs share it).
    """
    if objective not in ("throughput", "cost"):
        raise ValueError(f"objective={objective!r} must be 'throughput' or 'cost'.")
    if objective == "cost" and (target_samples_per_sec is None or target_samples_per_sec <= 0):
        raise ValueError("objective='cost' needs a positive target_samples_per_sec (the throughput to reach).")
    if not 0 <= memory_margin < 1:
        raise ValueError(f"memory_margin={memory_margin} must be in [0, 1).")
    cores = machine.cores if available_cores is None else available_cores
    now = model.predict(current, shape, cores)
    kept: list[Prediction] = []
    excluded: list[tuple[ResourceConfig, str]] = []
    budget = (1 - memory_margin) * machine.memory_bytes
    for config in {*space.candidates(machine, current), current}:
        p = now if config == current else model.predict(config, shape, cores)
        if config != current and not extrapolate and not model.supports(config):
            excluded.append((config, "outside the measured world sizes / data workers"))
        elif config != current and p.rss_bytes is not None and p.rss_bytes * config.ranks_per_node > budget:
            excluded.append((config, f"needs {p.rss_bytes * config.ranks_per_node / 2**30:.1f} GiB per node"))
        else:
            kept.append(p)
    kept.sort(key=lambda p: (-p.samples_per_sec, cost_per_hour(p.config, cost_per_node_hour, cost_per_core_hour)))
    if objective == "throughput":
        best = kept[0]
        if best.samples_per_sec < (1 + min_gain) * now.samples_per_sec:
            best = now
            reason = f"no configuration is predicted more than {min_gain:.0%} faster than the current one"
        else:
            reason = f"highest predicted throughput of {len(kept)} configurations"
    else:
        fast = [p for p in kept if p.samples_per_sec >= target_samples_per_sec]
        if fast:
            best = min(fast, key=lambda p: (cost_per_hour(p.config, cost_per_node_hour, cost_per_core_hour),
                                            -p.samples_per_sec))
            reason = f"cheapest of {len(fast)} configurations predicted to reach {target_samples_per_sec:.0f} samples/s"
        else:
            best = kept[0]
            reason = f"no configuration is predicted to reach {target_samples_per_sec:.0f} samples/s; the fastest"
    return Recommendation(now, best, objective, best.samples_per_sec / now.samples_per_sec, reason, tuple(kept),
                          tuple(excluded))
