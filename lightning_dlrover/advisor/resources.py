"""What a job is given (:class:`ResourceConfig`), what a node has (:class:`Machine`), and what may be chosen
(:class:`SearchSpace`)."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_dlrover.machine import available_cores, memory_limit_bytes


@dataclass(frozen=True)
class ResourceConfig:
    """The resources of one training job.

    Attributes:
        nodes: machines (``torchrun --nnodes``).
        ranks_per_node: training processes per machine (``torchrun --nproc-per-node`` / ``Trainer(devices=...)``).
        threads_per_rank: intra-op threads of each rank (``torch.set_num_threads``).
        data_workers: data-loading worker processes per rank (0: batches are made in the training process).
        batch_per_rank: samples per rank per step (the global batch is ``world_size * batch_per_rank``).
    """

    nodes: int = 1
    ranks_per_node: int = 1
    threads_per_rank: int = 1
    data_workers: int = 0
    batch_per_rank: int = 256

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node", "threads_per_rank", "batch_per_rank"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ResourceConfig.{name}={getattr(self, name)} must be at least 1.")
        if self.data_workers < 0:
            raise ValueError(f"ResourceConfig.data_workers={self.data_workers} must be 0 or more.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_per_rank

    def with_(self, **changes: int) -> ResourceConfig:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def short(self) -> str:
        """``2x2 ranks, 1 thr, 0 wrk, b=256``."""
        return (f"{self.nodes}x{self.ranks_per_node} ranks, {self.threads_per_rank} thr, {self.data_workers} wrk, "
                f"b={self.batch_per_rank}")


@dataclass(frozen=True)
class Machine:
    """One node as the job sees it.

    Attributes:
        cores: CPU cores the job may use on the node (affinity mask and cgroup CPU quota).
        memory_bytes: memory the job may use on the node (cgroup limit, else physical memory).
        device: ``cpu`` or the accelerator type (``cuda``).
        accelerators: accelerators on the node (0 on CPU).
    """

    cores: int
    memory_bytes: int
    device: str = "cpu"
    accelerators: int = 0

    @classmethod
    def detect(cls) -> Machine:
        """This node: cores from the affinity mask and cgroup quota, memory from the cgroup limit or RAM."""
        import torch

        cuda = torch.cuda.is_available()
        return cls(cores=available_cores(), memory_bytes=memory_limit_bytes(), device="cuda" if cuda else "cpu",
                   accelerators=torch.cuda.device_count() if cuda else 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SearchSpace:
    """The configurations a recommendation may choose from.

    Attributes:
        nodes: ``(min, max)`` machines.
        ranks_per_node: allowed ranks per machine (default: 1 to the machine's cores, powers of two and the cores).
        threads_per_rank: allowed threads per rank (default: 1 to the cores, powers of two and the cores).
        data_workers: allowed data workers per rank.
        batch_per_rank: allowed per-rank batches; ``None`` keeps the job's own.
        global_batch: ``(min, max)`` allowed global batch (the model's convergence range); ``None``: any.
        max_cores_per_node: at most this many threads + workers per node in total (default: 2 x cores; more
            than that only oversubscribes).
    """

    nodes: tuple[int, int] = (1, 1)
    ranks_per_node: tuple[int, ...] | None = None
    threads_per_rank: tuple[int, ...] | None = None
    data_workers: tuple[int, ...] = (0,)
    batch_per_rank: tuple[int, ...] | None = None
    global_batch: tuple[int, int] | None = None
    max_cores_per_node: int | None = None

    def __post_init__(self) -> None:
        low, high = self.nodes
        if not 1 <= low <= high:
            raise ValueError(f"SearchSpace.nodes={self.nodes}: need 1 <= min <= max.")
        for name in ("ranks_per_node", "threads_per_rank", "batch_per_rank"):
            values = getattr(self, name)
            if values is not None and (not values or min(values) < 1):
                raise ValueError(f"SearchSpace.{name}={values}: give positive values (or leave it out).")
        if not self.data_workers or min(self.data_workers) < 0:
            raise ValueError(f"SearchSpace.data_workers={self.data_workers}: give values >= 0.")
        if self.global_batch is not None and not 1 <= self.global_batch[0] <= self.global_batch[1]:
            raise ValueError(f"SearchSpace.global_batch={self.global_batch}: need 1 <= min <= max.")

    def candidates(self, machine: Machine, current: ResourceConfig) -> list[ResourceConfig]:
        """Every allowed configuration (the current batch per rank when ``batch_per_rank`` is ``None``); the
        current ranks per node and threads per rank are always among the choices."""
        default = _ladder(machine.cores)
        # the job's own ranks and threads are always candidates (with other batches, workers)
        ranks = sorted({*(self.ranks_per_node or default), current.ranks_per_node})
        threads = sorted({*(self.threads_per_rank or default), current.threads_per_rank})
        batches = self.batch_per_rank or (current.batch_per_rank,)
        budget = self.max_cores_per_node or 2 * machine.cores
        out = []
        for n, g, t, d, b in itertools.product(range(self.nodes[0], self.nodes[1] + 1), ranks, threads,
                                               self.data_workers, batches):
            if g * (t + d) > budget and (g, t, d) != (current.ranks_per_node, current.threads_per_rank, current.data_workers):
                continue
            if self.global_batch is not None and not self.global_batch[0] <= n * g * b <= self.global_batch[1]:
                continue
            out.append(ResourceConfig(n, g, t, d, b))
        return out


def _ladder(cores: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``cores``, and ``cores`` itself."""
    values = {cores}
    v = 1
    while v < cores:
        values.add(v)
        v *= 2
    return tuple(sorted(values))
