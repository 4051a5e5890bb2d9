"""A user's own model and data under DLRoverStrategy, as a new user would write them: not our DLRM.

Dense part with ``BatchNorm1d`` and ``Dropout``, an ``EmbeddingBagCollection`` whose tables use exact
Adagrad (not row-wise), Adam and SGD-with-momentum for the dense parameters, a per-step LR schedule, and
the user's own resumable ``StatefulDataLoader`` (torchdata). ``--manual`` switches to manual optimisation
with two dense optimizers (``zero_grad`` on both, ``manual_backward``, ``step`` on both); ``--collection``
to an ``EmbeddingCollection`` (unpooled, sequence-style lookups) whose tables use plain SGD (no optimizer state);
``--plain-loader`` to a plain ``DataLoader`` over an ``IterableDataset`` with no ``state_dict`` (the same batches).

Runs under Lightning's launcher (``--devices N``) or ``torchrun`` (devices and nodes from the worker group);
prints ``state digest: <hex>`` at the end of fit (rank 0).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from datetime import timedelta

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from lightning_dlrover import DLRoverStrategy, ParityConfig, ResourceAdvisor, elastic_trainer_args

TABLES, ROWS, DIM, DENSE = 4, 300, 8, 6


class ClickDataset(Dataset):
    """Sample ``i`` is a pure function of ``i``: dense features, one id per table (skewed), a label; with ``multi_hot``
    K > 1, tables t0 and t2 take K ids per sample (multi-hot features: hot tables for the planner)."""

    def __init__(self, multi_hot: int = 1) -> None:
        self.multi_hot = multi_hot

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        dense = torch.randn(DENSE, generator=g)
        ids = (torch.rand(TABLES, generator=g) ** 3 * ROWS).long()
        label = (dense[0] + 0.1 * ids[0].float() / ROWS > 0).float()
        if self.multi_hot > 1:
            extra = (torch.rand(2, self.multi_hot - 1, generator=g) ** 3 * ROWS).long()
            ids = [torch.cat([ids[t : t + 1], extra[t // 2]]) if t in (0, 2) else ids[t : t + 1] for t in range(TABLES)]
        return dense, ids, label


def collate(samples: list) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    dense = torch.stack([s[0] for s in samples])
    if isinstance(samples[0][1], list):  # multi-hot: per table, per sample
        per_table = [[s[1][t] for s in samples] for t in range(TABLES)]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in range(TABLES)], values=torch.cat([i for ids in per_table for i in ids]),
            lengths=torch.tensor([len(i) for ids in per_table for i in ids], dtype=torch.int32))
        return dense, kjt, torch.stack([s[2] for s in samples])
    ids = torch.stack([s[1] for s in samples])  # [batch, tables]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{t}" for t in range(TABLES)], values=ids.t().reshape(-1), lengths=torch.ones(ids.numel(), dtype=torch.int32)
    )
    return dense, kjt, torch.stack([s[2] for s in samples])


class RankSlice(torch.utils.data.Sampler):
    """This rank's contiguous slice of each global batch, in order: global batch ``b`` is the same at any world size."""

    def __init__(self, rank: int, world: int, global_batch: int) -> None:
        self.rank, self.world, self.global_batch = rank, world, global_batch

    def __len__(self) -> int:
        return 100_000 * self.global_batch // self.world

    def __iter__(self):
        local = self.global_batch // self.world
        for batch in range(100_000):
            start = batch * self.global_batch + self.rank * local
            yield from range(start, start + local)


class ClickStream(IterableDataset):
    """The same batches as ``StatefulDataLoader(ClickDataset(), sampler=RankSlice(...))``, as a plain stream that
    cannot say where it is (no ``state_dict``)."""

    def __init__(self, sampler: RankSlice, local_batch: int) -> None:
        self.sampler, self.local_batch = sampler, local_batch

    def __iter__(self):
        data, indices = ClickDataset(), iter(self.sampler)
        while True:
            yield collate([data[next(indices)] for _ in range(self.local_batch)])


def logged_init(path: str, weight: torch.Tensor) -> torch.Tensor:
    """A table's ``init_fn`` that appends this process's id to ``path`` (which processes initialised tables). A call on
    a ``meta`` tensor initialises nothing (``EmbeddingCollection``'s constructor calls it on its meta tables) and is not
    logged."""
    if not weight.is_meta:
        with open(path, "a") as log:
            log.write(f"{os.getpid()}\n")
    return torch.nn.init.uniform_(weight, -0.05, 0.05)


class UserModel(pl.LightningModule):
    def __init__(self, manual: bool = False, global_batch: int = 64, collection: bool = False,
                 plain_loader: bool = False, init_log: str | None = None, by_key: bool = False,
                 multi_hot: int = 1) -> None:
        super().__init__()
        self.plain_loader = plain_loader
        self.by_key, self.multi_hot = by_key, multi_hot
        self.pooled_embeddings_by_key = by_key  # (what a model reading them by key says)
        self.automatic_optimization = not manual
        self.global_batch = global_batch
        self.collection = collection
        init = {"init_fn": functools.partial(logged_init, init_log)} if init_log else {}
        if collection:
            self.ec = EmbeddingCollection(
                tables=[EmbeddingConfig(name=f"t{t}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{t}"],
                                        **init)
                        for t in range(TABLES)],
                device=torch.device("meta"),
            )
            apply_optimizer_in_backward(torch.optim.SGD, self.ec.parameters(), {"lr": 0.1})
        else:
            self.ebc = EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(name=f"t{t}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{t}"],
                                           **init)
                        for t in range(TABLES)],
                device=torch.device("meta"),
            )
            apply_optimizer_in_backward(torch.optim.Adagrad, self.ebc.parameters(), {"lr": 0.1})
        self.bottom = nn.Sequential(nn.Linear(DENSE, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2))
        self.top = nn.Sequential(nn.Linear(16 + TABLES * DIM, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        if self.collection:  # one id per sample and feature: the sequence of each is one row
            out = self.ec(kjt)
            sparse = torch.cat([out[f"f{t}"].values() for t in range(TABLES)], dim=1)
        else:
            pooled = self.ebc(kjt)  # by position (the plan's order), or by key with --by-key
            sparse = torch.cat([pooled[f"f{t}"] for t in range(TABLES)], dim=1) if self.by_key else pooled.values()
        return self.top(torch.cat([self.bottom(dense), sparse], dim=1)).squeeze(1)

    def training_step(self, batch, batch_idx: int):
        dense, kjt, label = batch
        loss = nn.functional.binary_cross_entropy_with_logits(self(dense, kjt), label)
        if self.automatic_optimization:
            return loss
        first, second = self.optimizers()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        self.lr_schedulers().step()
        self.log("loss", loss)  # as Lightning's manual-optimisation docs do: nothing returned

    def configure_optimizers(self):
        dense = dict(in_backward_optimizer_filter(self.named_parameters()))
        bottom = [p for n, p in dense.items() if n.startswith("bottom")]
        top = [p for n, p in dense.items() if n.startswith("top")]
        if self.automatic_optimization:
            optimizer = torch.optim.Adam([{"params": bottom}, {"params": top, "lr": 0.003}], lr=0.01)
            schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
        first = torch.optim.Adam(bottom, lr=0.01)
        second = torch.optim.SGD(top, lr=0.05, momentum=0.9)
        return [first, second], [torch.optim.lr_scheduler.StepLR(first, step_size=5, gamma=0.9)]

    def train_dataloader(self) -> StatefulDataLoader:
        sampler = RankSlice(self.trainer.global_rank, self.trainer.world_size, self.global_batch)
        if self.plain_loader:
            return DataLoader(ClickStream(sampler, self.global_batch // self.trainer.world_size), batch_size=None)
        return StatefulDataLoader(ClickDataset(self.multi_hot), batch_size=self.global_batch // self.trainer.world_size,
                                  sampler=sampler, collate_fn=collate)


class SlowWhileShort(pl.Callback):
    """Sleeps ``seconds`` per step while the job runs below the world size it was launched with, or ``until`` ranks (a
    job that lasts long enough for a grow in process to land on a loaded machine); ``always`` seconds per step after,
    until the file ``hold`` exists when one is named (the test's next move lands before the job ends)."""

    def __init__(self, seconds: float, until: int = 0, always: float = 0.0, hold: str | None = None) -> None:
        self.seconds, self.launched = seconds, until or int(os.environ.get("WORLD_SIZE", "1"))
        self.always, self.hold = always, hold

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.world_size < self.launched:
            time.sleep(self.seconds)
        elif not (self.hold and os.path.exists(self.hold)):
            time.sleep(self.always)


class ReplanAt(pl.Callback):
    """At the end of step ``step`` (every rank): asks the strategy to plan the tables anew with ``pooling_factors``, as
    ``ResourceAdvisor(apply=True)`` does with measured ones."""

    def __init__(self, step: int, pooling_factors: dict[str, float]) -> None:
        self.step, self.pooling_factors = step, pooling_factors

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            assert trainer.strategy.replan_in_process(self.pooling_factors)


class ResizeAt(pl.Callback):
    """At the end of step ``step`` (every rank): asks the strategy to shrink or grow the job to ``world_size`` ranks in
    process, as ``ResourceAdvisor(apply=True)`` does when fewer or more ranks are better; prints why it could not."""

    def __init__(self, step: int, world_size: int, slow_s: float = 0.0) -> None:
        self.step, self.world_size, self.slow_s, self.growing = step, world_size, slow_s, False

    def on_train_batch_start(self, trainer, *args) -> None:
        self.growing = self.growing and trainer.world_size < self.world_size
        if self.growing:  # (--slow-while-short: the job lasts until the new ranks joined, on a loaded machine too)
            time.sleep(self.slow_s)

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            why = trainer.strategy.resize_in_process(self.world_size)
            if why is not None:
                print(f"rank {trainer.global_rank}: no resize: {why}", flush=True)
            self.growing = why is None and self.world_size > trainer.world_size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2, help="ignored under torchrun")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--collection", action="store_true", help="EmbeddingCollection tables with SGD")
    parser.add_argument("--parity", default="1,1", help="k,r[,commit_every_n_steps[,overlap 0|1]], 'auto' or 'none'")
    parser.add_argument("--plain-loader", action="store_true", help="a DataLoader over an IterableDataset, no state_dict")
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--init-log", default=None, help="tables initialised by an init_fn that logs its pid here")
    parser.add_argument("--root", default=".")
    parser.add_argument("--by-key", action="store_true",
                        help="read the pooled embeddings by key, not by position (KeyedTensor.values(): the plan's order)")
    parser.add_argument("--multi-hot", type=int, default=1, metavar="K", help="t0 and t2 take K ids per sample")
    parser.add_argument("--advisor", action="store_true", help="a ResourceAdvisor that applies its advice")
    parser.add_argument("--replan-at", type=int, default=0, metavar="STEP",
                        help="re-plan the tables in process after STEP, with t0 and t2 (both on rank 0 at first) 20x hotter than the others")
    parser.add_argument("--advisor-ranks", type=int, default=0, metavar="N",
                        help="a ResourceAdvisor that applies its advice, searching N ranks only (cost objective)")
    parser.add_argument("--resize-at", action="append", default=[], metavar="STEP:WORLD",
                        help="ask to shrink or grow the job to WORLD ranks in process after STEP (repeatable)")
    parser.add_argument("--slow-while-short", type=float, default=0.0, metavar="S",
                        help="sleep S seconds per step while the job runs below its launch world size, or below the "
                             "size a --resize-at grow asked for")
    parser.add_argument("--slow-until-world", type=int, default=0, metavar="N",
                        help="with --slow-while-short: sleep while the job runs below N ranks (a machine that joins)")
    parser.add_argument("--slow-after", type=float, default=0.0, metavar="S",
                        help="with --slow-while-short: sleep S seconds per step once the job is no longer short")
    parser.add_argument("--slow-after-until", default=None, metavar="FILE",
                        help="with --slow-after: sleep only until FILE exists")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--async-ckpt", nargs="?", const=True, default=False, choices=[True, "precopy"],
                        help="DLRoverStrategy(async_checkpoint=True), or ='precopy'")
    parser.add_argument("--incremental", type=int, default=None, metavar="N",
                        help="DLRoverStrategy(incremental_checkpoint_every=N)")
    parser.add_argument("--save-after", action="append", default=[], metavar="PATH",
                        help="Trainer.save_checkpoint(PATH) after fit (repeatable)")
    args = parser.parse_args()
    pl.seed_everything(11)
    parity = None if args.parity == "none" else "auto" if args.parity == "auto" else ParityConfig.parse(args.parity)
    callbacks = []
    if args.slow_while_short:
        callbacks.append(SlowWhileShort(args.slow_while_short, args.slow_until_world, args.slow_after, args.slow_after_until))
    if args.advisor or args.advisor_ranks:  # the advisor applies what it finds
        # --advisor-ranks: the cost objective over that many ranks only (one cheaper candidate: fewer ranks, whatever
        # the timings), as a job on a machine with fewer free cores than ranks would be advised
        cheaper = dict(objective="cost", target_samples_per_sec=1.0, cost_per_core_hour=1.0, extrapolate=True,
                       search={"ranks_per_node": [args.advisor_ranks], "threads_per_rank": [1]})
        callbacks.append(ResourceAdvisor(profile_steps=6, probe_steps=3, settle_steps=1, apply=True, history=None,
                                         report_dir=os.path.join(args.root, "advisor"),
                                         **(cheaper if args.advisor_ranks else {})))
    callbacks += [ResizeAt(*map(int, at.split(":")), args.slow_while_short) for at in args.resize_at]
    if args.replan_at:
        callbacks.append(ReplanAt(args.replan_at, {"t0": 20.0, "t2": 20.0}))
    if args.ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(args.root, "checkpoints"),
                                         every_n_train_steps=args.ckpt_every, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        **(elastic_trainer_args() or {"devices": args.devices}),
        strategy=DLRoverStrategy(sharding_types=["table_wise"], parity=parity, timeout=timedelta(seconds=20),
                                 async_checkpoint=args.async_ckpt, incremental_checkpoint_every=args.incremental),
        max_steps=args.steps,
        default_root_dir=args.root,
        use_distributed_sampler=False,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(args.ckpt_every),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = UserModel(manual=args.manual, collection=args.collection, plain_loader=args.plain_loader,
                      init_log=args.init_log, by_key=args.by_key, multi_hot=args.multi_hot)
    trainer.fit(model, ckpt_path=args.resume)
    for path in args.save_after:
        trainer.save_checkpoint(path)


if __name__ == "__main__":
    main()
