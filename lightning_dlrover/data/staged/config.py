"""The data pipeline's stages and its configuration: workers per stage and prefetch depth."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from lightning_dlrover.machine import available_cores

STAGES = ("read", "parse", "transform", "assemble")
Method = Literal["thread", "process"]
DEFAULT_METHODS: dict[str, Method] = {"read": "thread", "parse": "process", "transform": "process",
                                      "assemble": "process"}


def chained(config: PipelineConfig, methods: dict[str, Method] | None = None) -> bool:
    """Whether ``config`` runs as a chain of worker processes: assemble has workers and they are processes. Then
    every stage with workers runs in processes of its own that pass work to each other, a stage without workers
    runs in the processes of the next stage that has some, and the training process only receives batches."""
    return config.assemble > 0 and {**DEFAULT_METHODS, **(methods or {})}["assemble"] == "process"


def stage_methods(config: PipelineConfig, methods: dict[str, Method] | None = None) -> dict[str, Method]:
    """How each stage of ``config`` runs: its method, or ``"process"`` for every stage of a :func:`chained` one."""
    merged = {**DEFAULT_METHODS, **(methods or {})}
    return {s: "process" for s in STAGES} if chained(config, merged) else merged


@dataclass(frozen=True)
class PipelineConfig:
    """Workers per stage and prefetch depth in batches. A stage with 0 workers runs inline where it is pulled: in
    the thread that pulls from it, or, when assemble has worker processes (:func:`chained`), in the processes of
    the next stage that has workers."""

    read: int = 1
    parse: int = 1
    transform: int = 1
    assemble: int = 1
    prefetch: int = 2

    def __post_init__(self) -> None:
        for name in (*STAGES, "prefetch"):
            if getattr(self, name) < 0:
                raise ValueError(f"PipelineConfig.{name}={getattr(self, name)} must be >= 0.")

    @property
    def workers(self) -> dict[str, int]:
        return {s: getattr(self, s) for s in STAGES}

    @property
    def total_workers(self) -> int:
        return sum(self.workers.values())

    def replace(self, **changes: int) -> PipelineConfig:
        return dataclasses.replace(self, **changes)

    def short(self) -> str:
        return "r{read} p{parse} t{transform} a{assemble} q{prefetch}".format(**dataclasses.asdict(self))


#: The in-process configuration: every stage inline, nothing prefetched (today's loader with the fast parse).
INLINE = PipelineConfig(0, 0, 0, 0, 0)
#: The start where the trainer leaves no core free: every stage inline, in one prefetch thread.
FEW_CORES = PipelineConfig(0, 0, 0, 0, 1)


def for_machine(ranks_per_node: int = 1, trainer_threads: int = 1, cores: int | None = None) -> PipelineConfig:
    """The pipeline a job gets when ``data.pipeline`` names no workers: :data:`FEW_CORES` when the node's cores, split
    across its ``ranks_per_node`` training ranks, leave each less than one core beyond its trainer's own
    ``trainer_threads`` (a CPU trainer's intra-op threads; one thread feeds a GPU), else ``PipelineConfig()``.

    Worker processes on a core the trainer uses slow every step by more than they save (issue #24, measured on 2 cores:
    ``bench/bench_pipeline_oracle.py``); a tuner climbs from either start where the data is the bottleneck.

    Example::

        for_machine(ranks_per_node=1, trainer_threads=2, cores=2)    # r0 p0 t0 a0 q1: a CPU trainer on 2 cores
        for_machine(ranks_per_node=8, trainer_threads=1, cores=64)   # r1 p1 t1 a1 q2: 8 GPUs, 7 cores each to spare
    """
    if ranks_per_node < 1 or trainer_threads < 1:
        raise ValueError(f"for_machine(ranks_per_node={ranks_per_node}, trainer_threads={trainer_threads}): "
                         "both must be >= 1.")
    cores = available_cores() if cores is None else cores
    return PipelineConfig() if cores / ranks_per_node - trainer_threads >= 1 else FEW_CORES
