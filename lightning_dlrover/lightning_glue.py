"""The few places where lightning-dlrover reaches into Lightning internals, each because no public API exists.

- :func:`dump_trainer_state` / :func:`resume_from`: Lightning builds and consumes checkpoint dicts only in its
  private ``_CheckpointConnector``; the commit snapshots the trainer's state with it and hands a restored
  state to Lightning as if it were a loaded checkpoint.
- :func:`call_after_every_step`: no hook runs once a training batch is entirely over (``on_train_batch_end``
  runs before the LightningModule's own hook, plateau schedulers and validation); the epoch loop's
  ``on_advance_end`` is wrapped on this trainer only.
- :class:`InnerDDPRedirection` / :func:`prepare_inner_ddp_for_backward`: Lightning's DDP support for manual
  optimisation looks for ``DistributedDataParallel`` at the top; TorchRec nests it inside
  ``DistributedModelParallel``.
- :func:`rerun_fit_loop` / :func:`load_trainer_state`: in-process recovery restores the trainer's state in the
  middle of ``fit`` through the same connector and runs the fit loop again; ``ModelCheckpoint``'s memory of the
  last step it saved (``_last_global_step_saved``, not in its ``state_dict``) is rolled back with the step.
- :func:`check_before_launch`: no hook runs in the launching process before Lightning's launcher starts the other
  ranks (``Callback.setup`` and the strategy's ``setup_environment`` run in every rank after it); the strategy's
  launcher object gets a ``launch`` that runs a check first (the launcher keeps its class: Lightning tells its kinds
  apart by ``isinstance``, e.g. to kill the ranks it started on Ctrl+C).
- :func:`recount_epoch`: Lightning counts an epoch's batches once, at set-up, in the fit loop's private data
  fetcher and combined loader; ``ElasticBatchScaler`` recounts them after a batch-size change.

This module sits at the bottom of the package, beside :mod:`lightning_dlrover.torchrec_glue` (the only module it
imports from the package, for the DDP inside ``DistributedModelParallel``): imports only point down, and
``elastic/`` (a middle layer, which must not import ``strategy/``) calls it as well as ``strategy/`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_dlrover.torchrec_glue import dmp_wrapped_module


def dump_trainer_state(trainer: pl.Trainer) -> dict[str, Any]:
    """The trainer's checkpoint dict (loops, data position, callbacks, dense optimizers, schedulers)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def resume_from(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    """Makes Lightning restore ``state`` at the start of ``fit`` as if it had loaded it from a checkpoint."""
    trainer._checkpoint_connector._loaded_checkpoint = state


def call_after_every_step(trainer: pl.Trainer, fn: Callable[[], None]) -> None:
    """Calls ``fn()`` after every training batch once nothing of it is left to run, before the next batch is fetched."""
    loop = trainer.fit_loop.epoch_loop
    if getattr(loop, "_dlrover_after_step", None) is not None:
        loop._dlrover_after_step = fn
        return
    original = loop.on_advance_end

    def on_advance_end(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        loop._dlrover_after_step()

    loop._dlrover_after_step = fn
    loop.on_advance_end = on_advance_end


def inner_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` that TorchRec's ``DistributedModelParallel`` wraps the dense part in."""
    wrapped = dmp_wrapped_module(model)
    return wrapped if isinstance(wrapped, DistributedDataParallel) else None


class InnerDDPRedirection(_DDPForwardRedirection):
    """Lightning's DDP forward redirection applied to the DDP inside ``DistributedModelParallel``: under manual
    optimisation DDP must not prepare its reducer in the forward (the training step's output is not the loss)."""

    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: pl.LightningModule) -> None:
        super().on_after_inner_forward(inner_ddp(wrapper_module) or wrapper_module, original_module)

    def on_after_outer_forward(self, wrapper_module: nn.Module, original_module: pl.LightningModule) -> None:
        super().on_after_outer_forward(inner_ddp(wrapper_module) or wrapper_module, original_module)


def prepare_inner_ddp_for_backward(model: nn.Module, loss: Tensor) -> None:
    """Under manual optimisation, prepares the inner DDP's reducer with the loss ``manual_backward`` is given."""
    ddp = inner_ddp(model)
    if ddp is not None and ddp.require_backward_grad_sync:
        prepare_for_backward(ddp, loss)


def rerun_fit_loop(trainer: pl.Trainer, recover: Callable[[BaseException], bool],
                   before_first_run: Callable[[], None] | None = None) -> None:
    """Makes the fit loop run again, inside the same ``fit``, after ``recover(error)`` restored a committed state
    following a failure (``False``: the error propagates as before). ``before_first_run()`` runs once, first.

    An error raised by ``recover`` itself (or by ``before_first_run``) is recovered from like one raised by a step: a
    peer lost while the ranks run a recovery's last collectives (e.g. the digest check after a grow) is one more loss.
    """
    loop = trainer.fit_loop
    original = loop.run
    pending = [before_first_run] if before_first_run is not None else []

    def recovered(error: Exception) -> None:
        while True:
            try:
                if recover(error):
                    return
            except Exception as again:
                if again is error:
                    raise
                error = again  # a failure of the recovery itself: recover from that one
            else:
                raise error

    def run() -> None:
        while True:
            try:
                while pending:
                    pending.pop()()
                return original()
            except Exception as error:
                recovered(error)

    loop.run = run


def load_trainer_state(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    """Restores ``state`` (the trainer's checkpoint dict) into a trainer in the middle of ``fit``: loops, dense
    optimizers, schedulers, callbacks, and the data position (the training data loader is set up again)."""
    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = state
    try:
        connector.restore_callbacks()
        connector.restore_training_state()
    finally:
        connector._loaded_checkpoint = {}
    trainer.fit_loop._combined_loader = None  # set up again by the next run, at the restored position
    for callback in trainer.checkpoint_callbacks:
        # ModelCheckpoint skips a step it remembers saving, and that memory is not in its state_dict: a survivor
        # that saved a step which was then rolled back would skip the save (a collective) its replacement makes.
        if getattr(callback, "_last_global_step_saved", -1) > trainer.global_step:
            callback._last_global_step_saved = trainer.global_step


def recount_epoch(trainer: pl.Trainer, batches_left: Callable[[], int]) -> None:
    """Makes the current epoch end after ``batches_left()`` more batches (the loader's full batches left, at a new
    batch size) and later epochs take their length from the loader again; does nothing (and does not call
    ``batches_left``) under a user's ``limit_train_batches`` or before the fit loop's data are set up.

    Lightning counts an epoch's batches once, from ``len(loader)`` at set-up (the fit loop's ``max_batches``, the
    combined loader's limit, the data fetcher's length), so a smaller batch would end the epoch early and skip its
    last samples. Lightning has no public API for it: the fit loop's data fetcher and combined loader are reached
    directly."""
    loop = trainer.fit_loop
    fetcher, combined = getattr(loop, "_data_fetcher", None), getattr(loop, "_combined_loader", None)
    if trainer.limit_train_batches != 1.0 or fetcher is None or combined is None or fetcher.length is None:
        return
    left = batches_left()
    combined.limits = None  # later epochs: len(loader) at the batch size then in use
    fetcher.length = fetcher.fetched + left
    fetcher.done = left == 0
    loop.epoch_loop.batch_progress.is_last_batch = fetcher.done
    loop.max_batches = float("inf")  # the epoch ends on the fetcher's last batch
    if trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch is not None:
        trainer.val_check_batch = float("inf")  # validation stays at the epoch's end


def check_before_launch(launcher: Any, check: Callable[[pl.Trainer], None]) -> Any:
    """Makes ``launcher`` (a strategy's ``launcher``; ``None`` passes through) call ``check(trainer)`` before it
    starts any process or runs the trainer's function; an exception from ``check`` propagates from ``fit``. Done once
    per launcher; returns it."""
    if launcher is None or getattr(launcher, "_dlrover_checked", False):
        return launcher
    original = launcher.launch

    def launch(function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:
            check(trainer)
        return original(function, *args, trainer=trainer, **kwargs)

    launcher.launch = launch
    launcher._dlrover_checked = True
    return launcher


def reset_inner_ddp(model: nn.Module) -> None:
    """Forgets a training step that failed part-way through DDP's backward (its reducer would refuse the next)."""
    ddp = inner_ddp(model)
    if ddp is not None:
        ddp.reducer._reset_state()


def checkpoint_interval_unset(callback: Any) -> bool:
    """Whether a ``ModelCheckpoint`` was given no interval: no ``every_n_train_steps``, no ``train_time_interval``
    and ``every_n_epochs`` at Lightning's default (1: Lightning keeps no record of whether it was passed)."""
    return (callback._every_n_train_steps == 0 and callback._train_time_interval is None
            and callback._every_n_epochs == 1)


def set_checkpoint_every_n_train_steps(callback: Any, steps: int) -> None:
    """Makes a ``ModelCheckpoint`` save every ``steps`` training steps, as ``every_n_train_steps=steps`` would (its
    saves at the end of an epoch stay)."""
    callback._every_n_train_steps = steps
