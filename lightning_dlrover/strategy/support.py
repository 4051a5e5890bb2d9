"""What the strategy can run on which device, and the refusals of what it cannot run yet.

README.md's table "What runs where" gives users the same facts; docs/gpu.md holds the design of the GPU path and the
status of each piece. Each refusal raises a ``ValueError`` that says what is not supported and what to use instead.
It comes before the ranks start where that can be checked (``lightning-dlrover fit`` calls
:meth:`~lightning_dlrover.strategy.DLRoverStrategy.check_model` in the launching process), and otherwise in each
rank's ``setup_environment``, before its process group starts. No refusal here needs a GPU to be reached: the
device type is a string.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from torch import nn

from lightning_dlrover import torchrec_glue
from lightning_dlrover.log import get_logger
from lightning_dlrover.monitor.events import emit

log = get_logger(__name__)
_data_checked: weakref.WeakSet = weakref.WeakSet()

#: In-backward optimizers whose whole state parity codes: their state is per element or per row (SGD has none,
#: Adagrad keeps one value per element, row-wise Adagrad one per row). Adam, LAMB, LARS and their partial-row-wise
#: variants also keep state outside the rows (FBGEMM's step counter ``iter``), which no parity chunk holds, so a
#: decoded rank would resume with another step count than the survivors.
PARITY_CODED_OPTIMIZERS = ("SGD", "Adagrad", "RowWiseAdagrad")

#: Environment variable: ``1`` lets parity run on CUDA shards. The commit path is wired to the device (parity, undo
#: logs and deltas on the shards' device, CuPy kernels, pinned staging for the gloo control plane: ``# Untested on
#: GPU`` in ``fault/coding/``) but has never run on a GPU with TorchRec, and a restart's re-shard still receives
#: into TorchRec's live buffers over gloo; so it is refused unless asked for, at the user's risk.
UNTESTED_GPU_PARITY_ENV = "LIGHTNING_DLROVER_UNTESTED_GPU_PARITY"

GPU_DOC = "docs/gpu.md"


def uncoded_optimizers(module: nn.Module) -> dict[str, str]:
    """``{parameter: optimizer class}`` of embedding parameters whose in-backward optimizer keeps state parity does not
    code (any class outside :data:`PARITY_CODED_OPTIMIZERS`)."""
    return {
        param.name: cls.__name__
        for param in torchrec_glue.embedding_parameters(module)
        for cls in param.optimizer_classes
        if cls.__name__ not in PARITY_CODED_OPTIMIZERS
    }


def check_parity_optimizers(module: nn.Module, parity: bool) -> None:
    """With ``parity`` on, on every device, raises a ``ValueError`` when an embedding optimizer keeps state outside the
    rows (see :data:`PARITY_CODED_OPTIMIZERS`)."""
    if parity and (uncoded := uncoded_optimizers(module)):
        raise ValueError(
            f"strategy.parity codes embedding rows and their per-row optimizer state only: in-backward optimizer(s) "
            f"{sorted(set(uncoded.values()))} of {sorted(uncoded)[:3]}... keep state outside the rows (Adam and LAMB "
            "a step counter) that a decoded rank would not get back. With parity use one of "
            f"{list(PARITY_CODED_OPTIMIZERS)} (DLRMModule: model.embedding_optimizer: sgd, adagrad or "
            "row_wise_adagrad), or leave parity out (a lost rank then falls back to the newest checkpoint)."
        )


def check_device(device_type: str, transport: str, parity: bool, in_process: bool) -> None:
    """Raises a ``ValueError`` when the job asks for something its device cannot do yet.

    Args:
        device_type: the ranks' device type (``"cpu"``, ``"cuda"``, ...).
        transport: the backend that carries the world group's collectives (``"gloo"``, ``"nccl"``, ...).
        parity: whether ``strategy.parity`` is on.
        in_process: whether the job runs under ``lightning-dlrover launch`` (in-process recovery on).
    """
    if in_process and (device_type != "cpu" or transport != "gloo"):
        raise ValueError(
            f"In-process recovery (`lightning-dlrover launch`) runs on CPU with gloo only; this job's ranks are on "
            f"{device_type!r} with backend {transport!r}. Under NCCL a lost peer hangs the survivors' collectives (or "
            "PyTorch's watchdog ends their processes) instead of raising, and nothing replaces an NCCL communicator "
            f"yet: designed, not built ({GPU_DOC}). Run a GPU job under `torchrun` (a lost rank restarts every "
            "worker), or train on CPU (trainer.accelerator: cpu) under `launch`."
        )
    untested_ok = device_type == "cuda" and os.environ.get(UNTESTED_GPU_PARITY_ENV) == "1"
    if parity and device_type != "cpu" and not untested_ok:
        raise ValueError(
            f"strategy.parity on {device_type!r} is not supported yet: the per-step commit is wired to the device "
            "(lightning_dlrover/fault/coding/) but has never run on a GPU with TorchRec, and a restart's re-shard "
            f"still receives into the live shards over gloo ({GPU_DOC}). Train with parity on CPU, or leave parity out "
            f"on the GPU (a lost rank then falls back to the newest checkpoint); {UNTESTED_GPU_PARITY_ENV}=1 lets it "
            "run, untested, at your risk."
        )


def _leaves(iterables: Any) -> list[Any]:
    if isinstance(iterables, dict):
        return [leaf for value in iterables.values() for leaf in _leaves(value)]
    if isinstance(iterables, (list, tuple)):
        return [leaf for value in iterables for leaf in _leaves(value)]
    return [] if iterables is None else [iterables]


def unresumable_loaders(iterables: Any) -> list[str]:
    """The training loaders in ``iterables`` (a loader, or a list or dict of them) that cannot say where they are:
    no ``state_dict``/``load_state_dict``, so Lightning starts them again from the beginning on a restore."""
    return [f"{type(loader).__name__}({type(getattr(loader, 'dataset', None)).__name__})" if hasattr(loader, "dataset")
            else type(loader).__name__ for loader in _leaves(iterables)
            if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)))]


def warn_unresumable_data(trainer: Any) -> None:
    """Says once per trainer, on global rank 0 before its first step, when a recovery cannot be exact for the data:
    it restores the model and optimizers to the committed step, but a training loader without a ``state_dict``
    starts its stream again from the beginning."""
    if trainer in _data_checked:
        return
    _data_checked.add(trainer)
    found = unresumable_loaders(trainer.train_dataloader)
    if found and trainer.is_global_zero:
        emit("data_not_resumable", step=trainer.global_step, loaders=found)
        log.warning(
            f"DLRoverStrategy: the training loader {', '.join(found)} has no state_dict(): a recovery (in process, from "
            "spills or from a checkpoint) restores the model and optimizers exactly at the committed step, but this "
            "loader starts again from the beginning of its stream, so the data after a recovery (and the final state) "
            "differ from a fault-free run. To make recovery exact for the data too, return a "
            "torchdata.stateful_dataloader.StatefulDataLoader from train_dataloader() (with an IterableDataset, give "
            "the dataset state_dict() and load_state_dict() as well).")


def check_no_accumulation(trainer: Any) -> None:
    """Refuses gradient accumulation: fused embedding optimizers update the tables in every backward pass."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported by "
            "DLRoverStrategy: fused embedding optimizers update the tables in every backward pass. "
            "Increase the data module's batch size instead."
        )
