"""Goodput (Pollux/AdaptDL): throughput x statistical efficiency, from an online gradient noise scale.

Gradient noise scale. With per-rank batch ``b`` and global batch ``B = b * n``, the squared norm of a
rank's local gradient and of the all-reduced one estimate (McCandlish et al., as AdaptDL does)::

    E|g_b|^2 = |G|^2 + tr(S) / b          E|g_B|^2 = |G|^2 + tr(S) / B
    |G|^2   ~ (B |g_B|^2 - b |g_b|^2) / (B - b)
    tr(S)   ~ (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

with ``S`` the per-sample gradient covariance. Both are smoothed by exponential moving averages and the
noise scale is ``phi = tr(S) / |G|^2`` (samples). The local norms are read in a DDP communication hook on
the dense (data-parallel) part *before* its all-reduce, the averaged ones after it; ``|g_b|^2`` is then
averaged over ranks with one scalar all-reduce per measured step. It needs two or more ranks.

Statistical efficiency of batch ``B`` relative to the batch ``B0`` the learning rate was tuned for, and goodput::

    efficiency(B) = (phi + B0) / (phi + B)        goodput(n, B) = throughput(n, B) * efficiency(B)

``throughput(n, B) = B / step_time(B / n)`` with ``step_time(b) = a + c * b`` fitted by least squares to the
step times observed at each per-rank batch (with one batch seen, ``a = 0``: the model then cannot tell a larger
batch is cheaper per sample, and the policy stays near the smallest batch until a second one is measured).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from lightning_dlrover import control_plane


@dataclass
class NoiseScaleEstimator:
    """Smoothed ``|G|^2`` and ``tr(S)`` from local and averaged squared gradient norms (see the module docs)."""

    smoothing: float = 0.9
    grad_sqr: float | None = None
    grad_var: float | None = None
    measurements: int = 0

    def update(self, local_sqr: float, global_sqr: float, local_batch: int, global_batch: int) -> None:
        """Folds in one step's mean local ``|g_b|^2`` and averaged ``|g_B|^2``."""
        if global_batch <= local_batch:
            raise ValueError(f"the noise scale needs global_batch ({global_batch}) > local_batch ({local_batch}): "
                             "two or more ranks.")
        b, big = float(local_batch), float(global_batch)
        sqr = (big * global_sqr - b * local_sqr) / (big - b)
        var = (local_sqr - global_sqr) / (1.0 / b - 1.0 / big)
        s = self.smoothing if self.measurements else 0.0
        self.grad_sqr = sqr if self.grad_sqr is None else s * self.grad_sqr + (1 - s) * sqr
        self.grad_var = var if self.grad_var is None else s * self.grad_var + (1 - s) * var
        self.measurements += 1

    @property
    def noise_scale(self) -> float | None:
        """``phi = tr(S) / |G|^2`` in samples, or None before a measurement (clamped to >= 0)."""
        if self.grad_sqr is None or self.grad_var is None:
            return None
        return max(self.grad_var, 0.0) / max(self.grad_sqr, 1e-30)


@dataclass
class _HookState:
    local_sqr: float = 0.0
    global_sqr: float = 0.0
    world_size: int = 1


def _noise_hook(state, bucket):  # no annotations: DDP checks them against its own types
    """DDP's all-reduce of a gradient bucket that also records the bucket's local and averaged squared norms."""
    buffer = bucket.buffer()
    state.local_sqr += float(buffer.pow(2).sum())
    buffer.div_(state.world_size)
    future = dist.all_reduce(buffer, group=dist.group.WORLD, async_op=True).get_future()  # data plane: the bucket's device

    def done(fut: torch.futures.Future) -> torch.Tensor:
        out = fut.value()[0]
        state.global_sqr += float(out.pow(2).sum())
        return out

    return future.then(done)


class GradientNoiseProbe:
    """Measures the gradient noise scale of a DDP module during training (a communication hook; see module docs).

    Call :meth:`attach` once before the first backward and :meth:`end_step` after every optimizer step.
    """

    def __init__(self, estimator: NoiseScaleEstimator | None = None) -> None:
        self.estimator = estimator or NoiseScaleEstimator()
        self._state = _HookState()
        self.attached = False

    def attach(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Registers the hook (an all-reduce that also records the norms) on ``ddp``."""
        self._state.world_size = dist.get_world_size()
        ddp.register_comm_hook(self._state, _noise_hook)
        self.attached = True

    def end_step(self, local_batch: int) -> float | None:
        """Folds the step's norms into the estimate (a scalar all-reduce on every rank); the noise scale."""
        state, world = self._state, self._state.world_size
        if world > 1 and state.global_sqr > 0:
            local = torch.tensor([state.local_sqr], dtype=torch.float64)
            dist.all_reduce(local, group=control_plane.group())
            self.estimator.update(float(local) / world, state.global_sqr, local_batch, local_batch * world)
        state.local_sqr = state.global_sqr = 0.0
        return self.estimator.noise_scale


@dataclass
class StepTimeModel:
    """``step_time(b) = a + c * b`` over per-rank batch ``b``, fitted to observed step times."""

    observations: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))

    def observe(self, per_rank_batch: int, seconds: float) -> None:
        self.observations[int(per_rank_batch)].append(float(seconds))

    def coefficients(self) -> tuple[float, float]:
        """``(a, c)``; ``(0, t/b)`` with one batch observed; ``ValueError`` with none."""
        points = [(b, float(np.median(t))) for b, t in self.observations.items() if t]
        if not points:
            raise ValueError("no step time observed yet; observe() some steps first.")
        if len(points) == 1:
            b, t = points[0]
            return 0.0, t / b
        x, y = np.array(points).T
        c, a = np.polyfit(x, y, 1)
        return max(float(a), 0.0), max(float(c), 1e-12)

    def step_time(self, per_rank_batch: float) -> float:
        a, c = self.coefficients()
        return a + c * per_rank_batch


@dataclass
class GoodputModel:
    """Goodput of ``(world_size, global batch)`` from a noise scale and a step-time model (see module docs).

    Args:
        base_batch: the global batch the learning rate was tuned for (``B0``).
        min_gain: a switch must raise predicted goodput by at least this fraction (hysteresis).
    """

    base_batch: int
    noise_scale: float | None = None
    step_times: StepTimeModel = field(default_factory=StepTimeModel)
    min_gain: float = 0.05

    def efficiency(self, global_batch: int) -> float:
        """``(phi + B0) / (phi + B)``; 1 while no noise scale is known."""
        if self.noise_scale is None:
            return 1.0
        return (self.noise_scale + self.base_batch) / (self.noise_scale + global_batch)

    def throughput(self, world_size: int, global_batch: int) -> float:
        return global_batch / self.step_times.step_time(global_batch / world_size)

    def goodput(self, world_size: int, global_batch: int) -> float:
        return self.throughput(world_size, global_batch) * self.efficiency(global_batch)

    def worth_switching(self, world_size: int, current: int, candidate: int) -> bool:
        """Whether ``candidate`` beats ``current`` by more than ``min_gain`` at ``world_size``."""
        return self.goodput(world_size, candidate) > (1.0 + self.min_gain) * self.goodput(world_size, current)
