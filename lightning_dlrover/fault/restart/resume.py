"""Where a restarted job resumes: the spills its survivors left (decoded and re-sharded), else its newest
checkpoint not past the failure, else (loudly) step 0."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_dlrover import control_plane
from lightning_dlrover.fault.coding.coded_state import CodedState
from lightning_dlrover.fault.host import Host
from lightning_dlrover.fault.report import RecoveryReport, Unrecoverable
from lightning_dlrover.fault.restart.reshard import restore
from lightning_dlrover.fault.restart.spill import last_committed_step, read_spills
from lightning_dlrover.monitor import emit
from lightning_dlrover.worker_env import restart_count


def restore_failed_job(host: Host, state: CodedState | None,
                       directory: Path) -> tuple[RecoveryReport | None, Unrecoverable | None]:
    """Decodes the spills in ``directory`` of a failed launch of this job into ``state`` (collective). Returns the
    report (``None``: nothing to restore) or the reason to fall back to a checkpoint. Used spills are removed."""
    spills, refused = read_spills(directory, host.local_rank, host.num_processes, host.global_rank)
    if refused:
        emit("stale_spills_refused", paths=[r.split(":")[0] for r in refused], why="; ".join(refused),
             message="refused spills: " + "; ".join(refused))
    reached = last_committed_step(directory) if host.local_rank == 0 else None
    facts = [None] * host.world_size
    dist.all_gather_object(facts, (reached, restart_count(), len(refused)), group=control_plane.group())
    progress = max((f[0] for f in facts if f[0] is not None), default=None)
    restarted = progress is not None or max(f[1] for f in facts) > 0
    refusals = sum(f[2] for f in facts)
    try:
        report = restore(state, spills)
    except Unrecoverable as err:  # the spills' step, or a later one a rank committed after another spilled
        return None, Unrecoverable(str(err), max(err.step, progress if progress is not None else -1))
    finally:
        for spill in spills:  # live again, or superseded by the checkpoint
            if spill.path is not None:
                spill.path.unlink(missing_ok=True)
    if report is None and restarted:  # every rank died at once, or was killed before it could spill
        step = progress if progress is not None else -1
        why = f" ({refusals} spills refused, see above)" if refusals else ""
        unknown = "" if progress is not None else (
            f" No node has a progress record of this launch in {directory}, so the step it failed at is unknown: no "
            "rank committed a step before it died, or the records were removed (or the spill directory differs "
            "between the launch that failed and this one).")
        return None, Unrecoverable(f"The job was restarted but no rank left a usable spill{why}.{unknown}", step)
    return report, None


def _why_none(host: Host) -> str:
    """Why a restarted job found no checkpoint: none configured, or none written yet."""
    trainer = getattr(host.lightning_module, "trainer", None)
    callback = getattr(trainer, "checkpoint_callback", None) if trainer is not None else None
    if callback is None:
        return "add a ModelCheckpoint(every_n_train_steps=N)"
    return "a ModelCheckpoint is configured, but it had not written a checkpoint yet when the job failed"


def fall_back(host: Host, reason: Unrecoverable) -> dict[str, Any] | None:
    """Loads the newest checkpoint not past the failure into ``host``; returns its trainer state, or ``None`` (with a
    loud warning) when there is none and training starts over."""
    at_most = reason.step if reason.step >= 0 else None
    path = host.latest_checkpoint(at_most)
    failed = reason.step if reason.step >= 0 else None
    if path is None:
        lost = f"{failed} committed steps lost" if failed is not None else "the steps it had trained are lost"
        if host.is_global_zero:
            emit("fallback", step=0, why=str(reason), checkpoint=None, failed_step=failed, steps_lost=failed,
                 load_s=0.0, message=f"WARNING: {reason} There is no checkpoint to fall back to ({_why_none(host)}): "
                 f"training STARTS OVER FROM STEP 0; {lost}.")
        return None
    started = time.perf_counter()
    meta = host.load_checkpoint(path)
    seconds, step = time.perf_counter() - started, meta["global_step"]
    lost = failed - step if failed is not None else None
    if host.is_global_zero:
        emit("fallback", step=step, why=str(reason), checkpoint=str(path), failed_step=failed, steps_lost=lost,
             load_s=seconds, message=f"{reason} Resuming from checkpoint {path} at step {step} (loaded in "
             f"{seconds:.3f} s): {lost if lost is not None else 'an unknown number of'} committed steps lost")
    return meta
