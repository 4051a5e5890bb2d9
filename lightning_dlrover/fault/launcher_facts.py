"""What a strategy asks of its launcher, answered through :class:`~lightning_dlrover.fault.FaultManager` (the one object
a strategy talks to): the process group's backend, whether in-process recovery is on, this node's directory, a
replacement's state (joining, its memory reserve), the sharding plan replacements read and how DDP averages over a
world group whose size changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

from lightning_dlrover.fault.coding import reserve
from lightning_dlrover.fault.inplace import membership
from lightning_dlrover.fault.inplace import protocol as inplace
from lightning_dlrover.fault.inplace.process_group import use_live_size
from lightning_dlrover.fault.restart.spill import ensure_private_dir, spill_dir

Plan = TypeVar("Plan")


class LauncherFacts:
    """The launcher-facing calls of :class:`~lightning_dlrover.fault.FaultManager` (none holds state)."""

    @staticmethod
    def process_group_backend(requested: str | None) -> str | None:
        """The backend for ``init_process_group``: a reconfigurable gloo group under ``lightning-dlrover launch``
        (``ValueError`` there for any other backend)."""
        return inplace.process_group_backend(requested)

    @staticmethod
    def under_launch() -> bool:
        """Whether this process runs under ``lightning-dlrover launch`` (in-process recovery on)."""
        return membership.enabled()

    @staticmethod
    def transport(backend: str) -> str:
        """The backend that carries ``backend``'s collectives (``gloo`` for the reconfigurable group)."""
        return inplace.transport(backend)

    @staticmethod
    def node_dir(create: bool = False) -> Path | None:
        """This node's private directory of the run (its spill directory: it outlives a restart of every worker), made
        if ``create``; ``None`` outside a launcher without ``$LIGHTNING_DLROVER_SPILL_DIR``."""
        directory = spill_dir()
        return ensure_private_dir(directory) if create and directory is not None else directory

    @staticmethod
    def reserved(numel: int, dtype: torch.dtype) -> Tensor | None:
        """On a replacement that was a hot spare: ``numel`` elements of memory it faulted in while it waited (for a
        table buffer the decode fills), ``None`` when it kept none or they do not fit (see :mod:`.coding.reserve`)."""
        return reserve.take(numel, dtype)

    @staticmethod
    def joining() -> bool:
        """Whether this process replaces a lost rank and has not joined the survivors yet."""
        return inplace.joining()

    @staticmethod
    @contextlib.contextmanager
    def building_alone() -> Iterator[None]:
        """Within it, this running rank's collectives are answered locally as a joining rank's are: while it builds
        its sharded model for a grow, the joining ranks build theirs alone (:mod:`.inplace.grow`)."""
        group = inplace.world_group()
        assert group is not None, "building alone needs the reconfigurable world group (lightning-dlrover launch)"
        group.joining = True
        try:
            yield
        finally:
            group.joining = False

    @staticmethod
    def shared_plan(compute: Callable[[], Plan], global_rank: int, before_reading: Callable[[], None]) -> Plan:
        """The sharding plan, kept in the launcher's store for replacements (see :func:`.inplace.protocol.shared_plan`)."""
        return inplace.shared_plan(compute, global_rank, before_reading)

    @staticmethod
    def average_over_live_ranks(module: torch.nn.Module) -> None:
        """Has ``module`` (the dense part's DDP) average its gradients over the live ranks where the world group's size
        can change (see :func:`.inplace.process_group.use_live_size`); nothing elsewhere."""
        use_live_size(module)
