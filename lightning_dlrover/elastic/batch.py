"""Batch-size policies and learning-rate rules for a job whose world size changes.

A job trains with any global batch in a user range ``[min, max]`` (Saxena et al., MASCOTS 2020). When its
world size changes, a *policy* picks the new global batch (one the world size divides, whose per-rank share
fits the per-rank limit) and a *rule* rescales every learning rate by the batch ratio:

* policies: ``keep_global`` (today's behaviour: the same global batch, each rank's share changes),
  ``keep_per_rank`` (each rank keeps its share, the global batch follows the world size), ``goodput``
  (the batch that maximises throughput x statistical efficiency, see :mod:`lightning_dlrover.elastic.goodput`);
* LR rules, from the batch ratio ``k = new / old``: ``linear`` (``lr * k``, Goyal et al.), ``sqrt``
  (``lr * sqrt(k)``, Krizhevsky), ``adascale`` (``lr * gain``, with AdaScale's gain
  ``(phi / old + 1) / (phi / new + 1)`` from the gradient noise scale ``phi``; ``1 <= gain <= k``), ``none``.

Learning rates are changed in the dense optimizers' ``param_groups`` and in TorchRec's fused embedding
optimizers (``DistributedModelParallel.fused_optimizer``), whose FBGEMM kernels get the new rate at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from lightning_dlrover.torchrec_glue import set_fused_learning_rate

Policy = Literal["keep_global", "keep_per_rank", "goodput"]
LRRule = Literal["linear", "sqrt", "adascale", "none"]
POLICIES: tuple[str, ...] = ("keep_global", "keep_per_rank", "goodput")
LR_RULES: tuple[str, ...] = ("linear", "sqrt", "adascale", "none")


@dataclass(frozen=True)
class BatchRange:
    """Global batches a job trains well with: ``min <= batch <= max``, and at most ``per_rank_max`` per rank."""

    min: int
    max: int
    per_rank_max: int | None = None

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) and v >= 1 for v in (self.min, self.max)):
            raise ValueError(f"batch range [{self.min}, {self.max}]: both ends must be positive integers.")
        if self.min > self.max:
            raise ValueError(
                f"batch range [{self.min}, {self.max}]: min > max; give the smallest global batch first "
                f"(e.g. [{self.max}, {self.min}])."
            )
        if self.per_rank_max is not None and self.per_rank_max < 1:
            raise ValueError(f"per_rank_max={self.per_rank_max} must be a positive integer (or None for no limit).")

    def feasible(self, world_size: int) -> list[int]:
        """Global batches in range that ``world_size`` divides and whose per-rank share fits ``per_rank_max``."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be positive.")
        hi = self.max if self.per_rank_max is None else min(self.max, self.per_rank_max * world_size)
        first = -(-self.min // world_size) * world_size
        return list(range(first, hi + 1, world_size))

    def check(self, world_size: int) -> list[int]:
        """:meth:`feasible`, or a ``ValueError`` saying why no batch fits ``world_size`` and how to fix it."""
        batches = self.feasible(world_size)
        if not batches:
            limit = "" if self.per_rank_max is None else f" with at most {self.per_rank_max} samples per rank"
            raise ValueError(
                f"no global batch in [{self.min}, {self.max}] is divisible by world size {world_size}{limit}; "
                f"widen the range to include a multiple of {world_size} (e.g. max >= "
                f"{-(-self.min // world_size) * world_size}) or raise the per-rank limit."
            )
        return batches


@dataclass(frozen=True)
class BatchDecision:
    """A policy's choice: the global batch, each rank's share, and the LR factor its rule gives."""

    global_batch: int
    per_rank: int
    lr_factor: float
    policy: str
    rule: str


def _nearest(batches: list[int], target: float) -> int:
    return min(batches, key=lambda b: (abs(b - target), b))


def choose_batch(
    policy: Policy,
    batch_range: BatchRange,
    old_world_size: int,
    new_world_size: int,
    old_global_batch: int,
    goodput: Callable[[int, int], float] | None = None,
) -> int:
    """The new global batch under ``policy`` (see the module docs).

    ``goodput(world_size, global_batch)`` is needed by the ``goodput`` policy. ``keep_global`` and
    ``keep_per_rank`` take the feasible batch nearest their target when the target itself does not fit.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is unknown; choose one of {list(POLICIES)}.")
    batches = batch_range.check(new_world_size)
    if policy == "keep_global":
        return _nearest(batches, old_global_batch)
    if policy == "keep_per_rank":
        return _nearest(batches, old_global_batch / max(old_world_size, 1) * new_world_size)
    if goodput is None:
        raise ValueError("the goodput policy needs a goodput model (see lightning_dlrover.elastic.goodput).")
    return max(batches, key=lambda b: (goodput(new_world_size, b), -abs(b - old_global_batch)))


def adascale_gain(noise_scale: float, old_batch: int, new_batch: int) -> float:
    """AdaScale's gain of ``new_batch`` over ``old_batch``: ``(phi/old + 1) / (phi/new + 1)``, ``phi`` the
    gradient noise scale in samples; between 1 (no noise) and ``new/old`` (all noise)."""
    phi = max(float(noise_scale), 0.0)
    return (phi / old_batch + 1.0) / (phi / new_batch + 1.0)


def lr_factor(rule: LRRule, old_batch: int, new_batch: int, noise_scale: float | None = None) -> float:
    """The factor ``rule`` multiplies every learning rate by when the global batch goes ``old -> new``."""
    if rule not in LR_RULES:
        raise ValueError(f"LR rule {rule!r} is unknown; choose one of {list(LR_RULES)}.")
    ratio = new_batch / old_batch
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    if rule == "adascale":
        if noise_scale is None:
            raise ValueError("the adascale LR rule needs a gradient noise scale (a GoodputModel's estimate).")
        return adascale_gain(noise_scale, old_batch, new_batch)
    return 1.0


def decide(
    policy: Policy,
    rule: LRRule,
    batch_range: BatchRange,
    old_world_size: int,
    new_world_size: int,
    old_global_batch: int,
    goodput: Callable[[int, int], float] | None = None,
    noise_scale: float | None = None,
) -> BatchDecision:
    """:func:`choose_batch` and :func:`lr_factor` together."""
    batch = choose_batch(policy, batch_range, old_world_size, new_world_size, old_global_batch, goodput)
    return BatchDecision(batch, batch // new_world_size, lr_factor(rule, old_global_batch, batch, noise_scale),
                         policy, rule)


def _leaf_optimizers(optimizer: Any) -> Iterable[Any]:
    children = getattr(optimizer, "optimizers", None)  # TorchRec's CombinedOptimizer: [(key, optimizer)]
    if children and not callable(children):
        for child in children:
            yield from _leaf_optimizers(child[1] if isinstance(child, tuple) else child)
    else:
        yield getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer wraps the real one


def scale_learning_rates(optimizers: Iterable[Any], factor: float) -> list[float]:
    """Multiplies the ``lr`` of every param group of ``optimizers`` by ``factor``; returns the new rates.

    Accepts torch optimizers, Lightning's wrappers and TorchRec's fused (``KeyedOptimizer`` /
    ``CombinedOptimizer``) ones; FBGEMM kernels behind a fused optimizer are given the new rate at once.
    """
    rates = []
    for optimizer in optimizers:
        for leaf in _leaf_optimizers(optimizer):
            for group in leaf.param_groups:
                group["lr"] = group["lr"] * factor
                rates.append(float(group["lr"]))
            set_fused_learning_rate(leaf)
    return rates


def learning_rates(optimizers: Iterable[Any]) -> list[float]:
    """The ``lr`` of every param group of ``optimizers`` (same order as :func:`scale_learning_rates`)."""
    return [float(g["lr"]) for o in optimizers for leaf in _leaf_optimizers(o) for g in leaf.param_groups]


def warmup_rate(old: float, new: float, step: int, steps: int) -> float:
    """The learning rate ``step`` optimizer steps into a linear warm-up from ``old`` to ``new`` over ``steps``
    steps: step 1 trains with ``old + (new - old) / steps``, step ``steps`` and later with ``new``."""
    if steps <= 0 or step >= steps:
        return new
    return old + (new - old) * max(step, 0) / steps
