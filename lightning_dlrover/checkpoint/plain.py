"""Plain (unsharded) model state: the directory ``lightning-dlrover export`` writes (``model.pt``: the unsharded
module's ``state_dict``; ``config.json``; ``model.pt2``: a ``torch.export`` program), loading it into a sharded
module (``DLRoverStrategy(init_from=...)``: every rank copies only its own shards' rows out of a memory-mapped
``model.pt``), and the checks of what a user passes to either side, with messages that say what was expected."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from lightning_dlrover.checkpoint.directory import INFO_FILE, META_FILE, SHARDED_DIR

MODEL_FILE = "model.pt"
CONFIG_FILE = "config.json"
PROGRAM_FILE = "model.pt2"


class BadCheckpoint(ValueError):
    """A checkpoint or an export directory that is not what was expected; the message names what was."""


def _owner(path: Path, markers: tuple[str, ...]) -> Path | None:
    """The directory (``path``'s parent or grandparent) holding one of ``markers``, if ``path`` is a file in one."""
    for parent in (path.parent, path.parent.parent):
        if any((parent / marker).is_file() for marker in markers):
            return parent
    return None


def checked_directory(path: str | Path, what: str, markers: tuple[str, ...], example: str) -> Path:
    """``path`` as a directory; raises :class:`BadCheckpoint` when it is missing, or a file (inside a ``what``
    directory: then naming that directory)."""
    path = Path(path)
    if path.is_file():
        owner = _owner(path, markers)
        if owner is not None:
            raise BadCheckpoint(f"{path} is a file inside the {what} {owner}: pass the directory {owner}, "
                                f"not a file in it.")
        raise BadCheckpoint(f"{path} is a file; expected a {what} directory ({example}).")
    if not path.is_dir():
        raise BadCheckpoint(f"{path} does not exist; expected a {what} directory ({example}).")
    return path


def checkpoint_directory(path: str | Path) -> Path:
    """A strategy checkpoint directory (``meta.pt``, ``dlrover.json``, ``sharded/``), checked as
    :func:`checked_directory` does and for its three entries."""
    example = "a directory Trainer.save_checkpoint or ModelCheckpoint wrote, e.g. checkpoints/last.ckpt"
    path = checked_directory(path, "strategy checkpoint", (INFO_FILE, META_FILE), example)
    missing = [name for name in (INFO_FILE, META_FILE, SHARDED_DIR) if not (path / name).exists()]
    if missing:
        inner = sorted(p.parent for p in path.glob(f"*/{INFO_FILE}") if not p.parent.name.endswith(".partial"))
        hint = f" It holds checkpoints: pass one of them, e.g. {inner[-1]}." if inner else ""
        raise BadCheckpoint(f"{path} is not a DLRoverStrategy checkpoint: {', '.join(missing)} missing (expected "
                            f"{INFO_FILE}, {META_FILE} and {SHARDED_DIR}/ inside: {example}).{hint}")
    return path


def export_directory(path: str | Path) -> Path:
    """An export directory holding ``model.pt``, checked as :func:`checked_directory` does."""
    example = "one `lightning-dlrover export --out DIR` wrote, holding model.pt and config.json"
    path = checked_directory(path, "export", (MODEL_FILE, CONFIG_FILE), example)
    if not (path / MODEL_FILE).is_file():
        raise BadCheckpoint(f"{path} holds no {MODEL_FILE}; expected an export directory ({example}).")
    return path


def check_shapes(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], source: Path,
                 model: str) -> None:
    """Raises :class:`BadCheckpoint` when ``found`` (what ``source`` holds) lacks an entry of ``expected`` (what
    ``model`` has), has one it does not, or one of another shape: naming the entry (its table) and both shapes."""
    for key, shape in expected.items():
        if key not in found:
            raise BadCheckpoint(f"{source} holds no {key!r} ({_table(key)}shape {list(shape)} in {model}): it was "
                                "written for another model config.")
        if tuple(found[key]) != tuple(shape):
            raise BadCheckpoint(f"{source} was written for another model config: {_table(key)}{key!r} has shape "
                                f"{list(found[key])} there, {list(shape)} in {model}. Use the config it was trained "
                                "with (its hparams are in the checkpoint's meta.pt / the export's config.json).")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise BadCheckpoint(f"{source} holds {len(extra)} entries {model} does not have (e.g. {extra[0]!r}): it was "
                            "written for another model config.")


def _table(key: str) -> str:
    parts = key.split(".")
    return f"table {parts[-2]!r}: " if len(parts) >= 2 and parts[-1] == "weight" and "embedding" in key else ""


def read_model_file(path: Path) -> dict[str, torch.Tensor]:
    """``model.pt`` of an export directory, memory-mapped (pages are read when a tensor is used) without
    unpickling anything but tensors; raises :class:`BadCheckpoint` naming the file when it is damaged."""
    file = path / MODEL_FILE
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError, ValueError, OSError) as err:
        raise BadCheckpoint(f"{file} cannot be read ({str(err).splitlines()[0][:200]}): it is truncated or not a "
                            "torch.save file. Export the checkpoint again.") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise BadCheckpoint(f"{file} is not a plain state dict (a dict of tensors).")
    return state


def load_plain_into(module: nn.Module, path: Path) -> None:
    """Copies the export directory ``path``'s ``model.pt`` into ``module`` (sharded or not): for a sharded table,
    only the rows and columns of this rank's shards are read. Raises :class:`BadCheckpoint` when the shapes differ."""
    plain = read_model_file(path)
    target = module.state_dict()
    check_shapes({k: tuple(v.size()) for k, v in target.items()}, {k: tuple(v.shape) for k, v in plain.items()},
                 path / MODEL_FILE, type(module).__name__)
    with torch.no_grad():
        for key, value in target.items():
            if isinstance(value, ShardedTensor):
                for shard in value.local_shards():
                    meta = shard.metadata
                    index = tuple(slice(o, o + s) for o, s in zip(meta.shard_offsets, meta.shard_sizes, strict=True))
                    shard.tensor.copy_(plain[key][index])
            else:
                value.copy_(plain[key])
    module.load_state_dict(target)
