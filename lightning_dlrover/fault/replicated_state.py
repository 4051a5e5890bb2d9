"""The replicated part of the training state (dense parameters, dense optimizer state) at the last commit."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


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

    def take(self) -> None:
        """Copies the live tensors into the snapshot."""
        live = list(self._tensors())
        if [t.shape for t in live] != [c.shape for c in self._copies]:
            self._copies = [t.detach().clone() for t in live]
        elif live:
            torch._foreach_copy_(self._copies, [t.detach() for t in live])

    def restore(self) -> None:
        """Copies the snapshot back into the live tensors."""
        live = [t.detach() for t in self._tensors()]
        if live and len(live) == len(self._copies):
            torch._foreach_copy_(live, self._copies)
