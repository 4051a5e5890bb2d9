"""``DLRoverStrategy(parity="auto")`` (YAML ``parity: auto``): the fault-tolerance planner picks the parity at start.

Before any rank starts, :func:`check` refuses what the planner cannot plan (fewer than 2 ranks, a model with no
embedding tables). At set-up, before the model is sharded, :func:`resolve` plans on rank 0
(:meth:`~lightning_dlrover.fault.ParityConfig.auto`: the job's embedding state from its tables, a step time from the
measured default per sample, or the costs an earlier run of the same job recorded in the job history named by
``$LIGHTNING_DLROVER_HISTORY`` (:mod:`lightning_dlrover.planner.records`), failures from ``$LIGHTNING_DLROVER_MTBF_HOURS`` (the job's MTBF in hours) or the
published rates), hands the pick to every rank over the control plane and records it (event ``parity_planned``).
The pick may be ``None``: checkpoints alone do better at this failure rate.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from torch import nn

from lightning_dlrover import control_plane, torchrec_glue
from lightning_dlrover.fault import ParityConfig
from lightning_dlrover.monitor import emit
from lightning_dlrover.monitor import events as job_events
from lightning_dlrover.planner.job import OPTIMIZER_BYTES_PER_ROW, STEP_S_PER_RANK_SAMPLE, PlannedJob

HISTORY_ENV = "LIGHTNING_DLROVER_HISTORY"  # the advisor's (lightning_dlrover.advisor.history.HISTORY_ENV)
#: Environment variable: the job's mean time between failures in hours, for ``parity: auto`` (``--mtbf-hours``).
MTBF_ENV = "LIGHTNING_DLROVER_MTBF_HOURS"


def _mtbf_hours() -> float | None:
    text = os.environ.get(MTBF_ENV)
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"${MTBF_ENV}={text!r} is not a number of hours (the job's mean time between failures).")


def _recorded_costs(module: nn.Module, global_batch: int, per_machine: int, machines: int) -> dict[str, float]:
    """The costs the job history (``$LIGHTNING_DLROVER_HISTORY``) holds for this job's tables and batch."""
    history = os.environ.get(HISTORY_ENV)
    if not history:
        return {}
    from lightning_dlrover.planner.records import read_costs

    tables = tuple((t.rows, t.dim) for t in torchrec_glue.embedding_tables(module))
    return read_costs(history, PlannedJob(tables, per_machine, machines, global_batch).key())


def state_bytes(module: nn.Module) -> int:
    """The embedding state of ``module``'s tables: float32 weights and a row-wise optimizer state."""
    return sum(t.rows * (t.dim * 4 + OPTIMIZER_BYTES_PER_ROW) for t in torchrec_glue.embedding_tables(module))


def check(parity: Any, world_size: int, module: nn.Module | None = None) -> None:
    """Refuses ``parity="auto"`` where no plan can be made: a world size parity cannot cover, no embedding tables,
    a bad ``$LIGHTNING_DLROVER_MTBF_HOURS``."""
    if parity != "auto":
        return
    if world_size < 2:
        raise ValueError(f"strategy.parity: auto at world size {world_size}: parity needs at least 2 ranks (k + r <= "
                         "the world size). Run 2 or more ranks, or set parity: null.")
    if module is not None and not torchrec_glue.embedding_tables(module):
        raise ValueError("strategy.parity: auto, but the model has no TorchRec embedding tables: parity codes "
                         "embedding tables. Set parity: null.")
    mtbf = _mtbf_hours()
    if mtbf is not None and not mtbf > 0:
        raise ValueError(f"${MTBF_ENV}={mtbf}: the job's mean time between failures must be > 0 hours.")


def resolve(strategy: Any, trainer: pl.Trainer) -> ParityConfig | None:
    """``strategy.parity``, with ``"auto"`` replaced by the planner's pick, the same on every rank (collective)."""
    if strategy.parity != "auto":
        return strategy.parity
    module = strategy.lightning_module
    check("auto", strategy.world_size, module)
    datamodule = getattr(trainer, "datamodule", None)
    global_batch = getattr(getattr(datamodule, "hparams", {}), "get", lambda *_: None)("global_batch_size") or 4096
    step_s = STEP_S_PER_RANK_SAMPLE * global_batch / strategy.world_size
    picked: list[Any] = [None]
    if strategy.global_rank == 0:
        measured = _recorded_costs(module, global_batch, strategy.num_processes, strategy.num_nodes)
        step_s = measured.pop("step_s", step_s)
        pick = ParityConfig.auto(strategy.world_size, state_bytes(module), step_s,
                                 ranks_per_machine=strategy.num_processes, mtbf_hours=_mtbf_hours(), measured=measured)
        picked = [pick]
    dist.broadcast_object_list(picked, src=0, group=control_plane.group())
    pick = picked[0]
    if strategy.global_rank == 0:
        job_events.configure(Path(trainer.default_root_dir) / "dlrover_events.jsonl")
        fields = {"k": pick.k, "r": pick.r, "commit_every_n_steps": pick.commit_every_n_steps} if pick else {}
        emit("parity_planned", world_size=strategy.world_size, parity=fields or None, mtbf_hours=_mtbf_hours(),
             message=f"parity: auto picked {fields or 'no parity (checkpoints only)'} at {strategy.world_size} ranks")
    return pick
