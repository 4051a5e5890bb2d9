"""Spills: what a failing rank leaves in node-local shared memory for the workers that ``torchrun`` restarts.

A spill is one file per rank, ``rank<R>.pt`` (and ``rank<R>.ahead.pt``, see :attr:`Spill.tentative`), holding
only tensors, numbers, strings and lists: it is read with ``torch.load(weights_only=True)``, so a planted file
cannot run code. Its JSON header carries the
job's identity: the run id and the ``torchrun`` agent that started the workers (pid and start time;
``$LIGHTNING_DLROVER_JOB_ID`` replaces the agent where no agent restarts workers). An agent restarts its
own workers, so a spill written under another agent is a leftover of another launch (for example a crashed
job that used the same ``--rdzv-id``): it is refused and removed, never resumed.

The directory (``$LIGHTNING_DLROVER_SPILL_DIR``, else ``/dev/shm/lightning_dlrover-<uid>/<run id>``) must
belong to the user and be private (mode 0700; files 0600); anything else is refused.

Every rank also keeps a progress record (``progress<R>``, 32 bytes rewritten in place at each commit; a process
that replaces a lost rank in place under ``lightning-dlrover launch`` takes over that rank's record) so that a
restart with no usable spill (every rank died at once) can say how many committed steps the fallback to a
checkpoint loses.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import stat
import struct
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import Tensor

from lightning_dlrover import worker_env
from lightning_dlrover.fault.coding.coded_state import SegmentSpec

log = logging.getLogger(__name__)

#: Environment variable naming this node's spill directory.
SPILL_ENV = "LIGHTNING_DLROVER_SPILL_DIR"
#: Environment variable naming this launch of the job, for launchers other than ``torchrun``.
JOB_ID_ENV = "LIGHTNING_DLROVER_JOB_ID"
FORMAT = "lightning_dlrover.spill/2"
_PROGRESS = struct.Struct("<4sIqdq")  # magic, crc32 of the identity, step, time, pad
#: Trainer-state keys a spill leaves out: hyper-parameters may hold arbitrary objects and are not needed to resume.
UNSPILLED_KEYS = ("hyper_parameters", "hparams_name", "datamodule_hyper_parameters", "datamodule_hparams_name")


class UnsafeSpillDir(RuntimeError):
    """The spill directory is not private to this user."""


def job_identity() -> dict[str, Any]:
    """This launch of the job: run id and the launcher (the ``torchrun`` agent) that restarts the workers."""
    run_id = worker_env.run_id()
    if os.environ.get(JOB_ID_ENV):
        return {"run_id": run_id, "job": os.environ[JOB_ID_ENV]}
    agent = psutil.Process(os.getppid())
    return {"run_id": run_id, "agent_pid": agent.pid, "agent_started": round(agent.create_time(), 3)}


def spill_dir() -> Path | None:
    """This node's spill directory, or ``None`` outside ``torchrun`` without ``$LIGHTNING_DLROVER_SPILL_DIR``."""
    if os.environ.get(SPILL_ENV):
        return Path(os.environ[SPILL_ENV])
    if worker_env.run_id():
        return Path("/dev/shm") / f"lightning_dlrover-{os.getuid()}" / worker_env.run_id()
    return None


def _check_private(path: Path) -> None:
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeSpillDir(f"spill directory {path} is not a plain directory (a symbolic link or a file)")
    if info.st_uid != os.getuid():
        raise UnsafeSpillDir(f"spill directory {path} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & 0o077:
        raise UnsafeSpillDir(
            f"spill directory {path} is accessible to other users (mode {stat.S_IMODE(info.st_mode):o}, needs 700)"
        )


def ensure_private_dir(path: Path) -> Path:
    """Creates ``path`` (mode 0700) or checks that it is a private directory of this user; raises
    :class:`UnsafeSpillDir` otherwise. The default root under ``/dev/shm`` and every directory between it and
    ``path`` (a drill's ``<root>/<run>/node<i>``) are created private and checked too: a root made by
    ``mkdir(parents=True)`` would get the umask's mode and be refused by every later job."""
    root = next((i for i, p in enumerate(path.parents) if p.name == f"lightning_dlrover-{os.getuid()}"), None)
    parents = [] if root is None else list(reversed(path.parents[: root + 1]))
    for directory in [*parents, path]:
        if not os.path.lexists(directory):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(directory, 0o700)
        _check_private(directory)
    return path


@dataclass
class Spill:
    """One rank's committed state at ``step``, as spilled when it stopped.

    Attributes:
        rank, world_size: the rank's place in the job that failed.
        step: the committed step (``trainer.global_step``) the state belongs to.
        k, r, local_world_size, chunk_len: the parity code, ranks per node and chunk length of that job.
        layouts: every rank's segment specs (to decode and re-shard a lost rank's chunks).
        chunks: uint8 ``[k, chunk_len]``, the rank's data chunks.
        parity: uint8 ``[r, chunk_len]``, the parity chunks the rank held.
        rank_states: uint8 ``[world_size, n]``, every rank's generators and buffers at ``step`` (``fault.rank_state``).
        meta: the trainer's state at ``step`` as a Lightning checkpoint dict (``state_dict``: dense tensors only).
        identity: the launch that wrote it (see :func:`job_identity`).
        tentative: the rank's state at ``step``, one past its commit: it voted on ``step`` and its vote broke
            before it saw the outcome. Usable only where another rank's spill says ``step`` was committed (a
            completed vote proves every rank had folded in its deltas); no ``meta`` nor ``rank_states``.
    """

    rank: int
    world_size: int
    step: int
    k: int
    r: int
    local_world_size: int
    chunk_len: int
    layouts: list[list[SegmentSpec]]
    chunks: Tensor
    parity: Tensor
    rank_states: Tensor | None
    meta: dict[str, Any] | None
    identity: dict[str, Any] = field(default_factory=dict)
    tentative: bool = False
    path: Path | None = field(default=None, compare=False)

    @property
    def generation(self) -> tuple[int, int, int, int, int]:
        return self.world_size, self.step, self.k, self.r, self.local_world_size


def write_spill(directory: Path, spill: Spill) -> Path:
    """Writes ``spill`` as ``rank<R>.pt`` in the private ``directory``, atomically (mode 0600)."""
    ensure_private_dir(directory)
    header = {k: v for k, v in asdict(spill).items() if k not in ("chunks", "parity", "rank_states", "meta", "path")}
    header["format"], header["written"] = FORMAT, time.time()
    meta = {k: v for k, v in (spill.meta or {}).items() if k not in UNSPILLED_KEYS} if spill.meta is not None else None
    path = directory / f"rank{spill.rank}{'.ahead' if spill.tentative else ''}.pt"
    partial = path.with_name(path.name + f".{os.getpid()}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        torch.save({"header": json.dumps(header), "chunks": spill.chunks, "parity": spill.parity, "rank_states": spill.rank_states,
                    "meta": meta}, out)
    partial.rename(path)
    return path


def _load(path: Path) -> Spill:
    data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    header = json.loads(data["header"])
    if header.pop("format", None) != FORMAT:
        raise ValueError(f"not a spill of format {FORMAT}")
    header.pop("written")
    header["layouts"] = [[SegmentSpec(s["key"], tuple(s["offsets"]), tuple(s["sizes"]), tuple(s["global_size"]),
                                      s["row_bytes"]) for s in specs] for specs in header["layouts"]]
    return Spill(**header, chunks=data["chunks"], parity=data["parity"], rank_states=data["rank_states"], meta=data["meta"], path=path)


def _spill_rank(path: Path) -> int:
    """The rank that wrote a spill file (``rank<R>.pt`` or ``rank<R>.ahead.pt``)."""
    return int(path.stem[4:].split(".")[0])


def _spill_paths(directory: Path) -> list[Path]:
    """The spill files in ``directory``, by rank (a rank's tentative spill before its committed one)."""
    return sorted(directory.glob("rank*.pt"), key=lambda path: (_spill_rank(path), path.name))


def spilled_ranks(directory: Path | None) -> list[int]:
    """The ranks with a spill file in ``directory`` (names only: :func:`read_spills` checks the files)."""
    if directory is None or not directory.is_dir():
        return []
    return sorted({_spill_rank(path) for path in _spill_paths(directory)})


def read_spills(directory: Path | None, local_rank: int, local_world_size: int,
                rank: int | None = None) -> tuple[list[Spill], list[str]]:
    """This worker's share of the node's spills that belong to this launch, and why others were refused (refused
    files are removed).

    With this worker's global ``rank``, the spills of old ranks that are again on this node go to the worker of the
    same rank (a survivor restarted in place gets its own spill back, so its parity can be kept, see
    :func:`~lightning_dlrover.fault.restart.reshard.restore`); the others are dealt out in turn, every
    ``local_world_size``-th from ``local_rank`` on (all of them, without ``rank``).

    A directory that is not private to this user is refused whole; unreadable files, files that would need
    unpickling arbitrary objects, and spills of another launch are refused one by one.
    """
    if directory is None or not directory.exists():
        return [], []
    try:
        _check_private(directory)
    except UnsafeSpillDir as err:
        return [], [f"{err}; no spill in it is used"]
    for partial in directory.glob("*.partial"):  # a writer killed mid-write
        if local_rank == 0:
            partial.unlink(missing_ok=True)
    paths = _spill_paths(directory)
    here = range(rank - local_rank, rank - local_rank + local_world_size) if rank is not None else range(0)
    paths = ([path for path in paths if _spill_rank(path) == rank]
             + [path for path in paths if _spill_rank(path) not in here][local_rank::local_world_size])
    identity, spills, refused = job_identity(), [], []
    for path in paths:
        try:
            spill = _load(path)
        except pickle.UnpicklingError as err:
            why = f"{path}: refused, it needs arbitrary code to load ({str(err).splitlines()[0][:200]})"
        except Exception as err:  # truncated, foreign or of an older format
            why = f"{path}: unreadable ({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})"
        else:
            if spill.identity == identity:
                spills.append(spill)
                continue
            why = (f"{path}: written by another launch ({spill.identity}) than this one ({identity}), e.g. an earlier "
                   "job with the same run id; it is not resumed")
        refused.append(why)
        path.unlink(missing_ok=True)
    return spills, refused


def _identity_crc(identity: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(identity, sort_keys=True).encode())


class ProgressRecord:
    """This rank's last committed step in the spill directory, rewritten in place at each commit (32 bytes)."""

    def __init__(self, directory: Path, rank: int) -> None:
        ensure_private_dir(directory)
        self.crc = _identity_crc(job_identity())
        self.path = directory / f"progress{rank}"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)

    def write(self, step: int) -> None:
        os.pwrite(self._fd, _PROGRESS.pack(b"LDP1", self.crc, step, time.time(), 0), 0)

    def close(self, remove: bool = False) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if remove:
            self.path.unlink(missing_ok=True)


def last_committed_step(directory: Path | None) -> int | None:
    """The highest step in this node's progress records of this launch, ``None`` if there is none."""
    if directory is None or not directory.is_dir():
        return None
    crc, steps = _identity_crc(job_identity()), []
    for path in directory.glob("progress*"):
        data = path.read_bytes()
        if len(data) == _PROGRESS.size:
            magic, record_crc, step, _, _ = _PROGRESS.unpack(data)
            if magic == b"LDP1" and record_crc == crc:
                steps.append(step)
    return max(steps, default=None)
