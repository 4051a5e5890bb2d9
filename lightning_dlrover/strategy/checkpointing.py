"""How ``DLRoverStrategy`` writes its checkpoints: blocking (the default) or asynchronous (``async_checkpoint=True``).

An asynchronous save blocks training only while the state is gathered and copied (every tensor copied into memory
the next steps do not touch: :func:`~lightning_dlrover.checkpoint.sharded.copy_state`; the copy of the previous save
is reused once its write is over, so the staging memory is allocated once); a background thread then
writes every rank's shards and rank 0's ``meta.pt`` under the temporary name (``<path>.partial``), agrees with the
other ranks' threads that every part is written, and only then renames it to ``path`` (the commit). Until then the
checkpoint does not exist for anyone: not for ``last.ckpt``, a resume, nor the fault manager's fallback (they only
see complete directories). A failed write (disk full, an unwritable directory, a rank's error) is the event
``checkpoint_failed`` and a warning; the temporary directory is removed and training goes on, the previous
checkpoint still the newest.

At most one save is in flight: the next one **waits** for it (the event ``checkpoint_waited`` says how long). It is
not skipped, because Lightning's ``ModelCheckpoint`` records the path it asked for as saved (``last_model_path``,
its top-k) and removes the files it replaces: a skipped save would make that record false. The removals Lightning
asks for while a save is in flight are done after its commit, so the previous checkpoint stays until the next one
counts. ``fit`` waits for the last save at its end, a load waits before it reads, and a process exiting normally
waits at exit.

Why not DCP's ``async_save`` (torch 2.13): it only covers the shards (``dcp.save`` in a thread or a process), while
``meta.pt``, the ranks' agreement and the rename must run after it in the background too, and for the
``torchsnapshot`` backend alike; its default stager cannot copy a ``ShardedTensor`` (``StateDictStager`` calls
``data_ptr()`` on it: ``RuntimeError: torch function 'data_ptr' ... ShardedTensor``, tried here), so the copy is
:func:`~lightning_dlrover.checkpoint.sharded.copy_state`'s either way; its process mode (a spawned daemon process
with a process group of its own, the staged state sent through a pipe) was not tried. So the background thread
calls the backend's own ``save`` (for ``dcp``: ``dcp.save`` with ``process_group=``) on the staged copy, over a gloo
group of its own (created on the first save), so that its collectives never interleave with training's on the
default group or the control plane.

With ``async_checkpoint="precopy"`` a full save copies only the state that is not in the fused embedding tables while
training is blocked; the tables are copied by the background writer before it writes, each row before a training step
writes it (:mod:`~lightning_dlrover.strategy.precopy`), so the checkpoint still holds the state of its step.

With ``incremental_checkpoint_every=N`` every ``N``-th save is full and the others are deltas
(:mod:`~lightning_dlrover.strategy.incremental`: which, and the rows they hold); both modes above apply to either.
A delta's staging is its changed rows and the dense state, so it blocks training for a time in proportion to
the rows touched. A load goes through :meth:`Checkpointing.load`, which restores a delta's chain (or, with a link
missing, the newest complete prefix: the event ``checkpoint_chain_broken`` and a warning).
"""

from __future__ import annotations

import atexit
import errno
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_dlrover import control_plane
from lightning_dlrover.checkpoint import directory, incremental, job
from lightning_dlrover.checkpoint.sharded import flatten
from lightning_dlrover.log import get_logger
from lightning_dlrover.monitor import emit
from lightning_dlrover.strategy import precopy, process_exit
from lightning_dlrover.strategy.incremental import ChainPolicy
from lightning_dlrover.strategy.precopy import PreCopy

log = get_logger(__name__)

#: Environment variable for drills and tests: ``sleep=S`` sleeps ``S`` seconds in the background writer after the
#: shards are written, before ``meta.pt`` and the commit; ``fail=ENOSPC`` (any ``errno`` name) raises that
#: ``OSError`` there. ``,rank=R`` and ``,step=S`` restrict it to one rank, one checkpoint step. With the pre-copy,
#: ``copy_sleep=S`` sleeps ``S`` seconds after each chunk of the background copy, ``chunk_bytes=B`` sets its chunk size
#: (so that training steps certainly run during it), and ``skip_hooks=1`` breaks it on purpose: the steps copy no
#: rows before they write them (the tests check that this is caught).
WRITE_HOOK_ENV = "LIGHTNING_DLROVER_CHECKPOINT_WRITE_HOOK"
#: The least time a rank's background writer waits for the other ranks' (their writes may be slow).
WRITER_TIMEOUT = timedelta(hours=1)


def _hook_fields(step: int) -> dict[str, str]:
    """The fields of ``$LIGHTNING_DLROVER_CHECKPOINT_WRITE_HOOK`` that apply to this rank's save of ``step``."""
    spec = os.environ.get(WRITE_HOOK_ENV)
    if not spec:
        return {}
    fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    if "rank" in fields and int(fields["rank"]) != dist.get_rank():
        return {}
    if "step" in fields and int(fields["step"]) != step:
        return {}
    return fields


def _write_hook(step: int) -> None:
    fields = _hook_fields(step)
    spec = os.environ.get(WRITE_HOOK_ENV)
    if "sleep" in fields:
        time.sleep(float(fields["sleep"]))
    if "fail" in fields:
        code = getattr(errno, fields["fail"])
        raise OSError(code, f"{os.strerror(code)} ({WRITE_HOOK_ENV}={spec})")


class Checkpointing:
    """Saves (blocking or in the background) and removes the strategy's checkpoints; see the module docs."""

    def __init__(self, asynchronous: bool | str, timeout: timedelta | None,
                 incremental_every: int | None = None) -> None:
        if asynchronous not in (True, False, "precopy"):
            raise ValueError(f"async_checkpoint={asynchronous!r} must be False, True or 'precopy' (a full save copies "
                             "the embedding tables in the background: strategy/precopy.py).")
        self.asynchronous = bool(asynchronous)
        self.precopy: PreCopy | None | bool = asynchronous == "precopy" or None  # True: on, not built yet
        self.policy = ChainPolicy(incremental_every) if incremental_every else None
        self._committed: bool | None = None  # the outcome of the last save (None: none yet)
        self._live_chain: str | None = None  # the chain of the last committed full link (rank 0)
        self.timeout = timeout
        self._group: Any = None
        self._made_for: Any = None  # the default group the writers' group was made for
        self._thread: threading.Thread | None = None
        self._in_flight: job.PendingSave | None = None
        self._reuse: dict[bool, job.PendingSave] = {}  # the last full / delta save whose write is over: its copy
        self._removals: list[Path] = []
        self._lock = threading.Lock()
        self._reported_staging = self._wait_at_exit = self._broken = self._abandoned = False
        #: Seconds the last save blocked training (its wait for the previous one included).
        self.last_blocked_s = 0.0

    def save(self, strategy: Any, checkpoint: dict[str, Any], path: Path) -> None:
        """Writes ``checkpoint`` as a checkpoint directory at ``path`` (a collective; see the module docs)."""
        start = time.perf_counter()
        kwargs = dict(world_size=strategy.world_size, is_global_zero=strategy.is_global_zero,
                      barrier=strategy.barrier, extra_meta=strategy.checkpoint_extra_meta)
        if not self.asynchronous:
            kwargs.update(self._plan(strategy, checkpoint))
            pending = job.save(checkpoint, path, strategy.checkpoint_backend, strategy.fused_optimizer, **kwargs)
            self.last_blocked_s = time.perf_counter() - start
            if self.policy is not None:
                self.policy.settle(True)
                self._after_commit(pending, strategy.is_global_zero)
            self._report_saved(pending, "blocking", start)
            return
        self.wait(path)
        kwargs.update(self._plan(strategy, checkpoint))
        # every rank saves together, so every rank (re)creates the group together: at the first save, after a
        # collective of it failed (a peer's writer timed out: the group cannot be used again), or for a new default
        # group (a replaced rank); one vote, so a rank that never had a group agrees with those that had one
        usable = self._group is not None and not self._broken and self._made_for is dist.group.WORLD
        if not control_plane.all_true(usable):
            self._group, self._broken = dist.new_group(backend="gloo", timeout=self._writer_timeout()), False
            self._made_for = dist.group.WORLD
        delta = kwargs.get("delta") is not None
        if self.precopy and not delta:
            self.precopy = precopy.ensure(self.precopy if isinstance(self.precopy, PreCopy) else None,
                                          strategy.model, lambda: self._structure(strategy, checkpoint))
            kwargs["later"] = self.precopy.paths
        pending = job.prepare(checkpoint, path, strategy.checkpoint_backend, strategy.fused_optimizer, copy=True,
                              reuse=self._reuse.pop(delta, None), **kwargs)
        if pending.later:
            self.precopy.arm(pending.later)  # from here every step copies the rows it looks up before writing them
            self.precopy.active = not _hook_fields(pending.step).get("skip_hooks")
        self.last_blocked_s = time.perf_counter() - start
        if not self._reported_staging:
            self._reported_staging = True
            emit("checkpoint_staging", step=pending.step, bytes=pending.staged_bytes,
                 message=f"asynchronous checkpoints hold {pending.staged_bytes} bytes of staging memory on this rank "
                 "(a copy of its shards, optimizer and trainer state, reused by every save)")
        self._in_flight = pending
        self._thread = threading.Thread(target=self._write, args=(pending, strategy.is_global_zero, start),
                                        name="dlrover-checkpoint-writer", daemon=True)
        self._thread.start()
        if not self._wait_at_exit:  # registered after process_exit's handlers, so it runs before them
            self._wait_at_exit = True
            atexit.register(self.wait)

    def _plan(self, strategy: Any, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``link`` and ``delta`` of the next save for :func:`job.prepare` (nothing without incremental saves; a
        collective with them), after the outcome of the previous save is recorded."""
        if self.policy is None:
            return {}
        if self._committed is not None:
            self.policy.settle(self._committed)
            self._committed = None
        link, delta = self.policy.plan(strategy.model, lambda: self._structure(strategy, checkpoint))
        return {"link": link, "delta": delta}

    @staticmethod
    def _structure(strategy: Any, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The sharded part of a save of ``checkpoint``, as :func:`job.prepare` builds it (a collective)."""
        return {"model": checkpoint["state_dict"],
                "fused_optimizer": job.fused_optimizer_state(strategy.fused_optimizer)}

    def _after_commit(self, pending: job.PendingSave, is_global_zero: bool) -> None:
        """After a committed full link, deletes the links of older chains that nothing needs (rank 0)."""
        if pending.rows is None and is_global_zero and pending.link is not None:
            self._live_chain = pending.link["chain"]
            self._collect(pending.path.parent)

    def _report_saved(self, pending: job.PendingSave, mode: str, start: float) -> None:
        """The event ``checkpoint_saved`` of a committed save, the same fields whichever the mode."""
        pre = self.precopy if pending.later and isinstance(self.precopy, PreCopy) else None
        blocked = self.last_blocked_s + (pre.hook_s if pre is not None else 0.0)
        emit("checkpoint_saved", step=pending.step, path=str(pending.path), mode="precopy" if pre else mode,
             blocked_s=round(blocked, 4), write_s=round(time.perf_counter() - start, 4), bytes=pending.staged_bytes,
             link=pending.link["link"] if pending.link is not None else None,
             rows=pending.rows.count if pending.rows is not None else None,
             precopy_rows=pre.hook_rows if pre is not None else None,
             precopy_hook_s=round(pre.hook_s, 4) if pre is not None else None)

    def _collect(self, checkpoint_dir: Path) -> None:
        for path in incremental.collect(checkpoint_dir, self._live_chain or ""):
            log.info(f"lightning_dlrover: removed {path.name}, a link of an older checkpoint chain nothing needs")

    def _remove(self, path: Path) -> None:
        """Removes a checkpoint directory (rank 0); a link of an incremental chain goes aside while a delta may need
        it (see :func:`~lightning_dlrover.checkpoint.incremental.retire`)."""
        incremental.retire(path)
        if self._live_chain is not None:
            self._collect(path.parent)

    def load(self, strategy: Any, path: Path, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        """Loads the checkpoint at ``path`` (a delta: its chain, see the module docs) after the save in flight; the
        next incremental save is full."""
        self.wait()
        chain = incremental.resolve(path)
        if not chain.complete and strategy.is_global_zero:
            used = chain.links[-1]
            step = directory.read_info(used)["global_step"]
            emit("checkpoint_chain_broken", step=step, path=str(path), missing_link=chain.missing, used=str(used))
            log.warning(f"lightning_dlrover: link {chain.missing} of the incremental checkpoint chain of {path} is "
                        f"missing (removed, or its write never committed); restoring the newest complete prefix of "
                        f"the chain instead: {used} (step {step}).")
        meta = job.load(path, strategy.lightning_module, strategy.fused_optimizer, world_size=strategy.world_size,
                        strict=strict, weights_only=weights_only, chain=chain)
        if self.policy is not None:
            self.policy.reset()
            self._committed = None
        return meta

    def unstaged_bytes(self, strategy: Any) -> int:
        """The staging memory this rank will allocate at its next save and does not hold yet: with asynchronous saves,
        before the first full save's copy exists, the bytes of its model, fused and dense optimizer state (local
        shards); else 0. No collective."""
        if not self.asynchronous or self._reuse.get(False) is not None or \
                (self._in_flight is not None and self._in_flight.rows is None) or strategy._dmp is None:
            return 0
        state = [strategy.lightning_module.state_dict(), strategy.fused_optimizer.state_dict()["state"],
                 [optimizer.state_dict()["state"] for optimizer in strategy.optimizers]]
        return sum(t.numel() * t.element_size() for t in _local_tensors(state))

    def _write(self, pending: job.PendingSave, is_global_zero: bool, start: float) -> None:
        error: BaseException | None = None
        try:
            if pending.later:
                self._copy(pending)
            pending.write(self._group, after_shards=lambda: _write_hook(pending.step))
        except BaseException as err:  # reported below, after the ranks agree; DCP's CheckpointException is a
            error = _cause(err)  # BaseException holding every failed rank's error
        committed = False
        try:
            if self._agree(error is None):  # every rank's part is written
                try:
                    pending.commit()
                except Exception as err:  # the rename failed (rank 0): nobody counts it
                    error = err
                committed = self._agree(error is None)
        except Exception as err:  # a peer died or timed out: the checkpoint never counts
            error, self._broken = error or err, True
        with self._lock:
            removals, self._removals = self._removals, []
            self._in_flight, self._committed = None, committed
            self._reuse[pending.rows is not None] = pending  # its copy is the next such save's staging memory
        if committed:
            if is_global_zero:
                for path in removals:
                    self._remove(path)
            if self.policy is not None:
                self._after_commit(pending, is_global_zero)
            self._report_saved(pending, "async", start)
            return
        pending.discard()
        kept = directory.latest_checkpoint(pending.path.parent) if is_global_zero else None
        why = f"{type(error).__name__}: {error}" if error is not None else "another rank's write failed"
        emit("checkpoint_failed", step=pending.step, path=str(pending.path),
             error_type=type(error).__name__ if error is not None else None, error=str(error or why)[:500],
             kept=str(kept) if kept is not None else None)
        log.warning(f"lightning_dlrover: the asynchronous checkpoint {pending.path} was not saved ({why}); training "
                    f"goes on, the newest complete checkpoint is {kept if is_global_zero else 'unchanged'}. Free disk "
                    "space or fix the directory's permissions.")

    def _copy(self, pending: job.PendingSave) -> None:
        """The pre-copy of ``pending``'s fused tables (the writer thread; see :mod:`.precopy`)."""
        fields = _hook_fields(pending.step)
        pause = (lambda: time.sleep(float(fields["copy_sleep"]))) if "copy_sleep" in fields else None
        self.precopy.copy(int(fields.get("chunk_bytes", precopy.CHUNK_BYTES)), pause)

    def _agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank's writer (a collective over the writers' group)."""
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _writer_timeout(self) -> timedelta:
        """How long a rank's writer waits for the others': a slow disk is no failure, so at least an hour (the
        writers of a job that failed are not waited for: :meth:`abandon`)."""
        return max(self.timeout or WRITER_TIMEOUT, WRITER_TIMEOUT)

    def abandon(self) -> None:
        """The process is failing: its save in flight is not waited for (it never counts, see the module docs)."""
        self._abandoned = True

    def wait(self, next_path: Path | None = None) -> float:
        """Waits for the save in flight (if any) to be committed or abandoned; returns the seconds waited."""
        thread = self._thread
        if thread is None or not thread.is_alive() or self._abandoned or process_exit.failing():
            return 0.0
        start = time.perf_counter()
        previous = self._in_flight
        thread.join()
        waited = time.perf_counter() - start
        if next_path is not None and previous is not None:
            emit("checkpoint_waited", step=previous.step, path=str(next_path), previous=str(previous.path),
                 waited_s=round(waited, 4))
        return waited

    def remove(self, path: Path, is_global_zero: bool) -> None:
        """Removes the checkpoint directory ``path`` (rank 0), after the commit of the save in flight if there is
        one (a failed save keeps it)."""
        if not is_global_zero:
            return
        with self._lock:
            if self._in_flight is not None:
                self._removals.append(path)
                return
        self._remove(path)


def _cause(error: BaseException) -> BaseException:
    """The first rank's error inside DCP's ``CheckpointException`` (which holds every failed rank's), else ``error``."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return error


def _local_tensors(state: Any) -> list[torch.Tensor]:
    """The tensors of nested state (a ``ShardedTensor``: its local shards)."""
    out = []
    for _, value in flatten(state):
        if hasattr(value, "local_shards"):
            out += [shard.tensor for shard in value.local_shards()]
        elif isinstance(value, torch.Tensor):
            out.append(value)
    return out


