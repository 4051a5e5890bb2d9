"""The fit loop runs again after a recovery (``lightning_glue.rerun_fit_loop``), and an error raised by the recovery
itself (a peer lost during its last collectives, such as the digest check after a grow) is recovered from like one
raised by a step. A real ``Trainer`` on CPU; ``recover`` plays the in-process recovery's part (its contract: ``True``
when it restored a committed state, ``False`` to let the error propagate)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dlrover import lightning_glue as glue


class Flaky(pl.LightningModule):
    """A linear model whose step ``fail_at`` raises once, as a collective does when a peer died."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.layer, self.fail_at, self.failed = torch.nn.Linear(4, 1), fail_at, False

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at and not self.failed:
            self.failed = True
            raise RuntimeError("Connection closed by peer (step)")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=4)


def _trainer() -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", max_steps=8, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)


def test_an_error_during_the_recovery_is_recovered_from_and_training_ends():
    trainer, seen = _trainer(), []

    def recover(error: BaseException) -> bool:
        seen.append(str(error))
        if len(seen) == 1:  # the recovery's digest check: a collective broken by another lost peer
            raise RuntimeError("Connection reset by peer (check after the grow)")
        return True

    glue.rerun_fit_loop(trainer, recover)
    trainer.fit(Flaky(fail_at=3))
    assert seen == ["Connection closed by peer (step)", "Connection reset by peer (check after the grow)"]
    assert trainer.global_step == 8


def test_a_recovery_that_gives_up_raises_the_last_error():
    trainer, seen = _trainer(), []

    def recover(error: BaseException) -> bool:
        seen.append(str(error))
        if len(seen) == 1:
            raise RuntimeError("no plan after the check broke")
        return False  # not a loss this job recovers from in process: the launcher restarts it

    glue.rerun_fit_loop(trainer, recover)
    with pytest.raises(RuntimeError, match="no plan after the check broke"):
        trainer.fit(Flaky(fail_at=3))
    assert len(seen) == 2


def test_an_error_while_joining_is_recovered_from_like_a_steps():
    trainer, seen, joins = _trainer(), [], []

    def join() -> None:  # a replacement's join: its check after the join breaks
        joins.append(1)
        raise RuntimeError("Connection closed by peer (check after the join)")

    glue.rerun_fit_loop(trainer, lambda error: seen.append(str(error)) or True, before_first_run=join)
    trainer.fit(Flaky(fail_at=-1))
    assert joins == [1] and seen == ["Connection closed by peer (check after the join)"]
    assert trainer.global_step == 8
