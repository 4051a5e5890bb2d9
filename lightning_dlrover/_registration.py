"""Registers the ``"dlrover"`` strategy name with Lightning's ``StrategyRegistry`` without importing Lightning:
at once when Lightning's strategies are already imported, else the moment they are (an import hook that fires
once), so that ``import lightning_dlrover`` stays cheap and ``Trainer(strategy="dlrover")`` still works."""

from __future__ import annotations

import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

STRATEGY_NAME = "dlrover"
DESCRIPTION = "TorchRec-sharded embeddings with DLRover fault tolerance"
_STRATEGIES = "lightning.pytorch.strategies"  # where Lightning's StrategyRegistry lives


def create_strategy(**kwargs: Any) -> Any:
    """A :class:`~lightning_dlrover.strategy.DLRoverStrategy` (what the registry builds for ``"dlrover"``)."""
    from lightning_dlrover.strategy.dlrover import DLRoverStrategy

    return DLRoverStrategy(**kwargs)


def register(registry: Any) -> None:
    """Adds ``"dlrover"`` to ``registry`` unless it is there (the strategy class is imported when it is built)."""
    if STRATEGY_NAME not in registry:
        registry.register(STRATEGY_NAME, create_strategy, description=DESCRIPTION)


class _RegisterOnImport:
    """A ``sys.meta_path`` finder that lets Lightning's strategies module load as usual, registers ``"dlrover"``
    in its registry right after it ran, and removes itself."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != _STRATEGIES:
            return None
        self.remove()
        spec = importlib.util.find_spec(fullname)  # what the other finders make of it
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            register(module.StrategyRegistry)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def register_when_lightning_loads() -> None:
    """Registers ``"dlrover"`` now if Lightning's strategies are imported, else as soon as they are."""
    strategies = sys.modules.get(_STRATEGIES)
    if strategies is not None and hasattr(strategies, "StrategyRegistry"):
        register(strategies.StrategyRegistry)
    elif not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
