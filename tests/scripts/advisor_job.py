"""A DLRM job under DLRoverStrategy for the resource advisor's tests and benchmark (Lightning's launcher re-runs
this script on every rank, so it stays a plain script).

Its loader makes batches in the training process or in ``--workers`` worker processes and can change the
per-rank batch and the workers between steps (:class:`LoaderKnobs` implements the advisor's
``DataWorkersControl`` and ``BatchSizeControl``). Options add a grid sweep over threads/workers/batch, a slowed
rank, a memory leak, a skewed (multi-hot) data stream and the ``ResourceAdvisor``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from lightning_dlrover import DLRoverStrategy, ResourceAdvisor, TableConstraint, ThroughputMonitor
from lightning_dlrover.data.sources import NUM_SPARSE, SPARSE_NAMES, SyntheticCriteo, make_batch
from lightning_dlrover.models import DLRMModule
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class _Batches(IterableDataset):
    """Global batches ``start + i * step`` of ``source`` (for worker ``i`` of ``step``), sliced for ``rank``."""

    def __init__(self, source, global_batch: int, start: int, rank: int, world: int, hot: list[int]) -> None:
        self.source, self.global_batch, self.start, self.rank, self.world = source, global_batch, start, rank, world
        self.hot = hot

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first, step = (self.start, 1) if info is None else (self.start + info.id, info.num_workers)
        batch = self.global_batch
        per = batch // self.world
        for index in range(first, len(self.source) // batch, step):
            begin = index * batch + self.rank * per
            yield self.source.rows(begin, begin + per)


def multi_hot_batch(dense, ids, labels, hot: list[int]) -> Batch:
    """Features in ``hot`` get ``hot[i]`` ids per sample (neighbours of the drawn id), the others one."""
    batch = ids.shape[0]
    values, lengths = [], []
    for f in range(NUM_SPARSE):
        k = hot[f]
        vals = (ids[:, f : f + 1] + torch.arange(k)) % 1000 if k > 1 else ids[:, f : f + 1]
        values.append(vals.reshape(-1))
        lengths.append(torch.full((batch,), k, dtype=torch.int32))
    kjt = KeyedJaggedTensor(keys=SPARSE_NAMES, values=torch.cat(values), lengths=torch.cat(lengths))
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


class KnobLoader:
    """One rank's batches; the per-rank batch and the worker processes can change between two batches."""

    def __init__(self, sizes: list[int], rank: int, world: int, batch: int, workers: int, seed: int,
                 hot: list[int]) -> None:
        self.sizes, self.rank, self.world, self.seed, self.hot = sizes, rank, world, seed, hot
        self.batch, self.workers = batch, workers
        self.slow: tuple[int, int, float] | None = None  # (rank, from batch, seconds): slow storage on one rank

    def __len__(self) -> int:
        return 10**6

    def __iter__(self):
        index = 0
        while True:
            batch, workers = self.batch, self.workers
            source = SyntheticCriteo(self.sizes, batch * self.world * 10**6, seed=self.seed)
            data = _Batches(source, batch * self.world, index, self.rank, self.world, self.hot)
            stream = DataLoader(data, batch_size=None, num_workers=workers, prefetch_factor=2 if workers else None,
                                multiprocessing_context="fork" if workers else None)
            for dense, ids, labels in stream:
                index += 1
                if self.slow is not None and self.rank == self.slow[0] and index > self.slow[1]:
                    time.sleep(self.slow[2])
                yield multi_hot_batch(dense, ids, labels, self.hot) if max(self.hot) > 1 else make_batch(dense, ids, labels)
                if (self.batch, self.workers) != (batch, workers):
                    break


class LoaderKnobs(pl.Callback):
    """Implements ``DataWorkersControl`` and ``BatchSizeControl`` over a :class:`KnobLoader`."""

    def __init__(self, loader: KnobLoader) -> None:
        self.loader = loader

    def get_data_workers(self) -> int:
        return self.loader.workers

    def set_data_workers(self, workers: int) -> None:
        self.loader.workers = workers

    def get_batch_per_rank(self) -> int:
        return self.loader.batch

    def set_batch_per_rank(self, batch: int) -> None:
        self.loader.batch = batch


class KnobData(pl.LightningDataModule):
    def __init__(self, sizes, batch, workers, seed, hot) -> None:
        super().__init__()
        self.args = (sizes, batch, workers, seed, hot)
        self.loader: KnobLoader | None = None

    def train_dataloader(self) -> KnobLoader:
        sizes, batch, workers, seed, hot = self.args
        if self.loader is None:
            self.loader = KnobLoader(sizes, self.trainer.global_rank, self.trainer.world_size, batch, workers, seed, hot)
        return self.loader


class GridSweep(pl.Callback):
    """Runs segments of ``settle + measure`` steps at each ``(threads, workers, batch)``; rank 0 appends one JSON
    line per segment (mean and median step seconds and data wait, peak RSS over ranks, and the cores other programs
    left to the job, as the advisor measures them) to ``out``."""

    def __init__(self, segments, knobs: LoaderKnobs, monitor: ThroughputMonitor, settle: int, measure: int, out: str,
                 ranks_per_node: int) -> None:
        self.segments, self.knobs, self.monitor = segments, knobs, monitor
        self.settle, self.measure, self.out, self.g = settle, measure, out, ranks_per_node
        self.i, self.n, self.acc = 0, 0, []

    def _set(self, segment) -> None:
        threads, workers, batch = segment
        torch.set_num_threads(threads)
        self.knobs.set_data_workers(workers)
        self.knobs.set_batch_per_rank(batch)

    def on_train_start(self, trainer, pl_module) -> None:
        self._set(self.segments[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from lightning_dlrover.advisor.runtime import cpu_snapshot

        self.n += 1
        record = self.monitor.last_step
        if self.n == self.settle:
            self.cpu = cpu_snapshot(trainer.local_rank == 0)
        if self.n > self.settle and record is not None:
            self.acc.append([record.seconds, record.sections.get("data_wait", 0.0), record.rss_bytes])
        if self.n < self.settle + self.measure:
            return
        cpu = [b - a for a, b in zip(self.cpu, cpu_snapshot(trainer.local_rank == 0))]  # job s, busy s, wall s
        acc = torch.tensor(self.acc, dtype=torch.float64)
        mean, median = acc.mean(0), acc.median(0).values
        values = torch.cat([torch.stack([mean[0], mean[1], acc[:, 2].max(), median[0], median[1]]),
                            torch.tensor(cpu, dtype=torch.float64)])
        if trainer.world_size > 1:
            gathered = [torch.zeros_like(values) for _ in range(trainer.world_size)]
            dist.all_gather(gathered, values)
            values = torch.stack(gathered)
        else:
            values = values[None]
        if trainer.is_global_zero:
            from lightning_dlrover.machine import available_cores
            from lightning_dlrover.advisor.runtime import background_cores

            threads, workers, batch = self.segments[self.i]
            cores = available_cores()
            background = background_cores(values[:, 5:].tolist(), self.g, cores)
            row = {"nodes": trainer.world_size // self.g, "ranks_per_node": self.g, "threads_per_rank": threads,
                   "data_workers": workers, "batch_per_rank": batch, "step_s": float(values[:, 0].max()),
                   "data_wait_s": float(values[:, 1].mean()), "rss_bytes": float(values[:, 2].max()),
                   "step_s_median": float(values[:, 3].max()), "data_wait_s_median": float(values[:, 4].mean()),
                   "cores_available": cores - background, "time": time.time()}
            with open(self.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"grid {row}", flush=True)
        self.i, self.n, self.acc = self.i + 1, 0, []
        if self.i == len(self.segments):
            trainer.should_stop = True
        else:
            self._set(self.segments[self.i])


class SampleBudget(pl.Callback):
    """Stops the fit once the job has trained ``samples`` samples (all ranks; the per-rank batch may change on the
    way); rank 0 prints ``JOB_SAMPLES n seconds s`` (samples trained, seconds since the first step) at the end."""

    def __init__(self, samples: int, monitor: ThroughputMonitor) -> None:
        self.samples, self.monitor, self.done, self.start = samples, monitor, 0, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.start = self.start or time.time()
        record = self.monitor.last_step
        self.done += (record.samples if record is not None else 0) * trainer.world_size
        if self.done >= self.samples:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            print(f"JOB_SAMPLES {self.done} seconds {time.time() - (self.start or time.time()):.3f}", flush=True)


class SlowRank(pl.Callback):
    """From step ``start`` on, rank ``rank`` burns ``ms`` of CPU in every forward (a slower machine), with ``sleep``
    its loader sleeps that long before each batch (slow storage), or with ``idle`` it sleeps that long inside the
    step, between its forward and its backward (I/O or a lock inside the step)."""

    def __init__(self, rank: int, start: int, ms: float, sleep: bool, idle: bool = False) -> None:
        self.rank, self.start, self.seconds, self.sleep, self.idle = rank, start, ms / 1000, sleep, idle

    def _slow(self, trainer) -> bool:
        return trainer.global_rank == self.rank and trainer.global_step >= self.start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._slow(trainer) and not getattr(self, "announced", False):
            self.announced = True
            print(f"SLOW_START step={trainer.global_step} time={time.time()}", flush=True)
        if self._slow(trainer) and not self.sleep and not self.idle:
            end = time.thread_time() + self.seconds
            a = torch.randn(64, 64)
            while time.thread_time() < end:
                a = (a @ a).tanh_()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._slow(trainer) and self.idle:
            time.sleep(self.seconds)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.sleep:
            trainer.train_dataloader.slow = (self.rank, self.start, self.seconds)


class Leak(pl.Callback):
    """From step ``start`` on, every rank keeps ``mb`` MiB more per step (a growing cache). The node's memory limit
    is its training memory at step ``start`` plus ``headroom`` bytes (also given to the advisor's forecast, so that
    the test need not fill the machine); rank 0 prints the step at which the node first reaches it and stops the
    job a few steps later."""

    def __init__(self, mb: float, start: int, headroom: float | None, advisor: ResourceAdvisor | None) -> None:
        self.bytes, self.start, self.headroom, self.advisor = int(mb * 2**20), start, headroom, advisor
        self.kept, self.crossed, self.limit = [], None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.start:
            self.kept.append(torch.ones(self.bytes // 4, dtype=torch.float32))
        if self.headroom is None:
            return
        from lightning_dlrover.advisor.runtime import children_memory, node_total_bytes
        from lightning_dlrover.monitor.steps import rss_bytes

        mine = (os.getpid(), float(rss_bytes()), children_memory())
        trees = [mine]
        if trainer.world_size > 1:  # rank 1 is a child of rank 0 under Lightning's launcher: count each process once
            trees = [None] * trainer.world_size
            dist.all_gather_object(trees, mine)
        total = torch.tensor([node_total_bytes(trees)], dtype=torch.float64)
        if self.limit is None and trainer.global_step >= self.start:
            self.limit = total.item() + self.headroom
            if trainer.is_global_zero:
                print(f"LEAK_LIMIT bytes={self.limit} step={trainer.global_step}", flush=True)
            if self.advisor is not None:
                self.advisor.oom.limit = self.limit
        if self.limit is None:
            return
        if self.crossed is None and total.item() >= self.limit:
            self.crossed = trainer.global_step
            if trainer.is_global_zero:
                print(f"LEAK_CROSSED_LIMIT step={self.crossed} time={time.time()}", flush=True)
        if self.crossed is not None and trainer.global_step >= self.crossed + 2:
            trainer.should_stop = True


def record_windows(path: str) -> None:
    """Appends the windows of every ``StragglerDetector.update`` call (rank 0) to ``path``, one JSON line per call:
    the bench's recorded inputs, replayed by the detector's tests."""
    import dataclasses

    from lightning_dlrover.advisor.detectors import StragglerDetector

    update = StragglerDetector.update

    def recorded(self, windows):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps([dataclasses.asdict(w) for w in windows]) + "\n")
        return update(self, windows)

    StragglerDetector.update = recorded


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hot", default="", help="feature:ids_per_sample,... (multi-hot features)")
    p.add_argument("--pooling-factors", default="", help="table:pf,... given to the planner")
    p.add_argument("--sweep", default="", help="threads/workers/batch segments: 1:0:128,2:0:128,...")
    p.add_argument("--settle", type=int, default=3)
    p.add_argument("--measure", type=int, default=6)
    p.add_argument("--out", default="grid.jsonl")
    p.add_argument("--root", default="runs/advisor_job")
    p.add_argument("--advisor", action="store_true")
    p.add_argument("--history", default=None)
    p.add_argument("--apply", action="store_true")
    p.add_argument("--profile-steps", type=int, default=30)
    p.add_argument("--probe-steps", type=int, default=6)
    p.add_argument("--check-every", type=int, default=10)
    p.add_argument("--straggler-patience", type=int, default=None)
    p.add_argument("--search", default="", help="JSON SearchSpace fields")
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument("--slow-from", type=int, default=20)
    p.add_argument("--slow-ms", type=float, default=30.0)
    p.add_argument("--slow-sleep", action="store_true")
    p.add_argument("--slow-idle", action="store_true", help="the slow rank sleeps inside its step")
    p.add_argument("--objective", default="throughput")
    p.add_argument("--target", type=float, default=None, help="samples/s of the cost objective")
    p.add_argument("--cost-per-node", type=float, default=1.0)
    p.add_argument("--cost-per-core", type=float, default=0.0)
    p.add_argument("--extrapolate", action="store_true")
    p.add_argument("--ckpt_path", default=None, help="resume from this checkpoint")
    p.add_argument("--samples", type=int, default=0, help="stop after this many samples (all ranks)")
    p.add_argument("--restart", default="print", help="ResourceAdvisor(restart=...)")
    p.add_argument("--async-ckpt", action="store_true", help="DLRoverStrategy(async_checkpoint=True)")
    p.add_argument("--leak-mb", type=float, default=0.0)
    p.add_argument("--leak-from", type=int, default=5)
    p.add_argument("--headroom-mb", type=float, default=None, help="node memory limit: memory at --leak-from + this")
    p.add_argument("--inject", nargs="*", default=[], help="failures to inject (tests/scripts/inject.py)")
    p.add_argument("--record-windows", default=None, help="append every window the straggler detector judges (JSONL)")
    args = p.parse_args()
    if args.record_windows:
        record_windows(args.record_windows)
    if args.inject:
        from tests.scripts.inject import inject

        inject(args.inject)

    pl.seed_everything(args.seed)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # Lightning would set cores // ranks on every rank
    torch.set_num_threads(args.threads)
    sizes = [args.rows] * NUM_SPARSE
    hot = [1] * NUM_SPARSE
    for item in filter(None, args.hot.split(",")):
        feature, k = item.split(":")
        hot[int(feature)] = int(k)
    constraints = {}
    for item in filter(None, args.pooling_factors.split(",")):
        table, pf = item.split(":")
        constraints[table] = TableConstraint(pooling_factors=[float(pf)])
    monitor = ThroughputMonitor(log_every_n_steps=10 ** 6, warmup_steps=2, summary=False)
    data = KnobData(sizes, args.batch, args.workers, args.seed, hot)
    model = DLRMModule(sizes, embedding_dim=args.dim, dense_arch_layer_sizes=[64, args.dim])
    callbacks: list[pl.Callback] = [monitor]

    class Knobs(LoaderKnobs):
        def __init__(self) -> None:
            pass

        @property
        def loader(self):
            return data.train_dataloader()

    knobs = Knobs()
    callbacks.append(knobs)
    if args.slow_rank is not None:
        callbacks.append(SlowRank(args.slow_rank, args.slow_from, args.slow_ms, args.slow_sleep, args.slow_idle))
    advisor = None
    if args.advisor:
        patience = {"straggler_patience": args.straggler_patience} if args.straggler_patience else {}
        advisor = ResourceAdvisor(
            profile_steps=args.profile_steps, probe_steps=args.probe_steps, apply=args.apply, history=args.history,
            check_every_n_steps=args.check_every, **patience, search=json.loads(args.search) if args.search else None,
            restart=args.restart, objective=args.objective, target_samples_per_sec=args.target,
            cost_per_node_hour=args.cost_per_node, cost_per_core_hour=args.cost_per_core, extrapolate=args.extrapolate)
        callbacks.append(advisor)
    if args.samples:
        callbacks.append(SampleBudget(args.samples, monitor))
    if args.leak_mb:
        headroom = args.headroom_mb * 2**20 if args.headroom_mb else None
        callbacks.append(Leak(args.leak_mb, args.leak_from, headroom, advisor))
    if args.sweep:
        segments = [tuple(map(int, s.split(":"))) for s in args.sweep.split(",")]
        callbacks.append(GridSweep(segments, knobs, monitor, args.settle, args.measure, args.out, args.devices))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=DLRoverStrategy(sharding_types=["table_wise"],
                                                                          constraints=constraints or None,
                                                                          print_digest=False,
                                                                          async_checkpoint=args.async_ckpt),
        max_steps=args.steps if not (args.sweep or args.samples) else 10**6, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        default_root_dir=args.root,
    )
    trainer.fit(model, data, ckpt_path=args.ckpt_path)
    if trainer.is_global_zero:
        print(f"FINAL_STEP {trainer.global_step} world_size {trainer.world_size}", flush=True)


if __name__ == "__main__":
    main()
