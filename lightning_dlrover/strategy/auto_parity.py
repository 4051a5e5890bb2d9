"""``DLRoverStrategy(parity="auto")`` (YAML ``parity: auto``): the fault-tolerance planner picks the parity at start.

Before any rank starts, :func:`check` refuses what the planner cannot plan (fewer than 2 ranks, a model with no
embedding tables). At set-up, before the model is sharded, :func:`resolve` plans on rank 0
(:meth:`~lightning_dlrover.fault.ParityConfig.auto`: the job's embedding state from its tables, a step time from the
measured default per sample, or the costs an earlier run of the same job recorded in the job history named by
``$LIGHTNING_DLROVER_HISTORY`` (:mod:`lightning_dlrover.planner.records`), failures from ``$LIGHTNING_DLROVER_MTBF_HOURS`` (the job's MTBF in hours) or the
published rates), hands the pick to every rank over the control plane and records it (event ``parity_planned``).
The pick may be ``None``: checkpoints alone do better at this failure rate. With a job history, rank 0 also times
a few of the run's first steps (:mod:`.cost_probe`) and records them for the next run's plan.

The pick is planned once per run: every rank writes it to ``parity_plan.json`` in its node's spill directory (the
run directory outside a launcher) with the launcher's run id, and a restarted incarnation (``torchrun`` or
``launch`` restarting every worker) or a replacement taking a lost rank in process reuses it (``source:
"recorded"``) instead of planning again: the spills and parity it decodes were written with that ``(k, r, N)``. A
recorded parity the world size can no longer hold (``k + r`` above it, a shrunk elastic job) is planned again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from torch import nn

from lightning_dlrover import control_plane, torchrec_glue, worker_env
from lightning_dlrover.fault import FaultManager, ParityConfig
from lightning_dlrover.monitor import emit
from lightning_dlrover.monitor import events as job_events
from lightning_dlrover.planner.job import OPTIMIZER_BYTES_PER_ROW, STEP_S_PER_RANK_SAMPLE, PlannedJob

HISTORY_ENV = "LIGHTNING_DLROVER_HISTORY"  # the advisor's (lightning_dlrover.advisor.history.HISTORY_ENV)
#: Environment variable: the job's mean time between failures in hours, for ``parity: auto`` (``--mtbf-hours``).
MTBF_ENV = "LIGHTNING_DLROVER_MTBF_HOURS"
#: The file a run's pick is recorded in (see the module docs).
PLAN_FILE = "parity_plan.json"


def _mtbf_hours() -> float | None:
    text = os.environ.get(MTBF_ENV)
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"${MTBF_ENV}={text!r} is not a number of hours (the job's mean time between failures).")


def _global_batch(trainer: pl.Trainer) -> int:
    datamodule = getattr(trainer, "datamodule", None)
    return getattr(getattr(datamodule, "hparams", {}), "get", lambda *_: None)("global_batch_size") or 4096


def job_key(strategy: Any, trainer: pl.Trainer) -> str:
    """The job's key in the history's cost records (:meth:`~lightning_dlrover.planner.job.PlannedJob.key`)."""
    tables = tuple((t.rows, t.dim) for t in torchrec_glue.embedding_tables(strategy.lightning_module))
    return PlannedJob(tables, strategy.num_processes, strategy.num_nodes, _global_batch(trainer)).key()


def _recorded_costs(strategy: Any, trainer: pl.Trainer) -> dict[str, float]:
    """The costs the job history (``$LIGHTNING_DLROVER_HISTORY``) holds for this job's tables and batch: measured by
    earlier runs of it (:mod:`.cost_probe`) or a benchmark."""
    history = os.environ.get(HISTORY_ENV)
    if not history:
        return {}
    from lightning_dlrover.planner.records import read_costs

    return read_costs(history, job_key(strategy, trainer))


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


def plan_path(trainer: pl.Trainer) -> Path:
    """Where this node records the run's pick: its spill directory, else the trainer's run directory."""
    node = FaultManager.node_dir()
    return (node if node is not None else Path(trainer.default_root_dir)) / PLAN_FILE


def _fields(pick: ParityConfig | None) -> dict[str, int] | None:
    return {"k": pick.k, "r": pick.r, "commit_every_n_steps": pick.commit_every_n_steps} if pick else None


def recorded_plan(path: Path) -> dict[str, Any] | None:
    """The pick this run recorded at ``path`` (``{"parity": fields or None, "world_size": W}``), ``None`` when there
    is none for this run: no file, another run's (its run id differs) or no launcher (no run id: nothing restarts)."""
    run_id = worker_env.run_id()
    if not run_id or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("run_id") == run_id and "parity" in record else None


def _record(path: Path, pick: ParityConfig | None, world_size: int) -> None:
    if not worker_env.run_id():
        return
    if path.parent == FaultManager.node_dir():
        FaultManager.node_dir(create=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps({"run_id": worker_env.run_id(), "world_size": world_size, "parity": _fields(pick)}))
    temporary.replace(path)


def _usable(record: dict[str, Any] | None, world_size: int) -> bool:
    parity = record and record["parity"]
    return record is not None and (parity is None or parity["k"] + parity["r"] <= world_size)


def _planned(strategy: Any, trainer: pl.Trainer, module: nn.Module) -> tuple[ParityConfig | None, dict[str, float]]:
    """The planner's pick for this job (rank 0 only), and the costs from the job history it used."""
    measured = _recorded_costs(strategy, trainer)
    costs = dict(measured)
    step_s = costs.pop("step_s", STEP_S_PER_RANK_SAMPLE * _global_batch(trainer) / strategy.world_size)
    pick = ParityConfig.auto(strategy.world_size, state_bytes(module), step_s, ranks_per_machine=strategy.num_processes,
                             mtbf_hours=_mtbf_hours(), measured=costs)
    return pick, measured


def resolve(strategy: Any, trainer: pl.Trainer) -> ParityConfig | None:
    """``strategy.parity``, with ``"auto"`` replaced by the run's recorded pick or the planner's, the same on every rank
    (collective, except on a replacement joining in process: it reads the recorded pick)."""
    if strategy.parity != "auto":
        return strategy.parity
    module = strategy.lightning_module
    check("auto", strategy.world_size, module)
    path = plan_path(trainer)
    mine = recorded_plan(path)
    if strategy.fault.joining():  # the survivors are in fit: no collective; the launcher's run recorded the pick
        if mine is None:
            raise RuntimeError(f"parity: auto: this replacement finds no pick recorded by its run at {path}; a "
                               "replacement must code with the survivors' parity. Is the spill directory shared "
                               "with the ranks of this machine ($LIGHTNING_DLROVER_SPILL_DIR)?")
        emit("parity_planned", world_size=strategy.world_size, parity=mine["parity"], mtbf_hours=_mtbf_hours(),
             source="recorded", message=f"parity: auto: this replacement kept the pick its run recorded: "
             f"{mine['parity'] or 'no parity (checkpoints only)'}")
        return ParityConfig(**mine["parity"]) if mine["parity"] else None
    found: list[Any] = [None] * strategy.world_size
    dist.all_gather_object(found, mine, group=control_plane.group())
    picked: list[Any] = [None, None]
    measured: dict[str, float] | None = None
    if strategy.global_rank == 0:
        record = next((r for r in found if r is not None), None)
        if _usable(record, strategy.world_size):
            picked = [record["parity"], "recorded"]
        else:
            planned, measured = _planned(strategy, trainer, module)
            picked = [_fields(planned), "planned"]
    dist.broadcast_object_list(picked, src=0, group=control_plane.group())
    fields, source = picked
    pick = ParityConfig(**fields) if fields else None
    if mine is None or mine["parity"] != fields:
        _record(path, pick, strategy.world_size)
    if strategy.global_rank == 0 and (history := os.environ.get(HISTORY_ENV)):  # measured for the next run's plan
        from lightning_dlrover.strategy.cost_probe import CostProbe

        trainer.callbacks.append(CostProbe(history, job_key(strategy, trainer),
                                           (pick.k, pick.r, pick.commit_every_n_steps) if pick else None))
    if strategy.global_rank == 0:
        job_events.configure(Path(trainer.default_root_dir) / "dlrover_events.jsonl")
        how = "kept the pick its run recorded" if source == "recorded" else "picked"
        emit("parity_planned", world_size=strategy.world_size, parity=fields, mtbf_hours=_mtbf_hours(), source=source,
             measured=measured,
             message=f"parity: auto {how}: {fields or 'no parity (checkpoints only)'} at {strategy.world_size} ranks")
    return pick
