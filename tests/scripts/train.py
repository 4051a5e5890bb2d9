"""A seeded DLRM run under DLRoverStrategy, launched by the tests as a real multi-process job.

Prints ``state digest: <hex>`` at the end of fit (rank 0). Lightning's launcher re-runs this script
for every rank, so it must stay importable as a plain script.
"""

import argparse
from datetime import timedelta

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dlrover import DLRoverStrategy, ParityConfig, StateDigest, TableConstraint, ThroughputMonitor
from lightning_dlrover.monitor import training_state_digest
from lightning_dlrover.data import DLRMDataModule
from lightning_dlrover.models import DLRMModule

SIZES = [300 + 37 * i for i in range(26)]


class LossDrill(pl.Callback):
    """Simulates losing ``ranks`` in place: wipes their coded state and parity, recovers them, and prints
    whether the state digest is that of the last committed step.

    With ``phase="after_batch"`` the loss happens once step ``step`` is committed; with a strategy fault
    phase (``before_forward``, ``after_optimizer``, ``during_parity_commit``) it happens inside the next
    step, which recovery must roll back. ``more`` adds drills ``(step, loss_step, phase)`` to the same run, each
    checked against the state committed at its own ``step``.
    """

    def __init__(self, step: int, ranks: list[list[int]], phase: str = "after_batch", loss_step: int | None = None,
                 more: list[tuple[int, int, str]] = ()) -> None:
        self.drills = [(step, step if loss_step is None else loss_step, phase), *more]  # a later loss step: inside a commit window
        self.ranks = ranks
        self.committed: dict[int, str] = {}  # drill index -> digest of the state committed at its step

    def setup(self, trainer, pl_module, stage) -> None:
        trainer.strategy.fault_points.append(lambda phase, step: self._point(trainer, phase, step))

    def _point(self, trainer, phase: str, step: int) -> None:
        for index, (commit, loss, drill_phase) in enumerate(self.drills):
            if phase == "after_commit" and step == commit:
                self.committed[index] = training_state_digest(trainer)
                if drill_phase == "after_batch":
                    self._drill(trainer, "after_batch", index)
            elif phase == drill_phase and step == loss and index in self.committed:
                self._drill(trainer, phase, index)

    def _drill(self, trainer, phase: str, index: int) -> None:
        strategy = trainer.strategy
        for lost in self.ranks:
            if trainer.global_rank in lost:
                for segment in strategy.fault.coded.state.segments:
                    segment.tensor.zero_()
                strategy.fault.coded.parity.zero_()
            strategy.recover(lost)
            after = training_state_digest(trainer)
            if trainer.is_global_zero:
                verdict = "matches" if after == self.committed[index] else "DIFFERS"
                print(f"drill {phase} lost={lost}: recovered state {verdict}", flush=True)


class PrintStaging(pl.Callback):
    """Prints ``checkpoint staging bytes: N`` (rank 0's memory for its next save, not allocated yet) after the first
    step (the dense optimizers' state exists from then on)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero and trainer.global_step == 1:
            print(f"checkpoint staging bytes: {trainer.strategy.checkpoint_staging_bytes()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sharding-types", nargs="+", default=["table_wise"])
    parser.add_argument("--min-partition", type=int, default=None)
    parser.add_argument("--backend", default="dcp")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--async-ckpt", nargs="?", const=True, default=False, choices=[True, "precopy"],
                        help="DLRoverStrategy(async_checkpoint=True), or ='precopy'")
    parser.add_argument("--incremental", type=int, default=None, metavar="N",
                        help="DLRoverStrategy(incremental_checkpoint_every=N)")
    parser.add_argument("--save-top-k", type=int, default=-1, help="ModelCheckpoint(save_top_k=...)")
    parser.add_argument("--save-last", action="store_true", help="ModelCheckpoint(save_last=True)")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save-after", default=None, metavar="PATH", help="trainer.save_checkpoint(PATH) after fit")
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--monitor", action="store_true")
    parser.add_argument("--parity", default=None, help="k,r[,commit_every_n_steps[,overlap 0|1]]")
    parser.add_argument("--drill-at", type=int, default=None)
    parser.add_argument("--drill", default="", help="rank sets lost one after another, e.g. 0 1 2 or 0,1 1,2")
    parser.add_argument("--drill-phase", default="after_batch")
    parser.add_argument("--drill-loss-at", type=int, default=None, help="index of the step the loss happens in")
    parser.add_argument("--drill-more", action="append", default=[], metavar="STEP,LOSS_STEP,PHASE",
                        help="another drill in the same run (repeatable)")
    parser.add_argument("--pg-timeout", type=float, default=None, help="process-group timeout in seconds")
    parser.add_argument("--no-step-digests", action="store_true", help="print only the final digest")
    parser.add_argument("--digest-every", type=int, default=None, help="also print the digest every N steps")
    args = parser.parse_args()

    pl.seed_everything(args.seed)
    constraints = (
        {f"t_cat_{i}": TableConstraint(min_partition=args.min_partition) for i in range(26)}
        if args.min_partition
        else None
    )
    strategy = DLRoverStrategy(
        sharding_types=args.sharding_types,
        constraints=constraints,
        checkpoint_backend=args.backend,
        async_checkpoint=args.async_ckpt,
        incremental_checkpoint_every=args.incremental,
        parity=ParityConfig.parse(args.parity) if args.parity else None,
        **({"timeout": timedelta(seconds=args.pg_timeout)} if args.pg_timeout else {}),
    )
    callbacks = [] if args.no_step_digests else [StateDigest(at_start=True, every_n_steps=args.digest_every)]
    if args.drill_at is not None:
        lost = [list(map(int, s.split(","))) for s in args.drill.split()]
        more = [(int(a), int(b), phase) for a, b, phase in (m.split(",") for m in args.drill_more)]
        callbacks.append(LossDrill(args.drill_at, lost, args.drill_phase, args.drill_loss_at, more))
    if args.async_ckpt:
        callbacks.append(PrintStaging())
    if args.monitor:
        callbacks.append(ThroughputMonitor(log_every_n_steps=5, warmup_steps=2))
    if args.ckpt_every:
        callbacks.append(
            ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every, save_top_k=args.save_top_k,
                            save_last=args.save_last)
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(args.ckpt_every),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DLRMModule(SIZES, embedding_dim=16)
    data = DLRMDataModule(SIZES, global_batch_size=args.batch, train_batches=1000, val_batches=0, seed=args.seed)
    trainer.fit(model, data, ckpt_path=args.resume)
    if args.save_after:
        trainer.save_checkpoint(args.save_after)


if __name__ == "__main__":
    main()
