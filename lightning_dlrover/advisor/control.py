"""How the advisor changes a running job, and what it tells people to change when it cannot.

Live knobs:

- threads per rank: ``torch.set_num_threads`` on every rank;
- data workers per rank: through an object implementing :class:`DataWorkersControl` (a callback of the user's,
  or :mod:`~lightning_dlrover.advisor.live`'s adapter over the ``PipelineTuner`` / ``PipelinedLoader``);
- per-rank batch: through an object implementing :class:`BatchSizeControl` (a callback of the user's, or the
  adapter over the ``ElasticBatchScaler``, which also keeps the learning rates consistent).

The ``callbacks`` arguments below are any such objects (the advisor passes
:func:`~lightning_dlrover.advisor.live.live_controls`).

World size and nodes need a restart: :func:`restart_instructions` writes the ``torchrun`` command, the
config change and the Kubernetes replica change.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_dlrover.advisor.resources import ResourceConfig


@runtime_checkable
class DataWorkersControl(Protocol):
    """A callback that owns the training data pipeline and can change its worker processes per rank.

    ``set_data_workers`` is called on every rank at the same training step (between two steps); the change may
    take effect a few batches later (batches already prefetched are used first).
    """

    def get_data_workers(self) -> int:
        """Data-loading worker processes per rank now."""

    def set_data_workers(self, workers: int) -> None:
        """Use ``workers`` worker processes per rank from the next batches on."""


@runtime_checkable
class BatchSizeControl(Protocol):
    """A callback that owns the per-rank batch size (and whatever must change with it, e.g. the learning rate).

    ``set_batch_per_rank`` is called on every rank at the same training step.
    """

    def get_batch_per_rank(self) -> int:
        """Samples per rank per step now."""

    def set_batch_per_rank(self, batch: int) -> None:
        """Use ``batch`` samples per rank per step from the next batches on."""


def find_control(callbacks: Iterable[Any], protocol: type) -> Any | None:
    """The first callback implementing ``protocol`` (:class:`DataWorkersControl` or :class:`BatchSizeControl`)."""
    return next((c for c in callbacks if isinstance(c, protocol)), None)


def live_changes(current: ResourceConfig, target: ResourceConfig, callbacks: Iterable[Any]) -> dict[str, int]:
    """The knobs of ``target`` that differ from ``current`` and can change without a restart."""
    callbacks = list(callbacks)
    changes = {}
    if target.threads_per_rank != current.threads_per_rank:
        changes["threads_per_rank"] = target.threads_per_rank
    if target.data_workers != current.data_workers and find_control(callbacks, DataWorkersControl) is not None:
        changes["data_workers"] = target.data_workers
    if target.batch_per_rank != current.batch_per_rank and find_control(callbacks, BatchSizeControl) is not None:
        changes["batch_per_rank"] = target.batch_per_rank
    return changes


def apply_live(changes: dict[str, int], callbacks: Iterable[Any]) -> None:
    """Applies :func:`live_changes` on this rank (every rank must call it at the same step)."""
    callbacks = list(callbacks)
    if "threads_per_rank" in changes:
        torch.set_num_threads(changes["threads_per_rank"])
    if "data_workers" in changes:
        find_control(callbacks, DataWorkersControl).set_data_workers(changes["data_workers"])
    if "batch_per_rank" in changes:
        find_control(callbacks, BatchSizeControl).set_batch_per_rank(changes["batch_per_rank"])


def needs_restart(current: ResourceConfig, target: ResourceConfig, callbacks: Iterable[Any]) -> list[str]:
    """Knobs of ``target`` that differ from ``current`` and cannot change in the running job."""
    live = live_changes(current, target, callbacks)
    fields = ("nodes", "ranks_per_node", "threads_per_rank", "data_workers", "batch_per_rank")
    return [f for f in fields if getattr(target, f) != getattr(current, f) and f not in live]


def torchrun_command(target: ResourceConfig, program: list[str], max_nodes: int | None = None) -> str:
    """The ``torchrun`` line that starts the job with ``target``'s nodes and ranks per node (``OMP_NUM_THREADS``
    sets the threads per rank; an elastic range ``--nnodes MIN:MAX`` when ``max_nodes`` exceeds the nodes)."""
    nnodes = f"{target.nodes}:{max_nodes}" if max_nodes and max_nodes > target.nodes else str(target.nodes)
    parts = [f"OMP_NUM_THREADS={target.threads_per_rank}", "torchrun", f"--nnodes {nnodes}",
             f"--nproc-per-node {target.ranks_per_node}"]
    if target.nodes > 1 or (max_nodes or 1) > 1:
        parts += ["--rdzv-backend c10d", "--rdzv-endpoint $HEAD_NODE:29400", "--rdzv-id $JOB_ID"]
    return " ".join(parts + [shlex.join(program)])


def config_changes(current: ResourceConfig, target: ResourceConfig) -> dict[str, Any]:
    """LightningCLI keys to change (``trainer.devices``/``num_nodes``, ``data.global_batch_size``, ...)."""
    out: dict[str, Any] = {}
    if target.ranks_per_node != current.ranks_per_node:
        out["trainer.devices"] = target.ranks_per_node
    if target.nodes != current.nodes:
        out["trainer.num_nodes"] = target.nodes
    if target.global_batch != current.global_batch:
        out["data.global_batch_size"] = target.global_batch
    if target.data_workers != current.data_workers:
        out["data workers per rank (data pipeline)"] = target.data_workers
    return out


def kubernetes_patch(current: ResourceConfig, target: ResourceConfig, cores_per_rank: float | None = None) -> str:
    """The replica change for a Kubeflow ``PyTorchJob`` (``Worker`` replicas, ``nprocPerNode``) and a DLRover
    ``ElasticJob`` (``worker`` replicas), as YAML to merge into the manifest."""
    lines = [
        "# PyTorchJob (kubeflow.org/v1)",
        "spec:",
        f"  nprocPerNode: \"{target.ranks_per_node}\"",
        "  elasticPolicy: {minReplicas: %d, maxReplicas: %d}" % (min(current.nodes, target.nodes), max(current.nodes, target.nodes)),
        "  pytorchReplicaSpecs:",
        f"    Worker: {{replicas: {target.nodes}}}",
        "# ElasticJob (elastic.iml.github.io/v1alpha1)",
        "spec:",
        "  replicaSpecs:",
        f"    worker: {{replicas: {target.nodes}}}",
    ]
    if cores_per_rank is not None:
        cpu = target.ranks_per_node * (target.threads_per_rank + target.data_workers)
        lines.append(f"# container resources per worker pod: cpu: \"{cpu}\" (ranks x (threads + data workers))")
    return "\n".join(lines)


def restart_instructions(current: ResourceConfig, target: ResourceConfig, callbacks: Iterable[Any],
                         program: list[str], max_nodes: int | None = None) -> str:
    """What a person runs to move the job to ``target`` (empty if no restart is needed)."""
    pending = needs_restart(current, target, callbacks)
    if not pending:
        return ""
    lines = [f"Restart needed for: {', '.join(pending)} ({current.short()} -> {target.short()})",
             "  command:  " + torchrun_command(target, program, max_nodes)]
    changes = config_changes(current, target)
    if changes:
        lines.append("  config:   " + ", ".join(f"{k}={v}" for k, v in changes.items()))
    lines.append("  Kubernetes:")
    lines += ["    " + line for line in kubernetes_patch(current, target, 1.0).splitlines()]
    lines.append("  Resume from the job's newest checkpoint (DLRoverStrategy checkpoints load into any world size).")
    return "\n".join(lines)
