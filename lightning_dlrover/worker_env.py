"""What the elastic launcher tells its workers through the environment, read in one place.

``torchrun`` and ``lightning-dlrover launch`` (which mimics it) set the same variables; every package reads
them through this module, so the names and their defaults live here only."""

from __future__ import annotations

import json
import os

import psutil

#: Environment variable giving the smallest number of nodes the job may shrink to, where the launcher's
#: command line cannot be read (it wins over ``--nnodes MIN:MAX``).
MIN_NODES_ENV = "LIGHTNING_DLROVER_MIN_NODES"


#: Set by ``lightning-dlrover launch --max-nnodes M`` (room for more machines): JSON ``{"max_nnodes", "nproc_per_node",
#: "master"}``, what a launcher on a new machine needs to join the running job (:func:`join_room`).
JOIN_ENV = "LIGHTNING_DLROVER_JOIN"

#: Variables the launcher sets (``lightning-dlrover launch`` writes them under these names too).
RUN_ID = "TORCHELASTIC_RUN_ID"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"


def under_torchrun() -> bool:
    """Whether this process is a worker of ``torchrun``'s elastic agent."""
    return RUN_ID in os.environ


def join_room() -> dict | None:
    """``{"max_nnodes", "nproc_per_node", "master"}`` when machines may join this job in process (``launch
    --max-nnodes``), else ``None``."""
    raw = os.environ.get(JOIN_ENV)
    return json.loads(raw) if raw else None


def run_id() -> str:
    """The launcher's run id (the same on every node and across restarts), ``""`` outside a launcher."""
    return os.environ.get(RUN_ID, "")


def local_world_size() -> int:
    """Workers on this node (1 outside a launcher)."""
    return int(os.environ.get(LOCAL_WORLD_SIZE, "1"))


def restart_count() -> int:
    """How many times the agent restarted this worker group (0 on the first start or outside ``torchrun``)."""
    return int(os.environ.get(RESTART_COUNT, "0") or 0)


def elastic_trainer_args() -> dict[str, int]:
    """``Trainer(devices=..., num_nodes=...)`` of the current ``torchrun`` worker group, ``{}`` outside ``torchrun``.

    After a shrink or grow the world size is no longer the one the job was launched with, and Lightning
    rejects a ``devices * num_nodes`` that differs from ``WORLD_SIZE``; pass these instead of constants.
    """
    if not under_torchrun():
        return {}
    local = int(os.environ[LOCAL_WORLD_SIZE])
    return {"devices": local, "num_nodes": int(os.environ["WORLD_SIZE"]) // local}


def node_range() -> tuple[int, int] | None:
    """``(min, max)`` nodes of the elastic job: ``$LIGHTNING_DLROVER_MIN_NODES`` (max = current nodes), else the
    agent's ``--nnodes`` (``N`` or ``MIN:MAX``; also ``$PET_NNODES``); ``None`` when neither can be read.

    ``torchrun`` does not pass the range to its workers, so it is read from the agent's command line.
    """
    if not under_torchrun():
        return None
    nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ[LOCAL_WORLD_SIZE])
    if os.environ.get(MIN_NODES_ENV):
        return int(os.environ[MIN_NODES_ENV]), nodes
    value = os.environ.get("PET_NNODES")
    try:
        argv = psutil.Process(os.getppid()).cmdline()
    except psutil.Error:
        argv = []
    for i, arg in enumerate(argv):
        if arg == "--nnodes" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--nnodes="):
            value = arg.split("=", 1)[1]
    if not value:
        return None
    low, _, high = value.partition(":")
    return int(low), int(high or low)
