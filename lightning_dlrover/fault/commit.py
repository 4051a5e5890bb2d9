"""The per-step commit protocol: what every rank holds at a committed step, and how a step gets committed.

A step ``s`` is committed when every rank has folded its parity deltas of ``s`` into the parity it holds and
every rank's ballot (its random generators and buffers) reached every other rank (the vote, an all-gather).
Until then each rank keeps what it needs to roll back to ``s - 1``: the embedding rows' undo log
(:class:`~lightning_dlrover.fault.coding.CodedEmbeddings`), the dense state's snapshot
(:class:`~lightning_dlrover.fault.replicated_state.ReplicatedSnapshot`) and the trainer state of ``s - 1``.
With ``ParityConfig(overlap=True)`` the exchange of deltas runs while the next step's data loads, and
the vote is decided just before the next forward (:meth:`CommitProtocol.settle`). With
``commit_every_n_steps = N`` only every ``N``-th step is committed.

What is committed at step ``s`` is everything a checkpoint at ``s`` holds, plus the random generators:
resuming from it is exact for any model (Dropout, BatchNorm, any dense optimizer, manual optimisation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dlrover.fault import rank_state
from lightning_dlrover.fault.coding.coded_embeddings import CodedEmbeddings
from lightning_dlrover.fault.coding.placement import ParityConfig
from lightning_dlrover.fault.host import Host
from lightning_dlrover.fault.replicated_state import ReplicatedSnapshot
from lightning_dlrover.fault.report import ResizeRequested, ReshardRequested
from lightning_dlrover.fault.restart.spill import ProgressRecord
from lightning_dlrover.monitor import StepTimer, emit


@dataclass
class PendingCommit:
    """A commit posted at the end of a step and not decided yet (see :meth:`FaultManager.settle`)."""

    index: int  # the step's index (the ``global_step`` it started at)
    step: int  # the ``global_step`` after it: the step being committed
    meta: dict[str, Any]  # the trainer state at ``step``
    ballot: Tensor  # this rank's generators and buffers at ``step``, padded to the longest rank's


class CommitProtocol:
    """The per-step commit of one training job (see the module docs); :class:`~lightning_dlrover.fault.FaultManager`
    adds the start, spills, restores and recoveries around it.

    Args:
        parity: erasure code of the embedding state, ``None`` for none (a failure then falls back to a checkpoint).
        timer: where the commit's time is accounted (section ``parity``).
    """

    def __init__(self, parity: ParityConfig | None, timer: StepTimer | None = None) -> None:
        self.parity = parity
        self.timer = timer or StepTimer()
        self.coded: CodedEmbeddings | None = None
        #: The last step whose state every rank holds (``trainer.global_step``); -1 before the start.
        self.committed_step = -1
        #: Called as ``point(phase, step)`` at ``before_forward``, ``after_optimizer``, ``during_parity_commit`` and
        #: ``during_vote`` of the step in flight (``step``: its index, the ``global_step`` it started at), and at
        #: ``after_commit`` with ``step`` the committed step.
        self.fault_points: list[Callable[[str, int], None]] = []
        self._host: Host | None = None
        self._dense: ReplicatedSnapshot | None = None
        self._meta: dict[str, Any] | None = None  # trainer state at the committed step (no tables)
        self._rank_states: Tensor | None = None  # every rank's generators and buffers at the committed step, [world, n]
        self._rank_state_len = 0
        self._buffers: list[Tensor] = []  # this rank's dense module buffers
        self._pending_rank_state: Tensor | None = None  # restored rank state, generators applied before the first resumed step
        self._in_flight: int | None = None  # index of the step in flight
        self._deciding: PendingCommit | None = None
        self._voted = -1  # the step whose vote this rank entered and did not see complete (-1: none)
        self._announce_resume = False
        self._progress: ProgressRecord | None = None
        #: Whether the launcher asks this job to grow (set under ``lightning-dlrover launch``; asked at each commit, and
        #: answers ``True`` on one rank at most): the answer travels in the vote, so every rank learns it at the same step.
        self.resize_poll: Callable[[], bool] | None = None
        self._resize_voted = False
        self._reshard_after: int | None = None  # a re-shard was asked for when this step was the committed one

    def set_restored_rank_states(self, states: Tensor | None) -> None:
        """Every old rank's generators and buffers (``[old world, n]``): this rank takes its row (buffers now,
        generators before the first resumed step). Ranks beyond the old world keep their own."""
        rank = self._host.global_rank if self._host is not None else dist.get_rank()
        self._pending_rank_state = states[rank].clone() if states is not None and rank < len(states) else None
        if self._pending_rank_state is not None:
            rank_state.restore_rank(self._pending_rank_state, self._buffers, generators=False)
        self._rank_states = states

    # ------------------------------------------------------------------------------------ each step
    def reach(self, phase: str, step: int) -> None:
        for point in self.fault_points:
            point(phase, step)

    def begin_step(self, step: int) -> None:
        """Before the forward of the step that starts at ``global_step == step``: decides a commit still in flight,
        applies restored generators."""
        self.settle()
        self._resize_if_due()
        if self._pending_rank_state is not None:
            rank_state.restore_rank(self._pending_rank_state, [])
            self._pending_rank_state = None
        if self._in_flight is None:
            self._in_flight = step
        self.reach("before_forward", step)

    def end_step(self, step: int, trainer_state: Callable[[], dict[str, Any]]) -> None:
        """Commits the step that just ended (``step``: ``global_step`` after it) once nothing of it is left to run.
        With ``parity.overlap`` the commit is decided by :meth:`settle` (the next :meth:`begin_step`)."""
        if self._in_flight is None:  # no training step ran since the last commit (e.g. Lightning skipping a batch)
            return
        index, self._in_flight = self._in_flight, None
        self.reach("after_optimizer", index)
        if self.coded is None:
            self._committed(step)
            return
        if step - self.committed_step < self.parity.commit_every_n_steps:
            return  # the commit window goes on: touched rows keep their first undo-log entry
        self.settle()
        with self.timer.section("parity"):
            assert self._dense is not None
            self._dense.stage()  # everything of step ``step`` is taken now; only the exchange and the vote wait
            # one byte past the longest rank state: whether this rank saw a grow request
            ballot = rank_state.pad(rank_state.capture_rank(self._buffers), self._rank_state_len + 1)
            ballot[-1] = int(self.resize_poll is not None and self.resize_poll())
            self._deciding = PendingCommit(index, step, trainer_state(), ballot)
            # After the step's backward and fused optimizer: on a GPU the deltas are captured on the current
            # stream, ordered after that update (see lightning_dlrover.fault.coding.staging).
            self.coded.post_deltas()
        if not self.parity.overlap:
            self.settle()
            self._resize_if_due()

    def request_reshard(self) -> None:
        """Asks for the tables to be planned and sharded anew in process at the next commit boundary (every rank, at the
        same step; an in-process recovery before then drops the request)."""
        self._reshard_after = self.committed_step

    def _resize_if_due(self) -> None:
        """At a step boundary right after a commit: raises :class:`ResizeRequested` when that commit's vote carried a
        grow request, :class:`ReshardRequested` when a re-shard was asked for before it."""
        if self._resize_voted:
            self._resize_voted = False
            raise ResizeRequested(self.committed_step)
        if self._reshard_after is not None and self.committed_step > self._reshard_after:
            self._reshard_after = None
            raise ReshardRequested(self.committed_step)

    def settle(self) -> None:
        """Decides the commit in flight, if any (collective): waits for its deltas, folds them into parity, votes."""
        if self._deciding is None:
            return
        assert self.coded is not None and self._dense is not None
        pending = self._deciding
        with self.timer.section("parity"):
            self.coded.finish_deltas()
            self.reach("during_parity_commit", pending.index)
            self._voted = pending.step  # a failure from here on may leave other ranks committed (see :meth:`rejoin`)
            ballots = self.coded.vote(pending.ballot)
            self.reach("during_vote", pending.index)
            self.coded.decide(pending.step)
            self._voted = -1
            self._dense.promote()
            self._meta, self._rank_states = pending.meta, torch.stack(ballots)
            self._resize_voted = any(int(ballot[-1]) for ballot in ballots)
        self._deciding = None
        self._committed(pending.step)

    def _committed(self, step: int) -> None:
        self.committed_step = step
        if self._progress is not None:
            self._progress.write(step)
        if self._announce_resume:
            self._announce_resume = False
            if self._host is not None and self._host.is_global_zero:
                emit("resumed", step=step, message=f"training resumed: step {step} committed")
        self.reach("after_commit", step)

    @property
    def has_committed_state(self) -> bool:
        """Whether there is a trainer state to roll back to (a commit, a restored spill or a loaded checkpoint)."""
        return self._meta is not None

    @property
    def buffers(self) -> list[Tensor]:
        """This rank's dense module buffers (part of its rank state)."""
        return self._buffers

    def after_checkpoint_load(self, meta: dict[str, Any]) -> None:
        """A checkpoint was loaded into the model: re-encode parity, restore every rank's generators and buffers;
        its step is the committed one until the next commit."""
        self._deciding, self._voted = None, -1
        if self.coded is not None:
            self.coded.encode()
        self.committed_step, self._meta = meta["global_step"], dict(meta)
        states = meta.get("dlrover_rank_states")
        if states is not None:
            self.set_restored_rank_states(states)

    def after_optimizer_state_load(self) -> None:
        """The dense optimizers' state was restored: it is the committed replicated state."""
        if self._dense is not None:
            self._dense.take()
