"""``StateDigest``: prints a sharding-independent SHA-256 of the training state to verify reproducibility."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_dlrover.checkpoint.digest import state_digest


def training_state_digest(trainer: pl.Trainer) -> str:
    """Digest of the model and optimizer state under any strategy (a collective on every rank)."""
    strategy = trainer.strategy
    if hasattr(strategy, "state_digest"):
        return strategy.state_digest()
    state: dict[str, Any] = {
        "model": trainer.lightning_module.state_dict(),
        "optimizers": [optimizer.state_dict()["state"] for optimizer in trainer.optimizers],
    }
    return state_digest(state)


class StateDigest(pl.Callback):
    """Prints ``state digest at step N: <sha256>`` on rank 0 and keeps every digest in :attr:`digests`.

    Two runs with the same seed and world size print the same digests; a run resumed from a checkpoint
    prints, at its start, the digest of the state it resumed from.

    Args:
        at_start: also digest the state when training starts (after a checkpoint restore).
        every_n_steps: also digest every ``n`` optimizer steps; ``None`` only at the end of training.
    """

    def __init__(self, at_start: bool = False, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"StateDigest(every_n_steps={every_n_steps}) must be a positive number of steps.")
        self.at_start = at_start
        self.every_n_steps = every_n_steps
        self.digests: dict[int, str] = {}

    def _record(self, trainer: pl.Trainer) -> None:
        digest = training_state_digest(trainer)
        self.digests[trainer.global_step] = digest
        if trainer.is_global_zero:
            print(f"state digest at step {trainer.global_step}: {digest}", flush=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_start:
            self._record(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self._record(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step not in self.digests:
            self._record(trainer)
