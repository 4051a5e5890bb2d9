"""An add-on never ends a training run: the guard around the hooks of the add-on callbacks (``ThroughputMonitor``,
``ResourceAdvisor``, ``PipelineTuner``, ``ElasticBatchScaler``).

An exception raised inside a :func:`guarded` hook is reported once, on the rank it happened on: one
``addon_failed`` event (:mod:`~lightning_dlrover.monitor.events`: add-on, hook, error type and message, what it
stepped back to) and one warning. The add-on then steps back to a safe state (its ``step_back()`` puts back a
half-applied knob and says what it stepped back to), its guarded hooks do nothing for the rest of its life, and
the fit goes on::

    class MyAddon(Callback):
        @guarded
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx): ...

        def step_back(self) -> str:          # optional
            ...                              # restore what a half-done change left
            return "batch 512, learning rate 0.1 (the last completed change)"

Not caught (they are not the add-on's to hide): an error raised inside ``torch.distributed`` (a collective that
fails means a lost peer, which the strategy's fault tolerance handles), inside the strategy or fault tolerance
(``lightning_dlrover/strategy``, ``lightning_dlrover/fault``), ``MemoryError``, and anything not an ``Exception``
(``KeyboardInterrupt``, ``SystemExit``). The user's own model and the strategy are never guarded: only add-on hooks.

An add-on whose hooks hold collectives keeps the ranks in step itself when it fails on some ranks only (e.g. the
monitor's failed rank still joins its all-reduce); see each add-on.

This module imports neither Lightning nor torch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from lightning_dlrover.log import get_logger
from lightning_dlrover.monitor.events import emit

log = get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
_ATTR = "_addon_failure"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Code whose errors the guard lets through: collectives, the strategy, fault tolerance.
_NOT_OURS = (os.sep + os.path.join("torch", "distributed") + os.sep, os.path.join(_PACKAGE, "strategy") + os.sep,
             os.path.join(_PACKAGE, "fault") + os.sep)


@dataclass(frozen=True)
class AddonFailure:
    """How an add-on failed (kept on the add-on: :func:`failure`)."""

    addon: str
    hook: str
    error_type: str
    error: str
    stepped_back_to: str


def is_addon_error(error: BaseException) -> bool:
    """Whether the guard may catch ``error``: an ``Exception`` (not ``MemoryError``) none of whose frames ran in
    ``torch.distributed``, the strategy or fault tolerance."""
    if not isinstance(error, Exception) or isinstance(error, MemoryError):
        return False
    if type(error).__module__.startswith("torch.distributed"):  # DistError and its kinds
        return False
    tb = error.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if any(part in name for part in _NOT_OURS):
            return False
        tb = tb.tb_next
    return True


def failure(addon: object) -> AddonFailure | None:
    """The add-on's failure, ``None`` while it works."""
    return getattr(addon, _ATTR, None)


def report_failure(addon: object, hook: str, error: BaseException, step: int | None = None) -> AddonFailure:
    """Steps ``addon`` back (its ``step_back()``, if it has one), records its failure, emits one ``addon_failed``
    event and logs one warning; a second failure of the same add-on is not reported again. Never raises."""
    known = failure(addon)
    if known is not None:
        return known
    name = type(addon).__name__
    stepped = "off for the rest of the fit"
    step_back = getattr(addon, "step_back", None)
    if callable(step_back):
        try:
            stepped = f"{step_back()}; off for the rest of the fit"
        except Exception as err:  # noqa: BLE001 - the add-on is off either way; say what is left
            stepped = f"off for the rest of the fit (stepping back failed too: {type(err).__name__}: {err})"
    record = _report(name, hook, error, stepped, step, "Training goes on without it.")
    setattr(addon, _ATTR, record)
    return record


def report_degraded(addon: object, part: str, error: BaseException, stepped_back_to: str,
                    step: int | None = None) -> None:
    """Reports that ``part`` of a working add-on failed (e.g. the advisor's job history) and that the add-on goes on
    as ``stepped_back_to`` says (e.g. "in memory, no history"): one ``addon_failed`` event and one warning, the first
    time ``part`` fails. Never raises."""
    reported = addon.__dict__.setdefault("_addon_degraded", set())
    if part in reported:
        return
    reported.add(part)
    _report(type(addon).__name__, part, error, stepped_back_to, step, "The add-on and training go on.")


def _report(name: str, hook: str, error: BaseException, stepped: str, step: int | None, then: str) -> AddonFailure:
    message = str(error).splitlines()[0][:300] if str(error) else ""
    record = AddonFailure(name, hook, type(error).__name__, message, stepped)
    try:
        emit("addon_failed", step=step, addon=name, hook=hook, error_type=record.error_type, error=message,
             stepped_back_to=stepped)
    except Exception as err:  # noqa: BLE001 - an unwritable events file must not end the fit either
        log.warning(f"{name}: could not record the addon_failed event ({err})")
    log.warning(f"{name} failed in {hook} ({record.error_type}: {message}); {stepped}. {then}")
    return record


def _step(addon: Any, args: tuple) -> int | None:
    """The training step: of the hook's trainer argument, else of the trainer the add-on keeps (``_trainer``)."""
    trainer = args[0] if args and hasattr(args[0], "global_step") else getattr(addon, "_trainer", None)
    step = getattr(trainer, "global_step", None)
    return step if isinstance(step, int) else None


def guarded(hook: F | str) -> F | Callable[[F], F]:
    """Wraps an add-on's hook (or a method others call, e.g. the advisor's ``set_budget``): once the add-on failed it
    does nothing (returns ``None``); an error the guard may catch (:func:`is_addon_error`) is reported
    (:func:`report_failure`) instead of raised. ``@guarded("set_budget")`` names the hook or method a helper runs in,
    for the report."""
    if isinstance(hook, str):
        return lambda method: _guard(method, hook)
    return _guard(hook, hook.__name__)


def _guard(hook: F, name: str) -> F:
    @functools.wraps(hook)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if failure(self) is not None:
            return None
        try:
            return hook(self, *args, **kwargs)
        except Exception as error:
            if not is_addon_error(error):
                raise
            report_failure(self, name, error, _step(self, args))
            return None

    return run  # type: ignore[return-value]
