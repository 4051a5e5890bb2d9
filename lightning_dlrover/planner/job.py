"""The job a plan is for, read from a ``lightning-dlrover fit`` config without building it: its embedding tables
(the state parity codes and checkpoints save), its world size and global batch; and its history key."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from lightning_dlrover.planner.costs import SAVE_MODES

#: Bytes per table row beside its weights: the row-wise Adagrad state (one float32 per row), FBGEMM's default.
OPTIMIZER_BYTES_PER_ROW = 4
#: Per-rank step seconds per sample, measured here (bench_fault_tolerance.py: 2 ranks, 26 x 100000 x 64, global
#: batch 4096: 753 ms a step without parity): the step time of a plan made with no measurement and no history.
STEP_S_PER_RANK_SAMPLE = 0.753 / (4096 / 2)


@dataclass(frozen=True)
class PlannedJob:
    """A job as the planner sees it: tables ``(rows, dim)``, ranks per machine, machines, global batch, and how it
    saves checkpoints (:data:`~.costs.SAVE_MODES`; ``incremental_every``: a full save every so many)."""

    tables: tuple[tuple[int, int], ...]
    ranks_per_machine: int
    machines: int
    global_batch: int
    save_mode: str = "blocking"
    incremental_every: int | None = None

    def __post_init__(self) -> None:
        if not self.tables:
            raise ValueError("the config has no embedding tables (model.num_embeddings_per_feature is empty): parity "
                             "codes embedding tables and the planner sizes checkpoints by them; set them, or plan a "
                             "job that has some.")
        for rows, dim in self.tables:
            if rows < 1 or dim < 1:
                raise ValueError(f"an embedding table of {rows} rows x {dim} columns makes no sense: both must be >= 1.")
        if self.save_mode not in SAVE_MODES:
            raise ValueError(f"save mode {self.save_mode!r} is not one of {', '.join(SAVE_MODES)}.")
        if self.incremental_every is not None and self.incremental_every < 1:
            raise ValueError(f"incremental_checkpoint_every={self.incremental_every} must be >= 1 (or unset).")
        if self.ranks_per_machine < 1 or self.machines < 1 or self.global_batch < 1:
            raise ValueError(f"ranks per machine ({self.ranks_per_machine}), machines ({self.machines}) and the "
                             f"global batch ({self.global_batch}) must be >= 1.")

    @property
    def world_size(self) -> int:
        return self.ranks_per_machine * self.machines

    @property
    def state_bytes(self) -> int:
        """The tables' weights (float32) and their row-wise optimizer state, over all ranks."""
        return sum(rows * (dim * 4 + OPTIMIZER_BYTES_PER_ROW) for rows, dim in self.tables)

    def key(self) -> str:
        """The job's key in the history's cost records: its tables and global batch."""
        text = json.dumps({"tables": sorted(self.tables), "global_batch": self.global_batch})
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def default_step_s(self, world_size: int | None = None) -> float:
        """A step's seconds from :data:`STEP_S_PER_RANK_SAMPLE` (no measurement, no history)."""
        return STEP_S_PER_RANK_SAMPLE * self.global_batch / (world_size or self.world_size)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PlannedJob:
        """From a ``fit`` config (``model.num_embeddings_per_feature``, ``model.embedding_dim``, ``trainer.devices``,
        ``trainer.num_nodes``, ``data.global_batch_size``, the strategy's ``async_checkpoint`` and
        ``incremental_checkpoint_every``)."""
        model, trainer, data = (config.get(key) or {} for key in ("model", "trainer", "data"))
        rows = model.get("num_embeddings_per_feature")
        if rows is None:
            raise ValueError("the config has no model.num_embeddings_per_feature: no embedding tables to plan for.")
        dim = int(model.get("embedding_dim", 64))
        devices = trainer.get("devices", 1)
        if not isinstance(devices, int) or isinstance(devices, bool):
            raise ValueError(f"trainer.devices={devices!r}: the planner needs a number of ranks per machine.")
        strategy = trainer.get("strategy")
        options = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
        every = options.get("incremental_checkpoint_every")
        return cls(tables=tuple((int(r), dim) for r in rows), ranks_per_machine=devices,
                   machines=int(trainer.get("num_nodes", 1)), global_batch=int(data.get("global_batch_size", 4096)),
                   save_mode=save_mode(bool(options.get("async_checkpoint")), every),
                   incremental_every=int(every) if every else None)


def save_mode(asynchronous: bool, incremental_every: int | None) -> str:
    """The save mode (:data:`~.costs.SAVE_MODES`) of a strategy's ``async_checkpoint`` and
    ``incremental_checkpoint_every``."""
    if incremental_every:
        return "async+incremental" if asynchronous else "incremental"
    return "async" if asynchronous else "blocking"
