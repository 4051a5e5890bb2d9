"""What a machine's supervisor (:mod:`.supervisor`) is told, and the workers it keeps."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from lightning_dlrover.fault.inplace import zygote


@dataclass(frozen=True)
class SupervisorConfig:
    """What a machine's supervisor is told (``lightning-dlrover launch``'s options)."""

    program: list[str]  # the worker's command line after the interpreter: ``script.py [args]`` or ``-m module [args]``
    nnodes: int = 1  # machines in the job
    node_rank: int = 0  # this machine's index (0 hosts the store)
    nproc_per_node: int = 1  # ranks on this machine
    spares: int = 1  # hot spares kept on this machine
    master: str = "127.0.0.1:29500"  # host:port of the store (on machine 0)
    max_restarts: int = 3  # full restarts when in-process recovery fails
    stop_grace: float = 30.0  # seconds between SIGTERM and SIGKILL on a full restart
    no_in_process: bool = False  # restart every worker on any failure, like torchrun
    monitor_interval: float = 0.05  # seconds between checks of the workers
    node_timeout: float = 3.0  # seconds of silence after which machine 0 declares another machine lost
    settle: float = 0.1  # seconds to wait after a first failure for others that come with it
    zygote: bool = True  # fork workers from a warm process that imported the libraries once (:mod:`.zygote`)
    cold_start: bool = True  # no spare left: a new process takes a lost rank (False: the survivors shrink, one machine)
    memory_limit_bytes: int | None = None  # the job's memory on this machine (None: the machine's), for a shrink
    regrow: bool = False  # after a shrink, start a process and grow back to the launch size in process (:mod:`.grow`)
    max_nproc_per_node: int = 0  # the most ranks this machine may run after grows the job asks for (0: nproc_per_node)
    max_nnodes: int = 0  # the most machines the job may have: more may join it while it runs (0: nnodes; :mod:`.join`)


@dataclass
class Worker:
    """A worker process and the rank it holds (``None`` for an unassigned spare)."""

    process: subprocess.Popen | zygote.ForkedProcess
    rank: int | None
    spare: int | None = None
    forked: bool = False  # forked from the zygote (the libraries imported) rather than started as a fresh interpreter
