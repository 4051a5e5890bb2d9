"""The checkpoint directory of a sharded job: ``sharded/`` (every rank's shards, written by a backend),
``meta.pt`` (the rest of Lightning's checkpoint dict, rank 0) and ``dlrover.json`` (step, world size, backend).

``meta.pt`` is read with ``torch.load(weights_only=True)``: a checkpoint cannot run code unless the caller
asks for it (``weights_only=False``). ``dlrover.json`` lets a job find its newest checkpoint without
unpickling anything.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

META_FILE = "meta.pt"
SHARDED_DIR = "sharded"
INFO_FILE = "dlrover.json"


def staging_path(path: Path) -> Path:
    """Where a checkpoint is written before it is complete (renamed to ``path`` by :func:`publish`)."""
    return path.with_name(path.name + ".partial")


def write_meta(staging: Path, meta: dict[str, Any], info: dict[str, Any]) -> None:
    """Writes ``meta.pt`` and ``dlrover.json`` (``info``: ``global_step``, ``world_size``, ``backend``) into ``staging``."""
    torch.save(meta, staging / META_FILE)
    (staging / INFO_FILE).write_text(json.dumps(info))


def publish(staging: Path, path: Path) -> None:
    """Replaces ``path`` with the complete checkpoint at ``staging``."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    staging.rename(path)


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete checkpoint directory (``meta.pt`` and ``dlrover.json`` inside)."""
    return (path / META_FILE).is_file() and (path / INFO_FILE).is_file()


def check_path(path: Path) -> Path:
    """``path`` when it is a checkpoint directory; otherwise raises ``FileNotFoundError`` with one line saying what
    ``path`` is (missing, a file inside a checkpoint, another file or directory) and what was expected."""
    if is_checkpoint(path):
        return path
    expected = (f"a DLRoverStrategy checkpoint is a directory holding {META_FILE}, {INFO_FILE} and {SHARDED_DIR}/, "
                "written by ModelCheckpoint or Trainer.save_checkpoint (e.g. .../checkpoints/last.ckpt)")
    inside = next((parent for parent in path.parents if is_checkpoint(parent)), None)
    if inside is not None:
        raise FileNotFoundError(
            f"{path} is inside the checkpoint {inside}: pass the checkpoint directory itself ({inside}); {expected}."
        )
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path} (no such file or directory); {expected}.")
    what = "a directory" if path.is_dir() else "a file"
    raise FileNotFoundError(f"{path} is {what} but not a DLRoverStrategy checkpoint (no {META_FILE} and {INFO_FILE} "
                            f"inside); {expected}.")


def read_info(path: Path) -> dict[str, Any]:
    """``dlrover.json`` of a checkpoint; raises ``FileNotFoundError`` naming the problem when it is not one."""
    return json.loads((check_path(path) / INFO_FILE).read_text())


def read_meta(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """``meta.pt`` of a checkpoint, without unpickling arbitrary objects unless ``weights_only=False``."""
    try:
        return torch.load(path / META_FILE, map_location="cpu", weights_only=weights_only is not False)
    except pickle.UnpicklingError as err:
        raise pickle.UnpicklingError(
            f"{path / META_FILE} holds objects that loading would have to execute code for "
            f"({str(err).splitlines()[0][:300]}). If you trust this file, resume with "
            "trainer.fit(..., weights_only=False), or allow the types with torch.serialization.add_safe_globals."
        ) from None


def latest_checkpoint(directory: Path | None, at_most: int | None = None) -> Path | None:
    """The complete checkpoint under ``directory`` with the highest step ``<= at_most`` (any step if ``None``); hidden
    directories (a link of an incremental chain moved aside) are not candidates."""
    if directory is None or not directory.is_dir():
        return None
    found = []
    for info in directory.glob(f"*/{INFO_FILE}"):
        if info.parent.name.endswith(".partial") or info.parent.name.startswith(".") or not is_checkpoint(info.parent):
            continue
        step = int(json.loads(info.read_text())["global_step"])
        if at_most is None or step <= at_most:
            found.append((step, str(info.parent)))
    return Path(max(found)[1]) if found else None
