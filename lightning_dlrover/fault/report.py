"""What a recovery reports, and the error that ends one: shared by restarts (:mod:`.restart`) and in-process
recovery (:mod:`.inplace`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor


class Unrecoverable(RuntimeError):
    """The spills cannot rebuild the state: too many ranks lost, or the state's layout changed."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class ResizeRequested(RuntimeError):
    """Raised on every rank at the same step boundary, right after ``step`` committed, when the launcher published a
    plan that resizes the job (a grow, or a shrink the job asked for; rank 0 saw it and said so in the commit's vote):
    in-process recovery then runs that plan and resumes at ``step``."""

    def __init__(self, step: int) -> None:
        super().__init__(f"the launcher asked the job to change its world size after step {step}")
        self.step = step


class ReshardRequested(RuntimeError):
    """Raised on every rank at the first commit boundary after every rank asked for it at the same step
    (:meth:`~lightning_dlrover.fault.FaultManager.request_reshard`): in-process recovery then plans and shards the
    tables anew at the same world size and resumes at the committed ``step``."""

    def __init__(self, step: int) -> None:
        super().__init__(f"a re-shard was asked for; step {step} is committed")
        self.step = step


@dataclass
class RecoveryReport:
    """What a recovery did (:func:`~lightning_dlrover.fault.restart.reshard.restore` or an in-process rejoin): the recovered ``step``, the failed job's ``world_size``, the ``lost`` ranks
    (decoded), seconds spent decoding and re-sharding, and the trainer state (``meta``) and every old rank's
    generators and buffers (``rank_states``, uint8 ``[old world, n]``) of the recovered step.

    ``layout_kept`` (the same on every rank): the new job has the old one's world, chunk layouts and code, and
    every surviving old rank's spill is on the worker of the same rank, so the survivors' parity is still valid;
    ``parity`` is then this worker's share as spilled (``None`` on a lost rank) and only the lost ranks' shares
    need encoding (:meth:`~lightning_dlrover.fault.CodedEmbeddings.adopt`)."""

    step: int
    world_size: int
    lost: list[int]
    decode_s: float
    reshard_s: float
    meta: dict[str, Any] | None = None
    rank_states: Tensor | None = None
    layout_kept: bool = False
    code: tuple[int, int, int] = (0, 0, 0)  # the failed job's k, r and ranks per node
    parity: Tensor | None = None

    def __str__(self) -> str:
        lost = f"decoded lost ranks {self.lost}" if self.lost else "no rank lost"
        return (
            f"recovered step {self.step} of a {self.world_size}-rank job onto {dist.get_world_size()} ranks: {lost} "
            f"(decode {self.decode_s:.3f} s, re-shard {self.reshard_s:.3f} s)"
        )
