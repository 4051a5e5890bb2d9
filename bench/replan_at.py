"""Callbacks for ``bench_in_process.py --methods "in-process replan" "in-process retire"``: at the end of step ``step``
every rank asks the strategy to plan the tables anew with ``pooling_factors`` (what ``ResourceAdvisor(apply=True)``
does with measured ones), or to shrink the job to ``world_size`` ranks (what it does when fewer ranks are better), so
the change in process can be timed on the benchmark's job. Imported by the job (bench/ on its path)."""

from __future__ import annotations

import lightning.pytorch as pl


class ReplanAt(pl.Callback):
    def __init__(self, step: int, pooling_factors: dict[str, float]) -> None:
        self.step, self.pooling_factors = step, pooling_factors

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step and not trainer.strategy.replan_in_process(self.pooling_factors):
            raise RuntimeError("the job cannot re-plan in process: run it under lightning-dlrover launch with parity")


class ResizeAt(pl.Callback):
    def __init__(self, step: int, world_size: int) -> None:
        self.step, self.world_size = step, world_size

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step and (why := trainer.strategy.resize_in_process(self.world_size)):
            raise RuntimeError(f"the job cannot resize in process: {why}")
