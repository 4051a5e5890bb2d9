"""Exit of a finished multi-process rank without C++ static destructors.

One of them sometimes destroys a still-joinable thread and aborts a finished process ("terminate called
without an active exception": 3 in 18 ``torchrun`` runs here, and in the test suite's popen launches),
which fails the job; ``torchrun`` would even restart it. A rank whose ``fit`` finished and that raised
nothing since exits with status 0 right after the exit handlers registered after the strategy's set-up
(a ``sys.exit(n)`` after a finished ``fit`` therefore exits with 0). The process group is destroyed first.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

_state: dict[str, Any] = {"fit_finished": False, "failed": False, "excepthook": None, "train_ended": False}


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _record_failure(*args: Any) -> None:
    """``sys.excepthook``: notes that the process is failing, then defers to the hook it replaced."""
    _state["failed"] = True
    _state["excepthook"](*args)


def _exit_after_finished_fit() -> None:
    if _state["fit_finished"] and not _state["failed"]:
        leave()


def leave() -> None:
    """Ends this process at once with status 0 (logs and streams flushed, no exit handlers, no static destructors): a
    finished rank (see module docs), or one a shrink the job asked for retires in the middle of ``fit``."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def install() -> None:
    """Destroys the process group at exit, and ends a finished rank without static destructors (see module docs)."""
    if _state["excepthook"] is None:
        _state["excepthook"], sys.excepthook = sys.excepthook, _record_failure
        atexit.register(_exit_after_finished_fit)  # registered first, so it runs after the destroy below
    atexit.register(_destroy_process_group)


def failing() -> bool:
    """Whether an uncaught exception is ending the process."""
    return bool(_state["failed"])


def fit_finished(multi_process: bool) -> None:
    """Marks ``fit`` as finished (the strategy's ``on_train_end`` ran); a single process (a notebook, a test) exits as
    usual."""
    _state["fit_finished"], _state["train_ended"] = multi_process, True


def end_skipped_fit(module: Any, end: Callable[[], None]) -> None:
    """At the strategy's teardown: calls ``end`` (the strategy's ``on_train_end``) when the ``fit`` of ``module``'s
    trainer is returning normally without its training loop having run: the job resumed at its last step (a restart
    after its final commit, or a checkpoint of it), and Lightning skips a fit loop that is done. Then clears the mark
    of an ended fit for the next ``fit`` of this process (``end`` sets it)."""
    try:
        trainer = module.trainer if module is not None else None
    except RuntimeError:  # (a module no trainer holds)
        trainer = None
    if (trainer is not None and not _state["train_ended"] and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING and trainer.fit_loop.done):
        end()
    _state["train_ended"] = False
