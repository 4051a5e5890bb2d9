"""The replicated part of the training state (dense parameters, dense optimizer state) at the last commit."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.distributed._shard.sharded_tensor import ShardedTensor


class ReplicatedSnapshot:
    """A copy of every replicated tensor taken at each commit, so a rollback can return the dense model and
    its optimizers to the committed step together with the embedding rows. Dense state is small next to the
    tables; each rank keeps its own copy (survivors have it, a replacement receives it from a survivor).

    Args:
        tensors: returns the live tensors to keep, in a fixed order (it is called at every commit, so
            optimizer state created lazily after the first step is picked up).
    """

    def __init__(self, tensors: Callable[[], Sequence[Tensor]]) -> None:
        self._tensors = tensors
        self._copies: list[Tensor] = []
        self._staged: list[Tensor] = []

    @staticmethod
    def _copy_into(copies: list[Tensor], live: list[Tensor]) -> list[Tensor]:
        if [t.shape for t in live] != [c.shape for c in copies]:
            return [t.detach().clone() for t in live]
        if live:
            torch._foreach_copy_(copies, [t.detach() for t in live])
        return copies

    def take(self) -> None:
        """Copies the live tensors into the snapshot."""
        self._copies = self._copy_into(self._copies, list(self._tensors()))

    def stage(self) -> None:
        """Copies the live tensors aside; :meth:`promote` makes them the snapshot (a commit that is decided later)."""
        self._staged = self._copy_into(self._staged, list(self._tensors()))

    def promote(self) -> None:
        """The staged copy becomes the snapshot (the previous one is reused by the next :meth:`stage`)."""
        self._copies, self._staged = self._staged, self._copies

    def restore(self) -> None:
        """Copies the snapshot back into the live tensors."""
        live = [t.detach() for t in self._tensors()]
        if live and len(live) == len(self._copies):
            torch._foreach_copy_(live, self._copies)


def dense_buffers(module: nn.Module) -> list[Tensor]:
    """The module's buffers outside the sharded tables (per rank: TorchRec's DDP does not broadcast them)."""
    return [b for _, b in module.named_buffers() if not b.is_meta and not isinstance(b, ShardedTensor)]


def replicated_tensors(module: nn.Module,
                       optimizers: Callable[[], Sequence[torch.optim.Optimizer]]) -> Callable[[], list[Tensor]]:
    """The replicated state, for :class:`ReplicatedSnapshot`: every dense parameter and buffer of ``module`` and the
    state tensors of the dense optimizers (``optimizers()``: the current ones, read at every call)."""
    dense = [v for v in module.state_dict(keep_vars=True).values()
             if isinstance(v, Tensor) and not isinstance(v, ShardedTensor) and not v.is_meta]

    def tensors() -> list[Tensor]:
        state = [v for opt in optimizers() for group in opt.param_groups for p in group["params"]
                 for _, v in sorted(opt.state.get(p, {}).items()) if torch.is_tensor(v)]
        return [*dense, *state]

    return tensors
