"""``FaultManager``: the fault tolerance of a training job in one object, the only one a strategy talks to.

It runs the per-step commit (:mod:`.commit`: parity deltas, the vote, snapshots of the dense state, the trainer
state and every rank's random generators), the spill when a rank fails, the restore after ``torchrun`` restarts the
workers, the fallback to a checkpoint when parity cannot cover a loss (or nothing was spilled), in-process
recovery, and the recovery events. A training strategy drives it through a handful of calls::

    manager.before_process_group()         # a hot spare waits to be handed a lost rank
    manager.after_process_group(...)       # under torchrun: a restarted node takes back its spills' node rank
    manager.start(host)                    # set-up: restore a failed job, encode parity -> state to resume from
    manager.begin_step(step)               # before the forward of a training step
    manager.end_step(step, trainer_state)  # once the whole step is over (callbacks, schedulers, validation)
    manager.settle()                       # decides a commit still in flight (begin_step and finish call it)
    manager.on_exception(error)            # spill
    manager.finish()                       # fit ended normally: nothing left behind

Below it: :mod:`.coding` (coded embeddings), :mod:`.restart` (spills, restore across a worker restart),
:mod:`.inplace` (in-process recovery under ``lightning-dlrover launch``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._shard.sharded_tensor import ShardedTensor

from lightning_dlrover import control_plane
from lightning_dlrover.fault import rank_state
from lightning_dlrover.fault.coding import reserve
from lightning_dlrover.fault.coding.coded_embeddings import CodedEmbeddings
from lightning_dlrover.fault.coding.coded_state import CodedState
from lightning_dlrover.fault.coding.placement import ParityConfig, ParityPlacement
from lightning_dlrover.fault.commit import CommitProtocol
from lightning_dlrover.fault.host import Host
from lightning_dlrover.fault.inplace import membership
from lightning_dlrover.fault.inplace import protocol as inplace
from lightning_dlrover.fault.inplace.agree import agree_on_step
from lightning_dlrover.fault.launcher_facts import LauncherFacts
from lightning_dlrover.fault.points import VERIFY_PARITY_ENV
from lightning_dlrover.fault.replicated_state import ReplicatedSnapshot, dense_buffers, replicated_tensors
from lightning_dlrover.fault.report import RecoveryReport, Unrecoverable
from lightning_dlrover.fault.restart.renumber import renumber_nodes
from lightning_dlrover.fault.restart.reshard import restore as restore_spills
from lightning_dlrover.fault.restart.resume import fall_back, restore_failed_job
from lightning_dlrover.fault.restart.spill import (
    ProgressRecord,
    Spill,
    UnsafeSpillDir,
    spill_dir,
    write_spill,
)
from lightning_dlrover.log import get_logger, rank_zero_report
from lightning_dlrover.monitor import StepTimer, emit
from lightning_dlrover.worker_env import restart_count, under_torchrun

log = get_logger(__name__)


@contextlib.contextmanager
def sigterm_ignored() -> Iterator[None]:
    """SIGTERM is ignored while a rank writes its spills. The launcher SIGTERMs every worker when it restarts the job,
    and Lightning's own SIGTERM handler broadcasts over the world group: with a peer gone, that broadcast raises inside
    the write, and the spill the restart needs would be lost. The launcher's SIGKILL after its grace still ends it."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class FaultManager(CommitProtocol, LauncherFacts):
    """The fault tolerance of one training job: the per-step commit (:class:`CommitProtocol`), the launchers'
    hooks, spill, restore, fallback, in-process recovery and their events (see the module docs).

    Args:
        parity: erasure code of the embedding state, ``None`` for none (a failure then falls back to a checkpoint).
        timer: where the commit's time is accounted (section ``parity``).
    """

    def __init__(self, parity: ParityConfig | None, timer: StepTimer | None = None) -> None:
        super().__init__(parity, timer)
        #: Whether the start restored a failed job (from survivors' spills or a fallback checkpoint).
        self.recovered = False
        self._spill_dir: Path | None = None
        self._assignment: membership.Assignment | None = None  # the lost rank this process took, as a hot spare
        self._recovery: inplace.InProcessRecovery | None = None
        self._left_behind = False

    # ------------------------------------------------------------------------------ launchers
    def before_process_group(self, device_type: str = "cpu") -> membership.Assignment | None:
        """On a hot spare: blocks until the launcher hands it a lost rank, becomes that rank's worker and returns the
        assignment (``None`` on a rank). Under ``lightning-dlrover launch`` a rank on a device other than the CPU tells
        the launcher (replacements then must not share a device: see
        :meth:`.inplace.supervisor.Supervisor.shared_devices`)."""
        inplace.announce_device(device_type)
        self._assignment = inplace.take_rank_if_spare()
        return self._assignment

    def after_process_group(self, node_rank: int, local_rank: int, local_world_size: int,
                            timeout: timedelta) -> int | None:
        """Under ``torchrun`` with parity (collective): a restarted node takes back the node rank its spills were
        written under. Returns the new node rank (the environment is updated), ``None`` when it is unchanged."""
        if self.parity is None or not under_torchrun() or membership.enabled():
            return None
        return renumber_nodes(spill_dir(), node_rank, local_rank, local_world_size, timeout)

    def in_process_recovery(self) -> inplace.InProcessRecovery | None:
        """The survivor and replacement sides of in-process recovery, ``None`` unless the world group is
        reconfigurable (``lightning-dlrover launch``)."""
        if inplace.world_group() is not None and self._recovery is None:
            self._recovery = inplace.InProcessRecovery(self, self._assignment)
        return self._recovery

    def _committed(self, step: int) -> None:
        super()._committed(step)
        if self._recovery is not None:  # the launcher starts its hot spares after a generation's first commit
            self._recovery.committed(step)

    def gather_rank_states(self) -> Tensor:
        """Every rank's generators and buffers, ``[world, n]`` (collective; for a checkpoint)."""
        return rank_state.gather_ranks(self._buffers)

    # ----------------------------------------------------------------------------------------- start
    def start(self, host: Host, joining: bool = False) -> dict[str, Any] | None:
        """Restores a failed job (survivors' spills, else its newest checkpoint) into the sharded model and encodes
        parity (collective). Returns the trainer state for Lightning to resume from, ``None`` for a fresh start.
        A process ``joining`` a running job in place of a lost rank only prepares: :meth:`rejoin` restores it."""
        self._host = host
        self._dense = ReplicatedSnapshot(replicated_tensors(host.lightning_module, lambda: host.optimizers))
        self._buffers = dense_buffers(host.lightning_module)
        self._rank_state_len = rank_state.capture_rank(self._buffers).numel()
        if joining:  # the survivors are not here yet: the collectives below run in rejoin
            self._spill_dir = spill_dir() if under_torchrun() else None
            self._record_progress(host)  # the lost rank's record goes on from here (and this rank can spill)
            return None
        state = CodedState(host.model, self.parity.k) if self.parity is not None else None
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(host.world_size)]
        dist.all_gather(lengths, torch.tensor([self._rank_state_len]), group=control_plane.group())
        self._rank_state_len = int(max(lengths))
        report, reason = None, None
        if under_torchrun():
            report, reason = self._restore(host, state)
        if state is not None:
            self.coded = self._encode(host, state, report)
            if membership.enabled():  # the memory a hot spare faults in for a replacement of this rank
                reserve.publish(membership.connect(), restart_count(), reserve.needed(host.model, self.coded.parity))
        resume = report.meta if report is not None else None
        if reason is not None:
            resume = fall_back(host, reason)
            self._announce_resume = True  # also a start-over from step 0: its first commit is a ``resumed`` event
        if resume is not None:
            self.recovered = self._announce_resume = True
            self.committed_step = resume["global_step"]
            self._meta = dict(resume)
        elif self.committed_step < 0:
            self.committed_step = 0
        self._dense.take()
        self._record_progress(host)
        return resume

    def _record_progress(self, host: Host) -> None:
        """Opens this rank's progress record in the spill directory (see :class:`ProgressRecord`)."""
        if self._spill_dir is None:
            return
        try:
            self._progress = ProgressRecord(self._spill_dir, host.global_rank)
        except (OSError, UnsafeSpillDir) as err:
            emit("stale_spills_refused", paths=[str(self._spill_dir)], why=str(err),
                 message=f"not recording progress: {err}")

    def _restore(self, host: Host, state: CodedState | None) -> tuple[RecoveryReport | None, Unrecoverable | None]:
        """Decodes the spills of a failed launch of this job; the reason to fall back when they cannot be used."""
        self._spill_dir = spill_dir()
        report, reason = restore_failed_job(host, state, self._spill_dir)
        if report is None:
            return None, reason
        self._load_dense_state(host, report)
        if host.is_global_zero:
            emit("restored", step=report.step, old_world_size=report.world_size, world_size=host.world_size,
                 lost_ranks=report.lost, decode_s=report.decode_s, reshard_s=report.reshard_s,
                 message=f"{report}; resuming")
        return report, None

    def _load_dense_state(self, host: Host, report: RecoveryReport) -> None:
        """Copies the spilled dense parameters and buffers into the model; keeps this rank's generators."""
        if report.meta is not None:
            live = host.lightning_module.state_dict()
            for key, value in report.meta.pop("state_dict").items():
                live[key].copy_(value)
            report.meta["state_dict"] = {}
        self.set_restored_rank_states(report.rank_states)

    def _encode(self, host: Host, state: CodedState, report: RecoveryReport | None) -> CodedEmbeddings:
        """Parity for the job's layout: the survivors' kept after a restore that kept the layout, else encoded."""
        assert self.parity is not None
        k, r = self.parity.k, self.parity.r
        placement = ParityPlacement(host.world_size, k, r, host.num_processes)
        started = time.perf_counter()
        coded = CodedEmbeddings(state, placement, encode=False)
        kept = report is not None and report.layout_kept and report.code == (k, r, host.num_processes)
        if kept:
            coded.adopt(report.parity, report.lost)
        else:
            coded.encode()
        if report is not None:
            report.parity, seconds = None, time.perf_counter() - started  # (the spill's mapping)
            verified = coded.verify() if os.environ.get(VERIFY_PARITY_ENV) == "1" else None
            if host.is_global_zero:
                encoded = report.lost if kept else list(range(host.world_size))
                emit("parity_encoded", step=report.step, encode_s=seconds, kept_parity=kept, encoded_ranks=encoded,
                     verified=verified, message=f"parity of ranks {encoded} encoded in {seconds:.3f} s"
                     + ("; the survivors' parity is kept" if kept else "")
                     + ("" if verified is None else f"; equals a fresh encode: {'yes' if verified else 'NO'}"))
        if host.is_global_zero:
            state_bytes, parity_bytes = state.num_bytes, coded.parity.numel()
            node = ""
            if placement.nodes > 1:
                node = (f", and so is any one of the {placement.nodes} nodes" if placement.tolerates_node_loss else
                        "; a lost node is NOT (it holds too many members of a parity group: raise r or add nodes)")
            n = self.parity.commit_every_n_steps
            point = "every step" if n == 1 else f"every {n} steps (a failure trains at most {n - 1} steps again)"
            rank_zero_report(log, f"DLRoverStrategy parity k={k} r={r}: rank 0 codes {state_bytes / 2**20:.2f} MiB of "
                             f"embedding state and holds {parity_bytes / 2**20:.2f} MiB of parity "
                             f"({parity_bytes / max(state_bytes, 1):.0%}); any {r} lost ranks are recoverable{node}; the "
                             f"recovery point is committed {point}.")
        return coded

    # ------------------------------------------------------------------------------------ failures
    def on_exception(self, error: BaseException) -> None:
        """Spills this rank's committed state to shared memory for the restarted job (under ``torchrun``; with parity).
        The step in flight is rolled back first; a spill needs no other rank."""
        if self._left_behind:  # a shrink in process failed half-way: its spills are written (write_left_behind)
            return
        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        if self._host is not None and self.coded is None and self.committed_step >= 0:
            emit("stopped", step=self.committed_step, reason=reason, spill="nothing (no parity)", spill_s=0.0,
                 tentative_step=None, message=f"rank {self._host.global_rank} stopped at {time.time():.3f} "
                 f"({reason}); no parity, so nothing is spilled: a restarted job resumes from its newest checkpoint")
            return
        if self._host is None or self._spill_dir is None or self.coded is None or self.committed_step < 0:
            return  # nothing committed yet (the failure came during set-up): a spill would only mislead a restart
        stopped, ahead = time.time(), None
        try:
            with sigterm_ignored():
                if (ahead := self._tentative_spill()) is not None:  # written before the rollback below
                    write_spill(self._spill_dir, ahead)
                path = write_spill(self._spill_dir, self._committed_spill())
        except (OSError, UnsafeSpillDir) as err:
            path = f"nothing ({err})"
        tentative = ahead.step if ahead is not None else None
        emit("stopped", step=self.committed_step, reason=reason, spill=str(path), spill_s=time.time() - stopped,
             tentative_step=tentative, message=f"rank {self._host.global_rank} stopped at {stopped:.3f} ({reason}); "
             f"spilled the state of step {self.committed_step} to {path}"
             f"{f' (and of step {tentative}, tentative)' if tentative is not None else ''} in {time.time() - stopped:.3f} s")

    def _tentative_spill(self) -> Spill | None:
        """This rank's embedding state and parity at the step whose vote broke on it (see ``Spill.tentative``)."""
        if self._voted < 0:
            return None
        assert self.coded is not None and self._host is not None
        return self.coded.spill(self._host.global_rank, self._voted, None, None, tentative=True)

    def _committed_spill(self) -> Spill:
        """This rank's coded state and the trainer's state at the last commit (the step in flight rolled back)."""
        assert self.coded is not None and self._host is not None and self._dense is not None
        self._deciding, self._voted = None, -1  # a commit still in flight is not decided: this rank rolls it back
        self.coded.rollback()
        self._dense.restore()
        meta = self._committed_meta(self._host) if self._meta is not None else None
        return self.coded.spill(self._host.global_rank, self.committed_step, self._rank_states, meta)

    def _committed_meta(self, host: Host) -> dict[str, Any]:
        """The trainer state of the last commit with the dense parameters and buffers (the dense state must be
        restored to the commit first)."""
        dense = {k: v for k, v in host.lightning_module.state_dict().items() if not isinstance(v, ShardedTensor)}
        return {**(self._meta or {}), "state_dict": dense}

    def recover(self, lost_ranks: list[int]) -> None:
        """Rebuilds the embedding shards, optimizer state and parity of ``lost_ranks`` in place, at the last
        committed step, from the survivors' shards and parity; dense state back to the commit (collective)."""
        if self.coded is None:
            raise RuntimeError("recover needs parity: pass DLRoverStrategy(parity=ParityConfig(...)).")
        self._deciding, self._voted, self._reshard_after = None, -1, None
        self.coded.recover(sorted(set(lost_ranks)))
        assert self._dense is not None
        self._dense.restore()
        self._in_flight = None

    def rejoin(self, host: Host, survivor: bool, lost: list[int]) -> RecoveryReport:
        """Brings every rank back to the last committed step after the ``lost`` ranks were replaced in place
        (collective over the new communicator): every rank rolls back in memory, the replacements' embedding shards
        and parity share are decoded in place from the survivors', and the trainer, dense and rank states come from
        the lowest surviving rank that committed that step. A survivor whose vote broke while another's completed
        commits that step too (:func:`~lightning_dlrover.fault.inplace.agree.agree_on_step`). Returns the report,
        whose ``meta`` is the trainer state to resume from."""
        if self.parity is None:
            raise Unrecoverable("in-process recovery needs parity (DLRoverStrategy(parity=ParityConfig(...))).",
                                self.committed_step)
        survivors = sorted(set(range(host.world_size)) - set(lost))
        step, source, decide_here = agree_on_step(self.committed_step, self._voted, survivors)
        self._deciding = None  # (``_voted`` stays until the step is decided below: a spill meanwhile is tentative)
        self._reshard_after = None  # a replacement did not ask for it
        if survivor:  # mirrors the replacement's state construction (layouts, chunk length)
            assert self.coded is not None and self._dense is not None
            self.coded.state.share_layout()
            self._dense.restore()
        else:
            placement = ParityPlacement(host.world_size, self.parity.k, self.parity.r, host.num_processes)
            self.coded = CodedEmbeddings(CodedState(host.model, self.parity.k), placement, encode=False)
        self._agree_rank_state_len()
        committed: list[Any] = [None, None, None]
        if host.global_rank == source:
            committed = [self.committed_step, self._committed_meta(host), self._rank_states]
        dist.broadcast_object_list(committed, src=source, group=control_plane.group())
        step, meta, rank_states = committed
        if decide_here:  # with the step's trainer and rank states in hand, so a spill from here on is whole
            assert self._dense is not None
            self.coded.decide(step)
            self._dense.promote()
            self._dense.restore()
            self.committed_step, self._meta, self._rank_states = step, dict(meta), rank_states
            emit("vote_completed_elsewhere", step=step,
                 message=f"rank {host.global_rank}: its vote broke, another survivor's completed: step {step} committed")
        self._voted = -1
        started = time.perf_counter()
        self.coded.recover(sorted(lost))  # rolls back, decodes the lost ranks in place, re-encodes their parity
        reserve.release()
        self.coded.committed_step = step
        report = RecoveryReport(step, host.world_size, sorted(lost), time.perf_counter() - started, 0.0, meta,
                                rank_states)
        self._load_dense_state(host, report)
        self.committed_step, self._meta, self._in_flight = step, dict(report.meta), None
        assert self._dense is not None
        self._dense.take()
        self.recovered = self._announce_resume = True
        return report

    def _agree_rank_state_len(self) -> None:
        """Every rank takes the longest rank state's length (the vote gathers equal sizes; collective)."""
        longest = torch.tensor([self._rank_state_len], dtype=torch.int64)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=control_plane.group())
        self._rank_state_len = int(longest)

    def leave_behind(self) -> list[Spill]:
        """This rank's committed state as spills in memory (the step in flight rolled back; first its tentative state
        when its vote broke), for :meth:`restore_in_place`: the restart path's spills, never written."""
        ahead = self._tentative_spill()
        return ([ahead] if ahead is not None else []) + [self._committed_spill()]

    def write_left_behind(self, spills: list[Spill]) -> None:
        """A shrink in process failed half-way: writes the spills :meth:`leave_behind` kept (the committed state from
        before it) for the restart path; this rank spills nothing more when it stops."""
        self._left_behind = True
        with sigterm_ignored():
            for spill in spills if self._spill_dir is not None else []:
                write_spill(self._spill_dir, spill)

    def restore_in_place(self, host: Host, spills: list[Spill]) -> RecoveryReport:
        """After a shrink or grow in process sharded ``host.model`` anew for the new world: decodes the lost ranks and
        re-shards every rank's committed state from the ``spills`` the running ranks kept (a joining rank has none:
        the restart path's restore), encodes parity for the new world and takes the dense snapshot of the new
        optimizers (collective). Raises :class:`Unrecoverable` as the restart path's restore does."""
        assert self.parity is not None
        self._reshard_after = None  # (a joining rank did not ask for it)
        if self.coded is not None:
            self.coded.state.close()
        self._agree_rank_state_len()  # a joining rank's own may be shorter
        state = CodedState(host.model, self.parity.k)
        report = restore_spills(state, spills)
        if report is None or report.meta is None:
            raise Unrecoverable("no survivor kept the committed trainer state", self.committed_step)
        self._load_dense_state(host, report)
        self.coded = self._encode(host, state, report)
        self._dense = ReplicatedSnapshot(replicated_tensors(host.lightning_module, lambda: host.optimizers))
        self.committed_step, self._meta, self._in_flight, self._voted = report.step, dict(report.meta), None, -1
        self._dense.take()
        self.recovered = self._announce_resume = True
        return report

    def finish(self) -> None:
        """Training ended normally: decides the last commit, removes this rank's progress record (nothing to resume)."""
        self.settle()
        if self._progress is not None:
            self._progress.close(remove=True)
            self._progress = None

    def close(self) -> None:
        """Releases the forward hooks on the embedding kernels."""
        if self.coded is not None:
            self.coded.state.close()
