"""The package's loggers: prose for people goes through :mod:`logging`, under the ``lightning_dlrover`` namespace.

Two kinds of lines, told apart by where they go::

    log = get_logger(__name__)
    log.info("node 1 takes back node rank 0")   # stderr:  [rank: 2] node 1 takes back node rank 0
    rank_zero_report(log, table)                # stdout, on global rank 0 only, as is (no prefix)

- a rank's own log line (``log.info``, ``log.warning``...) goes to **stderr**, prefixed ``[rank: N] `` (Lightning's
  ``rank_prefixed_message``) once the rank is known: ``torch.distributed``'s rank, else ``$RANK``; none in a
  single process;
- what the job reports to its user (summary tables, a tuner's or the advisor's report, per-step digests), through
  :func:`rank_zero_report`, is written by global rank 0 only, to **stdout**, unprefixed (Lightning's
  ``rank_zero_info``).

The handler is installed once on the ``lightning_dlrover`` logger, which does not propagate to the root logger (a
line is never printed twice); it looks ``sys.stdout`` / ``sys.stderr`` up at each line (so redirections and
pytest's ``capsys`` see it) and flushes it (a rank may be killed right after). The level is INFO, or
``$LIGHTNING_DLROVER_LOG_LEVEL`` (``DEBUG``, ``WARNING``, ..., or a number). Change the handlers and level of
``logging.getLogger("lightning_dlrover")`` to send the lines elsewhere.

This module imports neither Lightning nor torch (the launchers use it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

#: The namespace of every logger of the package.
ROOT = "lightning_dlrover"
#: Environment variable: the level of the package's loggers (default INFO).
LEVEL_ENV = "LIGHTNING_DLROVER_LOG_LEVEL"
_RANK_ZERO = "rank_zero"  # LogRecord attribute set by rank_zero_report


def global_rank() -> int | None:
    """This process's global rank: ``torch.distributed``'s when a process group is up (it follows in-process
    recovery), else ``$RANK``; ``None`` when neither is known (a single process, a launcher)."""
    dist = sys.modules.get("torch.distributed")  # never imported here: not initialised if nobody imported it
    with contextlib.suppress(Exception):  # during interpreter shutdown
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    value = os.environ.get("RANK", "")
    return int(value) if value.isdigit() else None


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rank = None if getattr(record, _RANK_ZERO, False) else global_rank()
        return text if rank is None else f"[rank: {rank}] {text}"


class _Handler(logging.Handler):
    """Writes a :func:`rank_zero_report` record to the current ``sys.stdout``, any other to the current ``sys.stderr``,
    and flushes it."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(_Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            stream = sys.stdout if getattr(record, _RANK_ZERO, False) else sys.stderr
            stream.write(text + "\n")
            stream.flush()
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 (logging's convention: report it on stderr, never raise)
            self.handleError(record)


def _level() -> int:
    value = os.environ.get(LEVEL_ENV, "").strip()
    if not value:
        return logging.INFO
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value.upper())
    return level if isinstance(level, int) else logging.INFO


def _install() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(h.get_name() == ROOT for h in root.handlers):  # by name: found again after a reload of this module
        handler = _Handler()
        handler.set_name(ROOT)
        root.addHandler(handler)
        root.setLevel(_level())
        root.propagate = False
    return root


def get_logger(name: str = ROOT) -> logging.Logger:
    """The logger ``name`` under the ``lightning_dlrover`` namespace (``__name__`` of a module of the package is
    used as is; another name is put under it); installs the package's handler on first use."""
    _install()
    if name != ROOT and not name.startswith(ROOT + "."):
        name = f"{ROOT}.{name}"
    return logging.getLogger(name)


def rank_zero_report(logger: logging.Logger, message: str, *args: Any) -> None:
    """Logs ``message`` at INFO on global rank 0 only (rank unknown counts as 0), to stdout and without a rank
    prefix: what the job reports to its user."""
    if (global_rank() or 0) == 0:
        logger.info(message, *args, extra={_RANK_ZERO: True})


#: Third-party warnings a job of this package triggers with nothing of its own to change, silenced by
#: :func:`quiet_known_warnings` (the one place where the package filters what others print): ``(message regex,
#: regex of the module the warning is attributed to, why it is noise)``. Anything else still prints.
KNOWN_WARNINGS: list[tuple[str, str, str]] = [
    (r"`broadcast_buffers` is deprecated", r"torchrec\.distributed\.model_parallel$",
     "TorchRec's DDP wrapper passes broadcast_buffers=False itself"),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree$",
     "Lightning's own pytree copy, on every batch it measures"),
    (r"Starting from v1\.9\.0, `tensorboardX` has been removed", r"lightning\.pytorch\.",
     "Lightning's default logger is a CSVLogger without TensorBoard installed: what the demo wants"),
    (r"Couldn't infer the batch indices fetched from your dataloader: `EvalLoader`", r"lightning\.pytorch\.",
     "EvalLoader's batches carry each sample's index themselves (Lightning records indices only for a DataLoader)"),
    (r"Using a non-tuple sequence for multidimensional indexing", r"torchmetrics\.utilities\.distributed$",
     "torchmetrics' own gather of uneven per-rank states (the test AUC's), on torch 2.13"),
]
#: Third-party log lines (not warnings) silenced alike: ``(logger name, message prefix, why)``.
KNOWN_LOG_LINES: list[tuple[str, str, str]] = [
    ("torch.fx._symbolic_trace", "is_fx_tracing will return true for both",
     "TorchRec calls torch.fx.is_fx_tracing while it shards; torch logs this on every call"),
    ("lightning.pytorch.utilities.rank_zero", "\U0001f4a1 Tip: For seamless cloud logging",
     "an advertisement Lightning prints when no LitLogger is configured"),
]


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_known_warnings() -> None:
    """Silences the third-party warnings and log lines of :data:`KNOWN_WARNINGS` and :data:`KNOWN_LOG_LINES`, each
    by its message and its module or logger, in this process (``DLRoverStrategy`` calls it; calling again is a no-op).
    """
    import warnings

    for message, module, _ in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)
    for name, prefix, _ in KNOWN_LOG_LINES:
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefix) and f.prefix == prefix for f in target.filters):
            target.addFilter(_DropPrefix(prefix))
