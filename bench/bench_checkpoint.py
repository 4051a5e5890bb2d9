"""Checkpoint save and restore time and size of DLRoverStrategy, per backend and embedding size.

A real multi-process job (``--devices`` ranks, gloo, started by Lightning's popen launcher, which
re-runs this script for every rank). For each total embedding size (fp32 weights of 26 equal tables,
``--sizes-mb``) it trains a ``DLRMModule`` for ``--train-steps`` steps, so that the fused optimizer
state exists, and then, for each backend (``dcp``, ``torchsnapshot``), measures:

- save: ``trainer.save_checkpoint(path)``, the strategy's whole path (sharded state through the
  backend, ``meta.pt``, commit by rename), into a fresh directory every time;
- blocked (methods ``<backend>+async``: ``DLRoverStrategy(async_checkpoint=True)``): the time
  ``trainer.save_checkpoint`` holds training (the state copied into staging memory), beside the save time
  until the background write is committed; for the blocking methods blocked = save; ``<backend>+precopy``
  (``async_checkpoint="precopy"``): training steps run until the save commits, and blocked is the save call plus
  the time those steps spent copying rows before writing them (the slowest rank's);
- copy floor: a plain ``copy_`` of each rank's local state into memory copied into before (as a save reuses its
  staging memory), the least a staging copy takes; fresh: the same into new memory (page faults included);
- restore: ``trainer.strategy.load_checkpoint(path)`` on every rank (a collective);
- disk: the bytes the checkpoint directory occupies (``du``);
- reference (``torch.save``): every rank ``torch.save``-s its local shards (and rank 0 the replicated
  dense state) to its own file, and restores them with ``torch.load`` and an in-place copy.

Every operation is timed on rank 0 between two barriers. The methods run in a rotating order, once
per repeat (``--repeats``), so that a noisy machine hits them alike; the median is reported. GB/s
is the state (model and fused optimizer state, summed over ranks, replicated tensors once) per
second. Both backends checkpoint the same trained model: the strategy's ``checkpoint_backend`` is
switched between them. Checkpoints go to a temporary directory under ``--tmp``, removed at the end;
``dcp`` fsyncs its files, the others leave them in the page cache, and every restore reads from the
page cache. The last line recommends the backend with the least save + restore time summed over
the sizes (within 10%, the one that can also restore onto more ranks).

    PYTHONPATH=. python bench/bench_checkpoint.py                    # 64, 256, 1024 MiB, under a minute
    PYTHONPATH=. python bench/bench_checkpoint.py --quick            # 8 MiB, seconds
    PYTHONPATH=. python bench/bench_checkpoint.py --sizes-mb 512 --backends dcp
    PYTHONPATH=. python bench/bench_checkpoint.py --sizes-mb 256 1024 1904 --backends dcp --async-only

With ``--chain N`` it also measures incremental saves (``DLRoverStrategy(incremental_checkpoint_every=N)``) on the
same trained model, blocking and asynchronous: one chain of a full save and ``N - 1`` deltas, each delta after
``--delta-steps K`` training steps (real forward and backward passes: the fused optimizer updates the rows the batches
look up, which the strategy's hooks mark), for each ``K`` given; per chain: the full save's blocked and save time and
bytes, the deltas' (median) blocked and save time, bytes written and rows touched per delta (summed over ranks),
bytes per row touched, and the restore time of the whole chain (full + ``N - 1`` deltas).

    PYTHONPATH=. python bench/bench_checkpoint.py --sizes-mb 256 1024 1904 --backends dcp --async-only \
        --chain 4 --delta-steps 1 8 64

With ``--e2e-steps N`` it also trains a fresh model of each size for ``N`` steps with a ``ModelCheckpoint`` every
``--e2e-every`` steps, once with blocking and once with asynchronous saves, and prints the wall time of ``fit`` and
the CPU seconds of all ranks' processes (user + system, every thread) during it.
"""

from __future__ import annotations

import argparse
import gc
import logging
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from lightning_dlrover import DLRoverStrategy
from lightning_dlrover.checkpoint import BACKENDS, flatten, get_backend
from lightning_dlrover.data import DLRMDataModule
from lightning_dlrover.data.sources import NUM_SPARSE
from lightning_dlrover.models import DLRMModule

MiB = 1 << 20
GB = 1e9
TORCH_SAVE = "torch.save"
#: Relative difference in total time below which the backends count as equally fast.
NOISE = 0.10


@dataclass
class Sample:
    """One save and restore of one method."""

    save_s: float
    restore_s: float
    disk_bytes: int
    blocked_s: float = 0.0
    steps: int = 0


@dataclass
class Row:
    """Median measurements of one method (a backend or the ``torch.save`` reference) at one embedding size."""

    size_mb: int
    method: str
    state_bytes: int
    save_s: float
    restore_s: float
    disk_bytes: int
    blocked_s: float
    steps: float = 0.0
    floor_s: float = 0.0
    fresh_s: float = 0.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 256, 1024],
                        help="total fp32 embedding weights in MiB, one model per size (default: 64 256 1024)")
    parser.add_argument("--backends", nargs="+", default=sorted(BACKENDS), choices=sorted(BACKENDS),
                        help="checkpoint backends to compare (default: all)")
    parser.add_argument("--embedding-dim", type=int, default=64, help="columns of every table (default: 64)")
    parser.add_argument("--devices", type=int, default=2, help="ranks (default: 2)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per operation; median reported")
    parser.add_argument("--train-steps", type=int, default=2, help="training steps before checkpointing")
    parser.add_argument("--batch", type=int, default=256, help="global batch size of those steps")
    parser.add_argument("--tmp", default="/tmp", help="parent of the temporary checkpoint directory")
    parser.add_argument("--quick", action="store_true", help="one tiny size (8 MiB): a smoke test")
    parser.add_argument("--async-only", action="store_true",
                        help="measure only the backends with asynchronous saves (and torch.save), not blocking ones")
    parser.add_argument("--no-async", action="store_true", help="measure only blocking saves")
    parser.add_argument("--chain", type=int, default=0, help="also measure incremental chains of N links (0: no)")
    parser.add_argument("--delta-steps", type=int, nargs="+", default=[1, 8],
                        help="training steps between the links of a chain, one chain each (default: 1 8)")
    parser.add_argument("--e2e-steps", type=int, default=0, help="also time a fit of N steps, sync vs async")
    parser.add_argument("--e2e-every", type=int, default=10, help="steps between its checkpoints (default: 10)")
    args = parser.parse_args()
    if args.quick:
        args.sizes_mb = [8]
    return args


def quiet() -> None:
    """Silences Lightning's and TorchRec's per-run info logs and warnings, which drown the table."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torchrec", "torch.distributed", "torch.fx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def rows_per_table(size_mb: int, embedding_dim: int) -> int:
    """Rows of each of the 26 tables so that their fp32 weights total ``size_mb``."""
    return max(1, round(size_mb * MiB / (NUM_SPARSE * embedding_dim * 4)))


def train(args: argparse.Namespace, size_mb: int) -> pl.Trainer:
    """A trainer whose model (26 tables, ``size_mb`` in all) has been trained for a few steps."""
    sizes = [rows_per_table(size_mb, args.embedding_dim)] * NUM_SPARSE
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=DLRoverStrategy(checkpoint_backend=args.backends[0], print_digest=False),
        max_steps=args.train_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DLRMModule(sizes, embedding_dim=args.embedding_dim)
    data = DLRMDataModule(sizes, global_batch_size=args.batch, train_batches=args.train_steps + 100_000, val_batches=0)
    trainer.fit(model, data)
    return trainer


def local_tensors(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """This rank's part of the training state: its local shards, and the replicated tensors on rank 0."""
    tensors = {}
    for path, leaf in flatten(trainer.strategy.training_state()):
        if isinstance(leaf, ShardedTensor):
            tensors.update({f"{path}/{i}": shard.tensor for i, shard in enumerate(leaf.local_shards())})
        elif isinstance(leaf, torch.Tensor) and trainer.is_global_zero:
            tensors[path] = leaf
    return tensors


def state_bytes(trainer: pl.Trainer) -> int:
    """Bytes of the training state summed over ranks, replicated tensors counted once (collective)."""
    local = sum(t.numel() * t.element_size() for t in local_tensors(trainer).values())
    total = torch.tensor([local], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total.item())


def timed(trainer: pl.Trainer, fn: Callable[[], object]) -> float:
    """Seconds of ``fn`` run on every rank, between barriers (the slowest rank's time)."""
    trainer.strategy.barrier()
    start = time.perf_counter()
    fn()
    trainer.strategy.barrier()
    return time.perf_counter() - start


def disk_bytes(path: Path) -> int:
    """Bytes allocated on disk under the directory ``path`` (``du``)."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def remove(trainer: pl.Trainer, path: Path) -> None:
    """Deletes ``path`` on rank 0 while the other ranks wait."""
    trainer.strategy.barrier()
    if trainer.is_global_zero:
        shutil.rmtree(path, ignore_errors=True)
    trainer.strategy.barrier()


#: The pre-copy hooks of ``+precopy`` saves, kept aside while other methods are measured (they would copy too).
_PRECOPY: dict[int, object] = {}


def measure_backend(trainer: pl.Trainer, backend: str, path: Path, batches=None) -> Sample:
    """One save through the strategy with ``backend`` (``<name>+async``: an asynchronous save; ``<name>+precopy``: a
    pre-copied one, with training steps run until it commits) into ``path``, then one restore from it."""
    strategy = trainer.strategy
    assert isinstance(strategy, DLRoverStrategy)
    name, _, mode = backend.partition("+")
    strategy.checkpoint_backend = get_backend(name)
    checkpointing = strategy.checkpointing
    checkpointing.asynchronous = mode in ("async", "precopy")
    checkpointing.precopy = _PRECOPY.pop(0, True) if mode == "precopy" else None
    strategy.barrier()
    start = time.perf_counter()
    trainer.save_checkpoint(path)
    strategy.barrier()
    blocked_s = time.perf_counter() - start
    steps = 0
    if mode == "precopy":  # steps run (every rank alike) while the copy and the write go on: their hooks copy rows
        while agree_alive(checkpointing):
            train_steps(trainer, batches, 1)
            steps += 1
        _PRECOPY[0] = checkpointing.precopy
        hook = torch.tensor([checkpointing.precopy.hook_s], dtype=torch.float64)
        dist.all_reduce(hook, op=dist.ReduceOp.MAX)
        progress(trainer, f"  precopy: save call {blocked_s:.3f} s, the steps' copy-before-write {hook.item():.3f} s "
                          f"over {steps} steps")
        blocked_s += float(hook.item())
    checkpointing.wait()
    strategy.barrier()
    save_s = time.perf_counter() - start
    checkpointing.asynchronous, checkpointing.precopy = False, None
    restore_s = timed(trainer, lambda: strategy.load_checkpoint(path))
    return Sample(save_s, restore_s, disk_bytes(path) if trainer.is_global_zero else 0, blocked_s, steps)


def agree_alive(checkpointing) -> bool:
    """Whether any rank's background save is still running (a collective)."""
    thread = checkpointing._thread
    flag = torch.tensor([int(thread is not None and thread.is_alive())], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def copy_floor(trainer: pl.Trainer) -> tuple[float, float]:
    """Seconds of a plain copy of this rank's local state (``copy_``, the least the staging copy of a full save can
    take) into memory copied into once before (as a save reuses its staging memory), and into fresh memory
    (``torch.empty_like``: page faults included, as the first save); the slowest rank's, median of 3 each."""
    tensors = list(local_tensors(trainer).values())
    warm = [t.clone() for t in tensors]
    reused = statistics.median([timed(trainer, lambda: [w.copy_(t) for w, t in zip(warm, tensors)])
                                for _ in range(3)])
    warm.clear()
    fresh = []
    for _ in range(3):
        fresh.append(timed(trainer, lambda: [torch.empty_like(t).copy_(t) for t in tensors]))
        gc.collect()
    return reused, statistics.median(fresh)


def measure_torch_save(trainer: pl.Trainer, path: Path) -> Sample:
    """Every rank ``torch.save``-s its local tensors to its own file in ``path``, then loads them back in place."""
    tensors = local_tensors(trainer)
    file = path / f"rank{trainer.global_rank}.pt"
    if trainer.is_global_zero:
        path.mkdir()
    trainer.strategy.barrier()

    @torch.no_grad()
    def restore() -> None:
        for key, value in torch.load(file, weights_only=True).items():
            tensors[key].copy_(value)

    save_s = timed(trainer, lambda: torch.save(tensors, file))
    restore_s = timed(trainer, restore)
    return Sample(save_s, restore_s, disk_bytes(path) if trainer.is_global_zero else 0, save_s)


def measure_size(args: argparse.Namespace, size_mb: int, chains: list[ChainRow]) -> list[Row]:
    """Trains a model of ``size_mb`` and measures every method on it, in a rotating order per repeat."""
    trainer = train(args, size_mb)
    tmp = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.tmp) if trainer.is_global_zero else ""
    root = Path(trainer.strategy.broadcast(tmp))
    asynchronous = [] if args.no_async else [f"{b}+{m}" for b in args.backends for m in ("async", "precopy")]
    methods = [*([] if args.async_only else args.backends), *asynchronous, TORCH_SAVE]
    samples: dict[str, list[Sample]] = {method: [] for method in methods}
    batches = iter(trainer.datamodule.train_dataloader())
    try:
        nbytes = state_bytes(trainer)
        floor = copy_floor(trainer)
        for repeat in range(args.repeats):
            for method in methods[repeat % len(methods) :] + methods[: repeat % len(methods)]:
                path = root / f"{method}-{repeat}"
                measure = (measure_torch_save if method == TORCH_SAVE else
                           partial(measure_backend, backend=method, batches=batches))
                samples[method].append(measure(trainer, path=path))
                remove(trainer, path)
    finally:
        remove(trainer, root)
    if args.chain:
        chains.extend(measure_chains(args, trainer, size_mb))
    rows = [Row(size_mb, method, nbytes, *median(samples[method]), *floor) for method in methods]
    for row in rows:
        progress(trainer, f"{size_mb} MiB {row.method}: save {row.save_s:.2f} s, restore {row.restore_s:.2f} s")
    return rows


@dataclass
class ChainRow:
    """One incremental chain at one size: the full link, the deltas (medians), the chain's restore."""

    size_mb: int
    mode: str
    delta_steps: int
    full_blocked_s: float
    full_save_s: float
    full_bytes: int
    blocked_s: float
    save_s: float
    delta_bytes: float
    rows: float
    restore_s: float


def train_steps(trainer: pl.Trainer, batches, steps: int) -> None:
    """``steps`` forward and backward passes of the trained model (the fused optimizer updates the looked-up rows;
    the dense part is not stepped: nothing the checkpoint measures depends on it)."""
    module = trainer.lightning_module
    trainer.strategy.model.train()
    with torch.enable_grad():
        for _ in range(steps):
            batch = next(batches)
            module.loss_fn(module(batch), batch.labels).backward()


def measure_chain(trainer: pl.Trainer, args: argparse.Namespace, size_mb: int, asynchronous: bool,
                  delta_steps: int, root: Path) -> ChainRow:
    """A chain of ``--chain`` links (full + deltas ``delta_steps`` training steps apart) into ``root``; then a restore
    of its last link (the whole chain)."""
    from lightning_dlrover.strategy.incremental import ChainPolicy

    strategy = trainer.strategy
    checkpointing = strategy.checkpointing
    checkpointing.policy, checkpointing.asynchronous = ChainPolicy(args.chain), asynchronous
    batches = iter(trainer.datamodule.train_dataloader())
    links: list[tuple[float, float, int, int]] = []  # blocked, save, bytes, rows (summed over ranks)
    for index in range(args.chain):
        if index:
            train_steps(trainer, batches, delta_steps)
        path = root / f"link-{index}"
        strategy.barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        strategy.barrier()
        blocked = time.perf_counter() - start
        checkpointing.wait()
        strategy.barrier()
        save = time.perf_counter() - start
        rows = torch.tensor([checkpointing.policy.last_rows or 0], dtype=torch.int64)
        dist.all_reduce(rows)
        links.append((blocked, save, disk_bytes(path) if trainer.is_global_zero else 0, int(rows.item())))
    checkpointing.asynchronous = False
    restore = timed(trainer, lambda: strategy.load_checkpoint(root / f"link-{args.chain - 1}"))
    checkpointing.policy.tracker.close()
    checkpointing.policy = None
    deltas = links[1:] or links
    mode = "incr+async" if asynchronous else "incr"
    return ChainRow(size_mb, mode, delta_steps, links[0][0], links[0][1], links[0][2],
                    statistics.median(d[0] for d in deltas), statistics.median(d[1] for d in deltas),
                    statistics.median(d[2] for d in deltas), statistics.median(d[3] for d in deltas), restore)


def measure_chains(args: argparse.Namespace, trainer: pl.Trainer, size_mb: int) -> list[ChainRow]:
    """Every chain of ``--delta-steps`` and both modes at one size."""
    tmp = tempfile.mkdtemp(prefix="bench_chain_", dir=args.tmp) if trainer.is_global_zero else ""
    root = Path(trainer.strategy.broadcast(tmp))
    out = []
    try:
        for delta_steps in args.delta_steps:
            for asynchronous in ([] if args.async_only else [False]) + ([] if args.no_async else [True]):
                chain = root / f"chain-{delta_steps}-{int(asynchronous)}"
                out.append(measure_chain(trainer, args, size_mb, asynchronous, delta_steps, chain))
                remove(trainer, chain)
                progress(trainer, f"{size_mb} MiB chain {out[-1].mode} every {delta_steps} steps: blocked "
                                  f"{out[-1].blocked_s:.3f} s, {out[-1].delta_bytes / MiB:.1f} MiB per delta")
    finally:
        remove(trainer, root)
    return out


def print_chains(rows: list[ChainRow], args: argparse.Namespace) -> None:
    print(f"\nIncremental chains (incremental_checkpoint_every={args.chain}): a full save, then {args.chain - 1} deltas "
          f"each after K training steps (global batch {args.batch}); delta columns are medians over the deltas; rows: "
          "embedding rows in a delta, summed over ranks; restore: the whole chain.")
    header = (f"{'emb MiB':>8}  {'mode':<11}{'K':>4}{'full blk s':>11}{'full s':>8}{'full MiB':>9}{'blocked s':>10}"
              f"{'save s':>8}{'MiB/delta':>10}{'rows/delta':>11}{'B/row':>7}{'restore s':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        per_row = r.delta_bytes / r.rows if r.rows else float("nan")
        print(f"{r.size_mb:>8}  {r.mode:<11}{r.delta_steps:>4}{r.full_blocked_s:>11.3f}{r.full_save_s:>8.3f}"
              f"{r.full_bytes / MiB:>9.1f}{r.blocked_s:>10.3f}{r.save_s:>8.3f}{r.delta_bytes / MiB:>10.2f}"
              f"{r.rows:>11.0f}{per_row:>7.0f}{r.restore_s:>10.3f}")


def median(samples: list[Sample]) -> tuple[float, float, int, float, float]:
    """Median save and restore seconds, the largest disk size, the median blocked seconds and steps run during the
    save of ``samples``."""
    return (
        statistics.median(s.save_s for s in samples),
        statistics.median(s.restore_s for s in samples),
        max(s.disk_bytes for s in samples),
        statistics.median(s.blocked_s for s in samples),
        statistics.median(s.steps for s in samples),
    )


def progress(trainer: pl.Trainer, message: str) -> None:
    if trainer.is_global_zero:
        print(message, file=sys.stderr, flush=True)


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    print(f"\nDLRoverStrategy checkpoints: {args.devices} ranks (gloo, CPU), 26 tables x {args.embedding_dim} columns, "
          f"median of {args.repeats}.\nemb: fp32 table weights; state: tables + fused optimizer state, summed over "
          f"ranks; save/ts, rest/ts: time relative to {TORCH_SAVE} of each rank's local tensors; +precopy: training "
          "steps run until the save commits (steps), blocked = the save call + the steps' copy-before-write; copy "
          "floor: a plain copy_ of a rank's local state into memory copied into before (fresh: into new memory), "
          "median of 3, slowest rank.")
    header = (f"{'emb MiB':>8}{'state MiB':>10}  {'method':<20}{'blocked s':>10}{'save s':>8}{'restore s':>10}"
              f"{'save GB/s':>10}{'rest GB/s':>10}{'disk MiB':>9}{'save/ts':>9}{'rest/ts':>9}{'steps':>6}"
              f"{'copy floor s':>13}{'fresh s':>8}")
    print(header)
    print("-" * len(header))
    reference = {r.size_mb: r for r in rows if r.method == TORCH_SAVE}
    for r in rows:
        ref = reference[r.size_mb]
        print(f"{r.size_mb:>8}{r.state_bytes / MiB:>10.1f}  {r.method:<20}{r.blocked_s:>10.3f}{r.save_s:>8.3f}"
              f"{r.restore_s:>10.3f}"
              f"{r.state_bytes / GB / r.save_s:>10.2f}{r.state_bytes / GB / r.restore_s:>10.2f}"
              f"{r.disk_bytes / MiB:>9.1f}{r.save_s / ref.save_s:>9.2f}{r.restore_s / ref.restore_s:>9.2f}"
              f"{r.steps:>6.0f}{r.floor_s:>13.3f}{r.fresh_s:>8.3f}")


def recommend(rows: list[Row]) -> str:
    """One line naming the backend with the least save + restore time summed over all sizes.

    Within ``NOISE`` of each other the backends tie, and the one that also restores onto new ranks wins.
    """
    totals = {
        backend: sum(r.save_s + r.restore_s for r in rows if r.method == backend)
        for backend in dict.fromkeys(r.method for r in rows if r.method != TORCH_SAVE and "+" not in r.method)
    }
    if not totals:
        return "recommendation: no blocking backend was measured; nothing to compare."
    if len(totals) < 2:
        return f"recommendation: only {next(iter(totals))!r} was measured; nothing to compare."
    (best, best_s), (other, other_s) = sorted(totals.items(), key=lambda item: item[1])[:2]
    summary = f"save + restore over all sizes {best_s:.2f} s ({best}) vs {other_s:.2f} s ({other})"
    if other_s / best_s >= 1 + NOISE:
        return f"recommendation: checkpoint_backend={best!r}, {other_s / best_s:.2f}x as fast: {summary}"
    elastic = [b for b in (best, other) if get_backend(b).restores_onto_new_ranks]
    if len(elastic) == 1:
        return (f"recommendation: checkpoint_backend={elastic[0]!r}: the speeds tie within {NOISE:.0%} ({summary}), "
                f"and {elastic[0]!r} also restores onto a larger world size")
    return f"recommendation: checkpoint_backend={best!r}: the speeds tie within {NOISE:.0%} ({summary})"


def end_to_end(args: argparse.Namespace, size_mb: int, asynchronous: bool) -> tuple[float, float, int]:
    """Wall seconds of a fit of ``--e2e-steps`` steps with a checkpoint every ``--e2e-every`` steps, the CPU seconds
    all ranks' processes spent during it, and the number of checkpoints written."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    sizes = [rows_per_table(size_mb, args.embedding_dim)] * NUM_SPARSE
    tmp = tempfile.mkdtemp(prefix="bench_e2e_", dir=args.tmp)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.e2e_steps, limit_val_batches=0, logger=False,
        strategy=DLRoverStrategy(checkpoint_backend=args.backends[0], print_digest=False,
                                 async_checkpoint=asynchronous),
        callbacks=[ModelCheckpoint(dirpath=tmp, every_n_train_steps=args.e2e_every, save_top_k=1)],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp,
    )
    model = DLRMModule(sizes, embedding_dim=args.embedding_dim)
    data = DLRMDataModule(sizes, global_batch_size=args.batch, train_batches=args.e2e_steps, val_batches=0)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    trainer.fit(model, data)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = torch.tensor([after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime], dtype=torch.float64)
    dist.all_reduce(cpu)
    trainer.strategy.barrier()
    if trainer.is_global_zero:
        shutil.rmtree(tmp, ignore_errors=True)
    return wall, float(cpu.item()), args.e2e_steps // args.e2e_every


def main() -> None:
    args = parse_args()
    quiet()
    rows: list[Row] = []
    chains: list[ChainRow] = []
    e2e: list[tuple[int, str, float, float, int]] = []
    for size_mb in args.sizes_mb:
        rows.extend(measure_size(args, size_mb, chains))
        gc.collect()  # the trainer and its model of this size
        if args.e2e_steps:
            for asynchronous in (False, True):
                e2e.append((size_mb, "async" if asynchronous else "sync", *end_to_end(args, size_mb, asynchronous)))
                gc.collect()
    if dist.get_rank() == 0:
        print_table(rows, args)
        print(recommend(rows))
        if chains:
            print_chains(chains, args)
        if e2e:
            print(f"\nEnd to end: fit of {args.e2e_steps} steps (global batch {args.batch}), a checkpoint every "
                  f"{args.e2e_every} steps ({args.backends[0]}); wall of fit on rank 0, CPU of all ranks' processes.")
            print(f"{'emb MiB':>8}  {'saves':<6}{'checkpoints':>12}{'wall s':>9}{'CPU s':>9}")
            for size_mb, mode, wall, cpu, count in e2e:
                print(f"{size_mb:>8}  {mode:<6}{count:>12}{wall:>9.2f}{cpu:>9.2f}")


if __name__ == "__main__":
    main()
