"""The add-ons' up-front checks, run where the job is launched, before any rank starts.

An add-on of the package (``ElasticBatchScaler``, ``ResourceAdvisor``, ...) can refuse a config that it could only
fail on later, on every rank: a batch range no global batch of the world size fits, a job history that cannot be
opened. It says so in its ``validate(world_size)``. :func:`validate_addons` runs every such check;
:class:`~lightning_dlrover.strategy.DLRoverStrategy` calls it from its launcher (``Trainer(strategy=DLRoverStrategy(...),
callbacks=[...]).fit(...)``, and ``lightning-dlrover fit``): in the launching process before Lightning's launcher
starts the other ranks, and under ``torchrun`` in every rank before any collective, so every rank raises the same
:class:`AddonConfigError` and none waits for a peer that has stopped.
"""

from __future__ import annotations

from collections.abc import Iterable

import lightning.pytorch as pl


class AddonConfigError(ValueError):
    """One or more of the package's add-ons refuse their config: the message holds each one's reason and fix, a line
    each."""


class StrategyConfigError(ValueError):
    """The strategy's own options cannot run at the trainer's world size (e.g. ``parity="auto"`` on one rank)."""


def validate_addons(callbacks: Iterable[object], world_size: int) -> None:
    """Runs ``validate(world_size)`` of each of the package's add-ons in ``callbacks``.

    Raises:
        AddonConfigError: one or more add-ons refuse their config; the message holds each add-on's reason and fix, one a
            line.
    """
    refused = []
    for callback in callbacks:
        if type(callback).__module__.startswith("lightning_dlrover.") and callable(getattr(callback, "validate", None)):
            try:
                callback.validate(world_size)
            except ValueError as err:
                refused.append(str(err))
    if refused:
        raise AddonConfigError("\n".join(refused))


def validate_trainer_addons(trainer: pl.Trainer) -> None:
    """:func:`validate_addons` of the trainer's callbacks at its world size, and the strategy's parity (``"auto"``, or
    a ``ParityConfig`` whose ``k + r`` ranks the world size must hold) at that size (:class:`StrategyConfigError`)."""
    from lightning_dlrover.fault import ParityConfig, ParityPlacement
    from lightning_dlrover.strategy.auto_parity import check

    parity = getattr(trainer.strategy, "parity", None)
    try:
        check(parity, trainer.world_size)
        if isinstance(parity, ParityConfig):
            ParityPlacement(trainer.world_size, parity.k, parity.r)  # raises, naming k + r and the world size
    except ValueError as err:
        raise StrategyConfigError(str(err)) from None
    validate_addons(trainer.callbacks, trainer.world_size)
