"""``DLRoverStrategy(parity="auto")`` (YAML ``parity: auto``): the fault-tolerance planner picks the parity and the
checkpoint interval at start.

Before any rank starts, :func:`check` refuses what the planner cannot plan (fewer than 2 ranks, a model with no
embedding tables). At set-up, before the model is sharded, :func:`resolve` plans on rank 0
(:func:`lightning_dlrover.planner.inputs.plan_inputs`: the job's embedding state from its tables, a step time from
the measured default per sample, or the costs an earlier run of the same job recorded in the job history named by
``$LIGHTNING_DLROVER_HISTORY`` (:mod:`lightning_dlrover.planner.records`), failures from
``$LIGHTNING_DLROVER_MTBF_HOURS`` (the job's MTBF in hours), else the history's observed ones, else the published
rates), hands the pick to every rank over the control plane and records it (event ``parity_planned``).
The pick may be ``None``: checkpoints alone do better at this failure rate. With a job history, rank 0 also times
a few of the run's first steps and its first saves (:mod:`.cost_probe`) and records them for the next run's plan.

The plan (:func:`lightning_dlrover.planner.inputs.plan_inputs`, as ``lightning-dlrover plan`` and ``launch --spares
auto`` make it) also sets the checkpoint interval: Young/Daly's at the time a save blocks training in the job's save
mode (``async_checkpoint``, ``incremental_checkpoint_every``; the history's ``checkpoint_saved`` measurements of the
job, else the size-based estimate). Every rank sets it on each ``ModelCheckpoint`` given no interval (no
``every_n_train_steps``, ``train_time_interval`` or ``every_n_epochs`` other than Lightning's default); an interval
the user set is never changed (event ``checkpoint_interval_planned``, and a log line, either way).

The pick is planned once per run: every rank writes it to ``parity_plan.json`` in its node's spill directory (the
run directory outside a launcher) with the launcher's run id, and a restarted incarnation (``torchrun`` or
``launch`` restarting every worker) or a replacement taking a lost rank in process reuses it (``source:
"recorded"``) instead of planning again: the spills and parity it decodes were written with that ``(k, r, N)``. A
recorded parity the world size can no longer hold (``k + r`` above it, a shrunk elastic job) is planned again. The
checkpoint interval is recorded with it and kept the same way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from torch import nn

from lightning_dlrover import control_plane, lightning_glue, torchrec_glue, worker_env
from lightning_dlrover.fault import FaultManager, ParityConfig
from lightning_dlrover.monitor import emit
from lightning_dlrover.monitor import events as job_events
from lightning_dlrover.planner.inputs import HISTORY_ENV, Pick, PlanInputs, mtbf_from_env, plan_inputs
from lightning_dlrover.planner.job import OPTIMIZER_BYTES_PER_ROW, PlannedJob, save_mode

#: The file a run's pick is recorded in (see the module docs).
PLAN_FILE = "parity_plan.json"


def _mtbf_hours() -> float | None:
    return mtbf_from_env()


def _global_batch(trainer: pl.Trainer) -> int:
    datamodule = getattr(trainer, "datamodule", None)
    return getattr(getattr(datamodule, "hparams", {}), "get", lambda *_: None)("global_batch_size") or 4096


def planned_job(strategy: Any, trainer: pl.Trainer) -> PlannedJob:
    """The job as the planner sees it: its tables, ranks, global batch and save mode."""
    tables = tuple((t.rows, t.dim) for t in torchrec_glue.embedding_tables(strategy.lightning_module))
    checkpointing = strategy.checkpointing
    every = checkpointing.policy.every if checkpointing.policy is not None else None
    return PlannedJob(tables, strategy.num_processes, strategy.num_nodes, _global_batch(trainer),
                      save_mode(checkpointing.asynchronous, every), every)


def job_key(strategy: Any, trainer: pl.Trainer) -> str:
    """The job's key in the history's cost records (:meth:`~lightning_dlrover.planner.job.PlannedJob.key`)."""
    return planned_job(strategy, trainer).key()


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
    _mtbf_hours()  # a bad $LIGHTNING_DLROVER_MTBF_HOURS raises


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


def _record(path: Path, pick: ParityConfig | None, world_size: int, every: int | None) -> None:
    if not worker_env.run_id():
        return
    if path.parent == FaultManager.node_dir():
        FaultManager.node_dir(create=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps({"run_id": worker_env.run_id(), "world_size": world_size, "parity": _fields(pick),
                                     "checkpoint_every_n_train_steps": every}))
    temporary.replace(path)


def _usable(record: dict[str, Any] | None, world_size: int) -> bool:
    parity = record and record["parity"]
    return record is not None and (parity is None or parity["k"] + parity["r"] <= world_size)


def _planned(strategy: Any, trainer: pl.Trainer) -> tuple[Pick, PlanInputs]:
    """The planner's pick for this job (rank 0 only), and the inputs it planned with."""
    inputs = plan_inputs(planned_job(strategy, trainer), strategy.world_size, strategy.num_processes,
                         os.environ.get(HISTORY_ENV), _mtbf_hours())
    return Pick.of(inputs.plan().best), inputs


def resolve(strategy: Any, trainer: pl.Trainer) -> ParityConfig | None:
    """``strategy.parity``, with ``"auto"`` replaced by the run's recorded pick or the planner's, the same on every rank
    (collective, except on a replacement joining in process: it reads the recorded pick); the pick's checkpoint
    interval applied to ``trainer``'s ``ModelCheckpoint``s given none."""
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
        apply_interval(trainer, mine.get("checkpoint_every_n_train_steps"), None, "recorded", quiet=True)
        return ParityConfig(**mine["parity"]) if mine["parity"] else None
    found: list[Any] = [None] * strategy.world_size
    dist.all_gather_object(found, mine, group=control_plane.group())
    picked: list[Any] = [None, None, None]
    pick, inputs = None, None
    if strategy.global_rank == 0:
        record = next((r for r in found if r is not None), None)
        if _usable(record, strategy.world_size):
            picked = [record["parity"], "recorded", record.get("checkpoint_every_n_train_steps")]
        else:
            pick, inputs = _planned(strategy, trainer)
            picked = [pick.parity, "planned", pick.checkpoint_every_steps]
    dist.broadcast_object_list(picked, src=0, group=control_plane.group())
    fields, source, every = picked
    parity = ParityConfig(**fields) if fields else None
    if mine is None or mine["parity"] != fields or mine.get("checkpoint_every_n_train_steps") != every:
        _record(path, parity, strategy.world_size, every)
    if strategy.global_rank == 0 and (history := os.environ.get(HISTORY_ENV)):  # measured for the next run's plan
        from lightning_dlrover.strategy.cost_probe import CostProbe

        trainer.callbacks.append(CostProbe(history, job_key(strategy, trainer),
                                           (parity.k, parity.r, parity.commit_every_n_steps) if parity else None,
                                           save_mode=planned_job(strategy, trainer).save_mode))
    if strategy.global_rank == 0:
        job_events.configure(Path(trainer.default_root_dir) / "dlrover_events.jsonl")
        how = "kept the pick its run recorded" if source == "recorded" else "picked"
        spares = f"; launch --spares {pick.spares}" if pick is not None and pick.spares else ""
        emit("parity_planned", world_size=strategy.world_size, parity=fields, mtbf_hours=_mtbf_hours(), source=source,
             measured=inputs.measured() if inputs is not None else None,
             message=f"parity: auto {how}: {fields or 'no parity (checkpoints only)'} at {strategy.world_size} "
             f"ranks{spares}")
    apply_interval(trainer, every, (pick, inputs) if pick is not None else None, source,
                   quiet=strategy.global_rank != 0)
    return parity


def apply_interval(trainer: pl.Trainer, every: int | None, planned: tuple[Pick, PlanInputs] | None, source: str,
                   quiet: bool = False) -> None:
    """Sets the planned checkpoint interval (``every`` steps; ``None``: parity covers every failure, none needed) on
    each of ``trainer``'s ``ModelCheckpoint``s given no interval, and says so (event ``checkpoint_interval_planned``
    and a log line; ``quiet``: neither, for the ranks other than 0)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    unset = [c for c in callbacks if lightning_glue.checkpoint_interval_unset(c)]
    if every is not None:
        for callback in unset:
            lightning_glue.set_checkpoint_every_n_train_steps(callback, every)
    if quiet:
        return
    if every is None:
        why = "parity covers every failure: no periodic checkpoint needed"
    elif not callbacks:
        why = "the trainer has no ModelCheckpoint (set one to save every planned interval)"
    elif not unset:
        why = "every ModelCheckpoint has an interval the user set (kept)"
    else:
        why = None
    costs = planned[1].plan().costs if planned is not None else None
    fields = {"every_s": planned[0].checkpoint_every_s if planned is not None and every else None,
              "save_mode": planned[1].save_mode if planned else None,
              "save_s": costs.save_s if costs else None, "save_lag_s": costs.save_lag_s if costs else None}
    cost = (f" (Young/Daly at {costs.save_s:.3f} s blocked per {fields['save_mode']} save, "
            f"{costs.sources['save_s']})") if costs else f" ({source})"
    applied = every is not None and bool(unset)
    kept = len(callbacks) - len(unset)
    message = (f"parity: auto set the checkpoint interval: every {every} training steps{cost} on {len(unset)} "
               f"ModelCheckpoint(s)" + (f"; kept the interval of {kept} the user set" if kept else "")
               if applied else f"parity: auto planned checkpoints every {every or '-'} steps{cost}, applied to none: "
               f"{why}")
    emit("checkpoint_interval_planned", every_n_train_steps=every, applied=applied, why=why, source=source,
         message=message, **fields)
