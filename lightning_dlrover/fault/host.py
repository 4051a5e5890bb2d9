"""What the fault-tolerance components need from the training strategy (``DLRoverStrategy`` is one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn


class Host(Protocol):
    """What the manager needs from the training strategy (``DLRoverStrategy`` is one)."""

    global_rank: int
    world_size: int
    local_rank: int
    num_processes: int  # ranks on this node
    model: nn.Module  # the sharded model (TorchRec ``DistributedModelParallel``)
    lightning_module: nn.Module
    optimizers: list[torch.optim.Optimizer]

    @property
    def is_global_zero(self) -> bool: ...

    def latest_checkpoint(self, at_most: int | None) -> Path | None: ...

    def load_checkpoint(self, checkpoint_path: Path) -> dict[str, Any]: ...
