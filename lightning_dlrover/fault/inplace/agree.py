"""The step an in-process recovery resumes at, agreed by the survivors (a vote may have broken part-way)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_dlrover import control_plane
from lightning_dlrover.fault.report import Unrecoverable


def agree_on_step(committed: int, voted: int, survivors: list[int]) -> tuple[int, int, bool]:
    """The step an in-process recovery resumes at (collective over the new world group; a replacement passes -1s).

    A survivor passes its committed step and ``voted``, the step whose vote it entered without seeing it complete
    (else -1). A vote is an all-gather, and a rank lost in the middle of one can leave some survivors with every
    ballot and others without: the step is committed wherever the vote completed, and, since completing it
    proves every rank had folded in its deltas, the survivors whose vote broke may commit it too. Returns
    ``(step, source, decide_here)``: the newest step a survivor committed, the lowest survivor that committed it
    (it holds the step's trainer state and every rank's ballot), and whether this rank must still commit it.
    Raises :class:`Unrecoverable` on every rank alike when a survivor neither committed nor voted on that step.
    """
    world = dist.get_world_size()
    mine = torch.tensor([committed, voted], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=control_plane.group())
    steps = {rank: (int(gathered[rank][0]), int(gathered[rank][1])) for rank in survivors}
    step = max(done for done, _ in steps.values())
    behind = [rank for rank, (done, vote) in steps.items() if done != step and vote != step]
    if behind:
        raise Unrecoverable(
            f"survivors disagree on the committed step: {steps} (rank: (committed, voted)); ranks {behind} are "
            f"behind step {step} without having voted on it, which the commit protocol rules out.", step)
    source = min(rank for rank, (done, _) in steps.items() if done == step)
    return step, source, committed != step and voted == step
