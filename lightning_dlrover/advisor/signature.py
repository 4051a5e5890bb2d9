"""A job's signature (what it trains, on what hardware) and how close two signatures are, for warm starts."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from lightning_dlrover.advisor.model import JobShape
from lightning_dlrover.advisor.resources import Machine
from lightning_dlrover.torchrec_glue import embedding_tables, in_backward_optimizer_classes

#: Weights of the log-scale differences in :meth:`JobSignature.distance`.
DISTANCE_WEIGHTS = {"embedding_bytes": 1.0, "pooled_floats": 1.0, "dense_params": 0.5, "global_batch": 0.5,
                    "tables": 0.5, "cores": 1.0, "memory": 0.25}


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: rows, columns, and ids per sample (pooling factor; 1.0 until measured)."""

    name: str
    rows: int
    dim: int
    pooling_factor: float = 1.0


@dataclass(frozen=True)
class JobSignature:
    """What identifies a job for the job history: model, tables, batch, sharding and hardware.

    Attributes:
        model: the LightningModule's class name.
        tables: every embedding table.
        dense_params: parameters outside the embedding tables (replicated on every rank).
        global_batch: samples per step over all ranks.
        sharding_types: sharding types the plan uses.
        machine: the node.
        state_bytes_per_weight: optimizer-state bytes per embedding weight byte (row-wise Adagrad ~0, Adagrad 1).
    """

    model: str
    tables: tuple[TableSpec, ...]
    dense_params: int
    global_batch: int
    sharding_types: tuple[str, ...]
    machine: Machine
    state_bytes_per_weight: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def embedding_rows(self) -> int:
        return sum(t.rows for t in self.tables)

    @property
    def embedding_bytes(self) -> int:
        """Weights (fp32) and optimizer state of all tables."""
        return int(sum(t.rows * t.dim * 4 for t in self.tables) * (1.0 + self.state_bytes_per_weight))

    @property
    def pooled_floats(self) -> float:
        return float(sum(t.pooling_factor * t.dim for t in self.tables))

    def shape(self, planned_shares: tuple[tuple[int, float], ...] = ()) -> JobShape:
        """The performance model's view of this job."""
        return JobShape(tuple(t.pooling_factor * t.dim for t in self.tables), self.dense_params, self.embedding_bytes,
                        planned_shares)

    def key(self) -> str:
        """A hash of everything but the extra fields: equal for the same job on the same kind of machine."""
        data = self.to_dict()
        data.pop("extra", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:32]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSignature:
        return cls(model=data["model"], tables=tuple(TableSpec(**t) for t in data["tables"]),
                   dense_params=int(data["dense_params"]), global_batch=int(data["global_batch"]),
                   sharding_types=tuple(data["sharding_types"]), machine=Machine(**data["machine"]),
                   state_bytes_per_weight=float(data.get("state_bytes_per_weight", 0.0)),
                   extra=dict(data.get("extra") or {}))

    def distance(self, other: JobSignature) -> float:
        """Weighted distance of log sizes (embedding bytes, pooled floats, dense parameters, batch, tables, cores,
        memory) plus 3 for another device type, 1 x the Jaccard distance of sharding types and 0.5 for another
        model class. 0 for equal signatures; a table twice as large adds ``log 2 = 0.69``."""
        pairs = {
            "embedding_bytes": (self.embedding_bytes, other.embedding_bytes),
            "pooled_floats": (self.pooled_floats, other.pooled_floats),
            "dense_params": (self.dense_params, other.dense_params),
            "global_batch": (self.global_batch, other.global_batch),
            "tables": (len(self.tables), len(other.tables)),
            "cores": (self.machine.cores, other.machine.cores),
            "memory": (self.machine.memory_bytes, other.machine.memory_bytes),
        }
        squares = sum(DISTANCE_WEIGHTS[k] * (math.log1p(a) - math.log1p(b)) ** 2 for k, (a, b) in pairs.items())
        total = math.sqrt(squares)
        total += 3.0 * (self.machine.device != other.machine.device)
        a, b = set(self.sharding_types), set(other.sharding_types)
        total += 1.0 - len(a & b) / len(a | b) if a | b else 0.0
        total += 0.5 * (self.model != other.model)
        return total

    def similarity(self, other: JobSignature) -> float:
        """``exp(-distance)``: 1 for equal signatures, ~0.5 for a model twice as large on the same machine."""
        return math.exp(-self.distance(other))


#: Optimizer-state bytes per weight byte of TorchRec's fused optimizers (row-wise Adagrad keeps one float per row).
STATE_BYTES = {"RowWiseAdagrad": 0.0, "Adagrad": 1.0, "SGD": 0.0, "Adam": 2.0}


def table_specs(module: nn.Module, pooling_factors: dict[str, float] | None = None) -> tuple[TableSpec, ...]:
    """Every embedding table of TorchRec ``EmbeddingBagCollection``/``EmbeddingCollection`` modules in ``module``."""
    pooling_factors = pooling_factors or {}
    return tuple(TableSpec(t.name, t.rows, t.dim, pooling_factors.get(t.name, 1.0)) for t in embedding_tables(module))


def embedding_optimizer_state(module: nn.Module) -> float:
    """:data:`STATE_BYTES` of the tables' in-backward optimizer (0 if unknown)."""
    for param in module.parameters():
        for cls in in_backward_optimizer_classes(param):
            return STATE_BYTES.get(cls.__name__, 1.0)
    return 0.0


def dense_parameter_count(module: nn.Module, tables: tuple[TableSpec, ...]) -> int:
    """Parameters of ``module`` that are not embedding weights."""
    total = sum(p.numel() for p in module.parameters())
    return max(0, total - sum(t.rows * t.dim for t in tables))


def signature_of(module: nn.Module, global_batch: int, sharding_types: tuple[str, ...], machine: Machine,
                 pooling_factors: dict[str, float] | None = None) -> JobSignature:
    """The signature of a job training ``module`` (before or after sharding: only table configs are read)."""
    tables = table_specs(module, pooling_factors)
    return JobSignature(type(module).__name__, tables, dense_parameter_count(module, tables), global_batch,
                        tuple(sorted(sharding_types)), machine, embedding_optimizer_state(module))
