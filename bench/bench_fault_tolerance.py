"""Cost of erasure-coded embeddings (``DLRoverStrategy(parity=...)``) beside periodic checkpointing.

Three measurements on a benchmark-like DLRM (26 tables of ``--rows`` x ``--dim``, fused row-wise
Adagrad, the MLPs of ``configs/benchmark.yaml``), gloo on CPU, each variant a real multi-process job
started by Lightning's popen launcher (the script re-runs itself per rank) in its own process tree:

1. Training throughput without parity and with ``ParityConfig(k=2, r=1)`` and ``(k=2, r=2)``, at 3
   and 4 ranks (``r=2`` needs ``k + r = 4`` ranks; ``r=1`` and no parity also run at 4 ranks so that
   every ratio is taken at one world size). ``--warmup`` untimed steps, then ``--steps`` timed ones;
   a step is the wall time from the end of one step's ``on_train_batch_end`` to the next (data
   loading included). Per step the strategy's ``step_timer`` sections are popped at
   ``on_train_batch_end`` (no ``ThroughputMonitor`` runs): ``parity`` is
   ``FaultManager.end_step`` and ``begin_step`` (``CodedEmbeddings.post_deltas``/``finish_deltas``,
   the vote, the dense and trainer-state snapshots, once the batch is over: counted in the next step); ``capture``
   is the forward pre-hook that records the touched rows and their undo log (``CodedState._touch``,
   timed by this script through a wrapper, inside the forward pass). "parity % step" is
   (parity + capture) / step time of the same run; "x none" is the throughput ratio to the
   no-parity run at the same world size, the end-to-end overhead. The same is measured in CPU time
   (``time.process_time`` of each rank's process around the step, ``end_step`` and the capture):
   with more ranks than cores (3-4 ranks on 2 here) a wall-clock section also holds the time a rank
   waits for the others' share of the CPU, and the machine is shared; CPU time is the robust figure.
2. Periodic checkpointing instead of parity: in the no-parity runs, after the timed steps,
   ``--saves`` checkpoints per backend (``dcp``, ``torchsnapshot``) are written during training
   (``trainer.save_checkpoint`` on every rank from ``on_train_batch_end``, a training step between
   two saves, backends alternating), timed on rank 0 between barriers; the median per backend is the
   save time. The amortised overhead of checkpointing every ``n`` steps is save time / ``n`` as a
   share of the no-parity step time; a failure loses ``n / 2`` steps on average and ``n`` at worst.
   Parity recovers the last committed step (the one before the failing step): 0 steps lost.
3. Recovery (3 ranks, ``k=2, r=1``, after training): the victim rank's coded segments (table shards
   and optimizer state) and parity are zeroed, as ``tests/scripts/train.py``'s drill does, and
   ``strategy.recover([victim])`` is timed (collective; barrier before, barrier after; the slowest
   rank's time). Then the same state is checkpointed with each backend, the victim's segments are
   zeroed again and ``strategy.load_checkpoint(path)`` is timed (it restores every rank; parity is
   detached during the load so that it does not re-encode; the re-encode a parity job needs after
   a checkpoint restore, ``CodedEmbeddings.encode``, is timed separately). Every restore is checked
   against the state digest taken before the wipe (``training_state_digest``). Checkpoints are read
   back from the page cache: a restore from remote storage is slower.

After the timed steps, every parity run also profiles ``FaultManager.end_step`` with cProfile
on rank 0 for ``--profile-steps`` more steps (not timed; top functions by own time), and the drill
profiles one more (untimed) ``recover`` on the victim rank (top functions by cumulative time).

Every run is repeated ``--rounds`` times, in reversed order every other round (ABBA); the tables give
the median over rounds. Every variant runs with glibc's malloc tuned as in ``bench_strategy.py``
(``--malloc``), which takes the per-step page-fault noise out of the comparison. The machine is
shared: compare ratios.

    PYTHONPATH=. python bench/bench_fault_tolerance.py            # 5 runs x 2 rounds, about 5 minutes on 2 cores
    PYTHONPATH=. python bench/bench_fault_tolerance.py --quick    # tiny model, 3 runs, 1 round: a smoke test
    PYTHONPATH=. python bench/bench_fault_tolerance.py --runs 3:none 3:2,1   # a subset of the runs
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_dlrover import DLRoverStrategy, ParityConfig
from lightning_dlrover.checkpoint import BACKENDS, get_backend
from lightning_dlrover.data import DLRMDataModule
from lightning_dlrover.data.sources import NUM_SPARSE
from lightning_dlrover.models import DLRMModule
from lightning_dlrover.monitor import training_state_digest

RESULT_TAG = "BENCH_RESULT"
DEFAULT_RUNS = ["3:none", "3:2,1", "4:none", "4:2,1", "4:2,2"]
# As bench_strategy.py: buffers up to 64 MiB come from the heap, which keeps up to 512 MiB free.
MALLOC_SETTINGS = {
    "system": None,
    "tuned": "glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=536870912",
}
#: The issue's targets: parity time as a share of the step time, per r.
TARGETS = {1: 0.05, 2: 0.10}  # parity share of the step at r = 1, 2 (commit every step)
TARGETS_COALESCED = {1: 0.05, 2: 0.08}  # at commit_every_n_steps = 16
SEED = 0
LR = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, metavar="RANKS:PARITY",
                        help="runs, as ranks:none or ranks:k,r (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="times every run is repeated, in reversed order every other round (default: 2)")
    parser.add_argument("--rows", type=int, default=50_000,
                        help="rows of each of the 26 tables (default: 50000; configs/benchmark.yaml has 100000)")
    parser.add_argument("--dim", type=int, default=64, help="embedding dimension (default: 64)")
    parser.add_argument("--batch", type=int, default=4104,
                        help="global batch size, divisible by every world size (default: 4104)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (default: 30)")
    parser.add_argument("--saves", type=int, default=3,
                        help="checkpoints per backend in the no-parity runs; median save time (default: 3)")
    parser.add_argument("--backends", nargs="+", default=sorted(BACKENDS), choices=sorted(BACKENDS),
                        help="checkpoint backends (default: all)")
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 10, 100, 1000],
                        help="checkpoint intervals in steps for the overhead table (default: 1 10 100 1000)")
    parser.add_argument("--victim", type=int, default=1, help="rank lost in the recovery drill (default: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each recovery measurement (default: 3)")
    parser.add_argument("--profile-steps", type=int, default=8,
                        help="extra steps of every parity run with post/finish_deltas + commit under cProfile on rank 0, and one profiled "
                             "recovery in the drill (0: no profiles; default: 8)")
    parser.add_argument("--profile-top", type=int, default=12, help="functions shown per profile (default: 12)")
    parser.add_argument("--malloc", choices=list(MALLOC_SETTINGS), default="tuned",
                        help="glibc malloc settings of every run (default: tuned)")
    parser.add_argument("--tmp", default="/tmp", help="parent of the temporary checkpoint directories")
    parser.add_argument("--history", default=None,
                        help="record the measured costs in this job history for the planner (lightning-dlrover plan "
                             "--history, parity: auto with $LIGHTNING_DLROVER_HISTORY)")
    parser.add_argument("--quick", action="store_true",
                        help="26 x 2000 x 16 tables, 6 steps, one round, runs 3:none 3:2,1 4:2,2: a smoke test")
    # Internal: one run (this process is one rank of it; prints the result line on rank 0).
    parser.add_argument("--variant", choices=["train"], help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--parity", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--drill", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.dim, args.batch, args.warmup, args.steps = 2000, 16, 384, 2, 6
        args.saves, args.repeats, args.profile_steps, args.rounds = 1, 1, 3, 1
        if args.runs == DEFAULT_RUNS:
            args.runs = ["3:none", "3:2,1", "4:2,2"]
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    for run in [] if args.variant else args.runs:  # a rank checks only its own run (the default runs are not its)
        devices, parity = parse_run(parser, run)
        if args.batch % devices:
            parser.error(f"--batch {args.batch} is not divisible by {devices} ranks (run {run})")
        if parity and parity.k + parity.r > devices:
            parser.error(f"run {run}: k + r = {parity.k + parity.r} ranks needed, {devices} given")
    return args


def parse_run(parser: argparse.ArgumentParser | None, run: str) -> tuple[int, ParityConfig | None]:
    """``"3:2,1"`` -> (3, ParityConfig(2, 1)); ``"4:2,1,16"`` -> (4, ParityConfig(2, 1, 16)); ``"2:1,1,1,0"`` ->
    (2, ParityConfig(1, 1, 1, overlap=False)); ``"3:none"`` -> (3, None)."""
    try:
        devices, parity = run.split(":")
        config = None if parity == "none" else ParityConfig.parse(parity)
        return int(devices), config
    except (ValueError, TypeError):
        if parser is None:
            raise
        parser.error(f"run {run!r} is not ranks:none or ranks:k,r[,commit_every_n_steps[,overlap 0|1]]")
        raise


def quiet() -> None:
    """Silences per-run info logs and warnings of Lightning and TorchRec."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torchrec", "torch.distributed", "torch.fx",
                 "lightning_dlrover"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def parity_label(parity: ParityConfig | None) -> str:
    if parity is None:
        return "none"
    n = parity.commit_every_n_steps
    return f"k{parity.k}r{parity.r}" + (f"n{n}" if n > 1 else "") + ("" if parity.overlap else "s")


# --- one run (every rank) --------------------------------------------------------------------------------


def timed(strategy: DLRoverStrategy, fn: Any) -> float:
    """Seconds of ``fn`` on every rank, barrier before and after; the slowest rank's time (collective)."""
    strategy.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    strategy.barrier()
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def remove(strategy: DLRoverStrategy, path: Path) -> None:
    """Deletes ``path`` on rank 0 while the other ranks wait."""
    strategy.barrier()
    if strategy.is_global_zero:
        shutil.rmtree(path, ignore_errors=True)
    strategy.barrier()


def process_cpu() -> float:
    """CPU seconds of this whole process so far (every thread, user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def instrument(obj: Any, name: str, label: str, cpu: dict[str, float], timer: Any = None) -> bool:
    """Replaces method ``name`` of ``obj`` by an instance attribute that adds its CPU seconds (the whole
    process: every thread) to ``cpu[label]`` and, given a ``StepTimer``, its wall time to section ``label``.

    The strategy and the forward hooks call these methods through the instance, so the attribute takes
    effect. Returns False (nothing timed) if ``obj`` has no such method.
    """
    method = getattr(obj, name, None)
    if method is None:
        return False

    def timed_method(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            if timer is None:
                return method(*args, **kwargs)
            with timer.section(label):
                return method(*args, **kwargs)
        finally:
            cpu[label] = cpu.get(label, 0.0) + time.process_time() - start

    setattr(obj, name, timed_method)
    return True


@dataclass
class Bench(pl.Callback):
    """Per-step wall time and step-timer sections; checkpoint saves and post/finish_deltas + commit profiling after the timed steps."""

    args: argparse.Namespace
    tmp: Path | None = None
    steps: list[float] = field(default_factory=list)
    sections: list[dict[str, float]] = field(default_factory=list)
    cpu_steps: list[float] = field(default_factory=list)
    cpu_sections: list[dict[str, float]] = field(default_factory=list)
    _cpu: dict[str, float] = field(default_factory=dict)
    delta_bytes: list[int] = field(default_factory=list)
    _delta_bytes: int = 0
    _resume_cpu: float = 0.0
    saves: dict[str, list[float]] = field(default_factory=dict)
    profile: cProfile.Profile | None = None
    capture_timed: bool = False
    _resume: float = 0.0
    #: Whole-process CPU seconds (``getrusage(RUSAGE_SELF)``: every thread, user + system) at the start of training
    #: (imports, model, sharding, parity encode), at the first timed step and at the last.
    rusage_marks: dict[str, float] = field(default_factory=dict)

    @property
    def timed_steps(self) -> int:
        return self.args.warmup + self.args.steps

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rusage_marks["train_start"] = process_cpu()
        strategy = trainer.strategy
        if strategy.fault.coded is not None:
            self.capture_timed = instrument(strategy.fault.coded.state, "_touch", "capture", self._cpu, strategy.step_timer)
            instrument(strategy.fault, "end_step", "parity", self._cpu)  # snapshots, deltas posted (or all of it)
            instrument(strategy.fault, "begin_step", "parity", self._cpu)  # with overlap: deltas applied, the vote
            self._count_deltas(strategy.fault.coded)
        made = tempfile.mkdtemp(prefix="bench_ft_", dir=self.args.tmp) if trainer.is_global_zero else ""
        self.tmp = Path(strategy.broadcast(made))
        strategy.step_timer.pop_step()
        self._resume, self._resume_cpu = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now, now_cpu = time.perf_counter(), time.process_time()
        sections = trainer.strategy.step_timer.pop_step()
        cpu_sections = dict(self._cpu)
        self._cpu.clear()
        step = trainer.global_step  # steps completed
        if step <= self.timed_steps:
            self.steps.append(now - self._resume)
            self.sections.append(sections)
            self.cpu_steps.append(now_cpu - self._resume_cpu)
            self.cpu_sections.append(cpu_sections)
            self.delta_bytes.append(self._delta_bytes)
        self._delta_bytes = 0
        if step == self.args.warmup:
            self.rusage_marks["timed_start"] = process_cpu()
        if step == self.timed_steps:
            self.rusage_marks["timed_end"] = process_cpu()
            self._after_timed_steps(trainer)
        elif step > self.timed_steps and trainer.strategy.fault.coded is None and self.args.saves:
            self._save(trainer, step - self.timed_steps - 1)
        self._resume, self._resume_cpu = time.perf_counter(), time.process_time()

    def _count_deltas(self, coded: Any) -> None:
        """Counts the bytes every ``post_deltas`` sends (its messages: headers and row deltas)."""
        send = coded.post_deltas

        def counted() -> None:
            send()
            self._delta_bytes += coded.sent_bytes

        coded.post_deltas = counted

    def _after_timed_steps(self, trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        if strategy.fault.coded is not None and self.args.profile_steps and trainer.is_global_zero:
            profile = self.profile = cProfile.Profile()

            def profiled(method: Callable[..., Any]) -> Callable[..., Any]:
                def run(*args: Any, **kwargs: Any) -> Any:
                    profile.enable()
                    try:
                        return method(*args, **kwargs)
                    finally:
                        profile.disable()

                return run

            # called through the instances, so instance attributes take effect
            strategy.fault.end_step = profiled(strategy.fault.end_step)
            strategy.fault.begin_step = profiled(strategy.fault.begin_step)

    def _save(self, trainer: pl.Trainer, index: int) -> None:
        """Save number ``index`` of the checkpoint phase: backends alternate."""
        strategy = trainer.strategy
        backend = self.args.backends[index % len(self.args.backends)]
        strategy.checkpoint_backend = get_backend(backend)
        path = self.tmp / f"{backend}-{index}"
        self.saves.setdefault(backend, []).append(timed(strategy, lambda: trainer.save_checkpoint(path)))
        remove(strategy, path)


def zero_rank_state(strategy: DLRoverStrategy, victim: int, parity: bool) -> None:
    """On ``victim``: zero its coded segments (table shards, optimizer state) and, with ``parity``, its parity."""
    if strategy.global_rank == victim:
        for segment in strategy.fault.coded.state.segments:
            segment.tensor.zero_()
        if parity:
            strategy.fault.coded.parity.zero_()
    strategy.barrier()


def profile_recover(trainer: pl.Trainer, args: argparse.Namespace, victim: int) -> str | None:
    """One more wipe and ``recover([victim])`` with cProfile on the victim (the rank that decodes); its top
    functions by cumulative time, returned on every rank (collective)."""
    strategy = trainer.strategy
    zero_rank_state(strategy, victim, parity=True)
    profile = cProfile.Profile() if strategy.global_rank == victim else None
    strategy.barrier()
    if profile is not None:
        profile.enable()
    strategy.recover([victim])
    text = None
    if profile is not None:
        profile.disable()
        stream = io.StringIO()
        pstats.Stats(profile, stream=stream).sort_stats("cumulative").print_stats(args.profile_top)
        text = trim_profile(stream.getvalue())
    texts: list[str | None] = [None] * strategy.world_size
    dist.all_gather_object(texts, text)
    return texts[victim]


def drill(trainer: pl.Trainer, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Decode of one lost rank vs a checkpoint restore of the same state (collective; see the module docstring)."""
    strategy = trainer.strategy
    assert isinstance(strategy, DLRoverStrategy) and strategy.fault.coded is not None
    victim = args.victim % strategy.world_size
    before = training_state_digest(trainer)
    coded = strategy.fault.coded
    parity_before = coded.parity.clone()

    def same() -> bool:
        """Training state digest and every rank's parity as before the wipe (collective)."""
        ok = torch.tensor([int(torch.equal(coded.parity, parity_before))])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return training_state_digest(trainer) == before and bool(ok)
    state_bytes = torch.tensor([coded.state.num_bytes, coded.parity.numel()], dtype=torch.int64)
    dist.all_reduce(state_bytes)
    out: dict[str, Any] = {
        "victim": victim,
        "victim_state_bytes": coded.state.num_bytes if strategy.global_rank == victim else 0,
        "state_bytes": int(state_bytes[0]),
        "parity_bytes": int(state_bytes[1]),
        "methods": {},
    }
    victim_bytes = torch.tensor([out["victim_state_bytes"]], dtype=torch.int64)
    dist.all_reduce(victim_bytes)
    out["victim_state_bytes"] = int(victim_bytes)

    def record(method: str, seconds: list[float], exact: list[bool]) -> None:
        out["methods"][method] = {"seconds": seconds, "exact": all(exact)}

    times, exact = [], []
    for _ in range(args.repeats):
        zero_rank_state(strategy, victim, parity=True)
        times.append(timed(strategy, lambda: strategy.recover([victim])))
        exact.append(same())
    record("decode", times, exact)
    if args.profile_steps:
        out["profile"] = profile_recover(trainer, args, victim)
        out["profile_exact"] = same()

    for backend in args.backends:
        strategy.checkpoint_backend = get_backend(backend)
        path = tmp / f"drill-{backend}"
        saves = [timed(strategy, lambda: trainer.save_checkpoint(path))]
        times, exact = [], []
        for _ in range(args.repeats):
            zero_rank_state(strategy, victim, parity=False)
            strategy.fault.coded = None  # no re-encode inside load_checkpoint: timed on its own below
            try:
                times.append(timed(strategy, lambda: strategy.load_checkpoint(path)))
            finally:
                strategy.fault.coded = coded
            exact.append(same())  # the victim's parity was not wiped: the restored data must match it
        record(backend, times, exact)
        out["methods"][backend]["save_seconds"] = saves
        remove(strategy, path)

    times, exact = [], []
    for _ in range(args.repeats):
        times.append(timed(strategy, coded.encode))
        exact.append(same())
    record("encode", times, exact)
    return out


def run_train(args: argparse.Namespace) -> None:
    """One run: trains, saves checkpoints (no parity) or profiles (parity), drills (``--drill``); prints on rank 0."""
    devices, parity = args.devices, parse_run(None, f"{args.devices}:{args.parity}")[1]
    pl.seed_everything(SEED, verbose=False)
    checkpointing = parity is None and args.saves > 0
    extra = len(args.backends) * args.saves if checkpointing else (args.profile_steps if parity else 0)
    bench = Bench(args)
    strategy = DLRoverStrategy(sharding_types=["table_wise"], parity=parity, print_digest=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.warmup + args.steps + extra,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[bench],
    )
    sizes = [args.rows] * NUM_SPARSE
    model = DLRMModule(sizes, embedding_dim=args.dim, dense_arch_layer_sizes=[256, args.dim],
                       over_arch_layer_sizes=[256, 128, 1], embedding_lr=LR, dense_lr=LR)
    data = DLRMDataModule(sizes, global_batch_size=args.batch, train_batches=args.warmup + args.steps + extra,
                          val_batches=0, seed=SEED)
    try:
        trainer.fit(model, data)
        drilled = drill(trainer, args, bench.tmp) if args.drill and parity is not None else None
        report(trainer, args, parity, bench, drilled)
    finally:
        if trainer.is_global_zero and bench.tmp is not None:
            shutil.rmtree(bench.tmp, ignore_errors=True)


def report(trainer: pl.Trainer, args: argparse.Namespace, parity: ParityConfig | None, bench: Bench,
           drilled: dict[str, Any] | None) -> None:
    """Gathers every rank's timed sections and prints the result line on rank 0."""
    warm = slice(args.warmup, None)
    n = len(bench.sections[warm])
    local = {name: sum(s.get(name, 0.0) for s in bench.sections[warm]) / n for name in ("parity", "capture")}
    local.update({
        f"cpu_{name}": sum(s.get(name, 0.0) for s in bench.cpu_sections[warm]) / n for name in ("parity", "capture")
    })
    local["cpu_step"] = statistics.fmean(bench.cpu_steps[warm])
    marks = bench.rusage_marks
    local["proc_cpu"] = {"setup": marks["train_start"], "timed": (marks["timed_end"] - marks["timed_start"]) / n,
                         "total": process_cpu()}
    local["delta_bytes"] = statistics.fmean(bench.delta_bytes[warm])
    gathered: list[dict[str, float]] = [None] * trainer.world_size  # type: ignore[list-item]
    dist.all_gather_object(gathered, local)
    if not trainer.is_global_zero:
        return
    steps = bench.steps[warm]
    profile = None
    if bench.profile is not None:
        text = io.StringIO()
        pstats.Stats(bench.profile, stream=text).sort_stats("tottime").print_stats(args.profile_top)
        profile = trim_profile(text.getvalue())
    result = {
        "devices": trainer.world_size,
        "parity": None if parity is None else [parity.k, parity.r, parity.commit_every_n_steps, parity.overlap],
        "global_batch": args.batch,
        "threads": torch.get_num_threads(),
        "steps": len(steps),
        "step_s_mean": statistics.fmean(steps),
        "step_s_median": statistics.median(steps),
        "parity_s": [g["parity"] for g in gathered],
        "capture_s": [g["capture"] for g in gathered],
        "cpu_step_s": [g["cpu_step"] for g in gathered],
        "cpu_parity_s": [g["cpu_parity"] for g in gathered],
        "cpu_capture_s": [g["cpu_capture"] for g in gathered],
        "delta_bytes": [g["delta_bytes"] for g in gathered],
        "proc_cpu": [g["proc_cpu"] for g in gathered],
        "capture_timed": bench.capture_timed,
        "saves": bench.saves,
        "profile": profile,
        "profile_steps": args.profile_steps if profile else 0,
        "drill": drilled,
    }
    print(f"{RESULT_TAG} {json.dumps(result)}", flush=True)


def trim_profile(text: str) -> str:
    """The pstats table without its file-name header lines."""
    lines = [line.rstrip() for line in text.splitlines()]
    start = next((i for i, line in enumerate(lines) if "function calls" in line), 0)
    return "\n".join(line for line in lines[start:] if line.strip() and not line.lstrip().startswith("Ordered by"))


# --- orchestration ---------------------------------------------------------------------------------------


@dataclass
class Run:
    """The result line of one run, as parsed."""

    devices: int
    parity: tuple[int, int, int, bool] | None  # k, r, commit_every_n_steps, overlap
    global_batch: int
    threads: int
    steps: int
    step_s_mean: float
    step_s_median: float
    parity_s: list[float]
    capture_s: list[float]
    cpu_step_s: list[float]
    cpu_parity_s: list[float]
    cpu_capture_s: list[float]
    delta_bytes: list[float]
    capture_timed: bool
    saves: dict[str, list[float]]
    profile: str | None
    profile_steps: int
    drill: dict[str, Any] | None
    proc_cpu: list[dict[str, float]] = field(default_factory=list)  # per rank: setup, timed (per step), total s
    wall_s: float = 0.0
    tree_cpu_s: float = 0.0  # CPU of the run's whole process tree, from the parent (RUSAGE_CHILDREN)
    rounds: int = 1

    @property
    def label(self) -> str:
        if self.parity is None:
            return "none"
        return parity_label(ParityConfig(*self.parity))

    @property
    def step_ms(self) -> float:
        return 1000 * self.step_s_median

    @property
    def delta_kib(self) -> float:
        """Row-delta bytes a rank sends per step (KiB, mean over ranks and steps; a commit window's once)."""
        return statistics.fmean(self.delta_bytes) / 1024 if self.delta_bytes else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_s_median

    @property
    def parity_ms(self) -> float:
        """Mean over ranks of the mean parity section per step."""
        return 1000 * statistics.fmean(self.parity_s)

    @property
    def capture_ms(self) -> float:
        return 1000 * statistics.fmean(self.capture_s)

    @property
    def parity_max_ms(self) -> float:
        """The slowest rank's parity + capture per step."""
        return 1000 * max(p + c for p, c in zip(self.parity_s, self.capture_s))

    @property
    def cpu_step_ms(self) -> float:
        """CPU ms per step of one rank's process (mean over ranks)."""
        return 1000 * statistics.fmean(self.cpu_step_s)

    @property
    def cpu_parity_ms(self) -> float:
        """CPU ms per step of post/finish_deltas + commit + capture of one rank's process (mean over ranks)."""
        return 1000 * statistics.fmean(p + c for p, c in zip(self.cpu_parity_s, self.cpu_capture_s))

    @property
    def cpu_share(self) -> float:
        return self.cpu_parity_ms / self.cpu_step_ms

    @property
    def share(self) -> float:
        """(parity + capture) per step over the mean step time of this run."""
        return (self.parity_ms + self.capture_ms) / (1000 * self.step_s_mean)


def run_variant(args: argparse.Namespace, devices: int, parity: ParityConfig | None, drill_: bool) -> Run:
    """Runs one ``train`` variant in a fresh process tree and parses its result line."""
    forwarded = ["--devices", devices, "--parity", "none" if parity is None else
                 f"{parity.k},{parity.r},{parity.commit_every_n_steps},{int(parity.overlap)}",
                 "--rows", args.rows, "--dim", args.dim, "--batch", args.batch, "--warmup", args.warmup,
                 "--steps", args.steps, "--saves", args.saves, "--victim", args.victim, "--repeats", args.repeats,
                 "--profile-steps", args.profile_steps, "--profile-top", args.profile_top, "--tmp", args.tmp,
                 "--backends", *args.backends]
    command = [sys.executable, os.path.abspath(__file__), "--variant", "train", *map(str, forwarded)]
    command += ["--drill"] if drill_ else []
    env = dict(os.environ)
    if MALLOC_SETTINGS[args.malloc] is not None:
        env["GLIBC_TUNABLES"] = MALLOC_SETTINGS[args.malloc]
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    tree_cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if done.returncode or not lines:
        sys.stderr.write(done.stdout + done.stderr)
        raise RuntimeError(f"run {devices}:{parity_label(parity)} failed (exit code {done.returncode}); "
                           "its output is above.")
    result = json.loads(lines[-1].removeprefix(RESULT_TAG))
    result["parity"] = tuple(result["parity"]) if result["parity"] else None
    return Run(**result, wall_s=wall, tree_cpu_s=tree_cpu)


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def print_throughput(runs: list[Run], args: argparse.Namespace) -> None:
    first = runs[0]
    print(f"\n1. Training throughput: DLRM 26 x {args.rows} x {args.dim}, global batch {args.batch}, gloo on CPU "
          f"({first.threads} thread(s) per rank), table_wise; ms/step: median over {runs[0].rounds} round(s) of each run's median of {args.steps} steps after "
          f"{args.warmup}.")
    header = (f"{'ranks':>5}  {'parity':<7}{'samples/s':>10}{'ms/step':>9}{'x none':>8}{'parity ms':>10}"
              f"{'capture ms':>11}{'max rank':>9}{'% step':>8}{'cpu ms':>8}{'cpu x none':>11}{'par cpu':>8}{'% cpu':>7}"
              f"{'target':>8}{'KiB/step':>9}  ok (wall/cpu)")
    print(header)
    print("-" * len(header))
    for run in runs:
        base = next((r for r in runs if r.devices == run.devices and r.parity is None), None)
        ratio = f"{run.samples_per_s / base.samples_per_s:.3f}" if base else "-"
        cpu_ratio = f"{base.cpu_step_ms / run.cpu_step_ms:.3f}" if base else "-"
        line = f"{run.devices:>5}  {run.label:<7}{run.samples_per_s:>10.0f}{run.step_ms:>9.1f}{ratio:>8}"
        if run.parity is None:
            print(line + f"{'-':>10}{'-':>11}{'-':>9}{'-':>8}{run.cpu_step_ms:>8.1f}{cpu_ratio:>11}{'-':>8}{'-':>7}"
                  f"{'-':>8}")
            continue
        target = (TARGETS if run.parity[2] == 1 else TARGETS_COALESCED if run.parity[2] == 16 else {}).get(run.parity[1])
        ok = "-" if target is None else "/".join("yes" if x <= target else "NO" for x in (run.share, run.cpu_share))
        capture = f"{run.capture_ms:.1f}" if run.capture_timed else "n/a"
        print(line + f"{run.parity_ms:>10.1f}{capture:>11}{run.parity_max_ms:>9.1f}{pct(run.share):>8}"
              f"{run.cpu_step_ms:>8.1f}{cpu_ratio:>11}{run.cpu_parity_ms:>8.1f}{pct(run.cpu_share):>7}"
              f"{pct(target) if target else '-':>8}{run.delta_kib:>9.0f}  {ok}")
    print("x none: throughput / no-parity throughput at the same ranks (end-to-end); parity ms: step_timer's parity "
          "section (post/finish_deltas + commit + dense snapshot), capture ms: undo-log capture in the forward hooks, both wall ms per "
          "step, mean over ranks; max rank: the slowest rank's parity + capture; % step: (parity + capture) / mean "
          "step time. cpu ms: CPU time per step of a rank's process (all its threads); cpu x none: no-parity cpu ms / "
          "this run's (CPU-time throughput ratio, robust to a busy machine); par cpu: CPU time of post/finish_deltas + commit + capture; "
          "% cpu: their ratio (means over ranks). With more ranks than cores, wall sections include waiting for "
          "the other ranks' CPU share. KiB/step: row-delta bytes a rank sends per step (kNrM: a commit every N steps, "
          "deltas of a row touched several times in the window sent once; targets at N = 16: 5% at r = 1, 8% at r = 2).")


def print_process_cpu(runs: list[Run]) -> None:
    """Whole-process CPU beside the section timers: what the job as a whole pays, not only the timed sections."""
    print("\n1b. Whole-process CPU (getrusage: every thread of every rank, user + system), beside the section timers; "
          "sums over ranks.")
    header = (f"{'ranks':>5}  {'parity':<9}{'tree s':>8}{'x none':>8}{'ranks s':>9}{'setup s':>9}{'x none':>8}"
              f"{'step ms':>9}{'x none':>8}{'sect ms':>9}{'other ms':>9}")
    print(header)
    print("-" * len(header))
    for run in runs:
        base = next((r for r in runs if r.devices == run.devices and r.parity is None), None)
        total = sum(p["total"] for p in run.proc_cpu)
        setup = sum(p["setup"] for p in run.proc_cpu)
        step = 1000 * sum(p["timed"] for p in run.proc_cpu)
        sect = 1000 * sum(p + c for p, c in zip(run.cpu_parity_s, run.cpu_capture_s)) if run.parity else 0.0
        if base is not None:
            b_setup = sum(p["setup"] for p in base.proc_cpu)
            b_step = 1000 * sum(p["timed"] for p in base.proc_cpu)
            ratios = (f"{run.tree_cpu_s / base.tree_cpu_s:.3f}", f"{setup / b_setup:.3f}", f"{step / b_step:.3f}")
            other = f"{step - b_step - sect:.1f}" if run.parity else "-"
        else:
            ratios, other = ("-", "-", "-"), "-"
        print(f"{run.devices:>5}  {run.label:<9}{run.tree_cpu_s:>8.1f}{ratios[0]:>8}{total:>9.1f}{setup:>9.1f}"
              f"{ratios[1]:>8}{step:>9.1f}{ratios[2]:>8}{sect:>9.1f}{other:>9}")
    print("tree s: CPU of the run's whole process tree (the parent's RUSAGE_CHILDREN; start-up, training, the extra "
          "steps for saves/profiles, the drill); ranks s: the ranks' own CPU at exit; setup s: before the first "
          "step (imports, model, sharding, parity encode); step ms: CPU per timed step; sect ms: the parity + capture "
          "sections' CPU per step; other ms: step ms - the no-parity step ms - sect ms (parity's cost outside its "
          "sections). A whole-job ratio is (setup + steps x step) / the same without parity: at 100 steps the fixed "
          "setup dominates.")


def overhead_rows(runs: list[Run], args: argparse.Namespace) -> list[tuple[int, str, str, float | None, float, str]]:
    """(ranks, method, every, save s, overhead share of step time, steps lost) of checkpointing and parity."""
    rows = []
    for base in (r for r in runs if r.parity is None):
        step_s = base.step_s_median
        for backend, saves in base.saves.items():
            save_s = statistics.median(saves)
            for n in args.intervals:
                rows.append((base.devices, backend, str(n), save_s, save_s / n / step_s, f"{n / 2:g} / {n}"))
        for run in (r for r in runs if r.devices == base.devices and r.parity is not None):
            measured = (run.parity_ms + run.capture_ms) / 1000 / step_s
            n = run.parity[2]
            lost = "0 / 0" if n == 1 else f"0 / 0 ({(n - 1) / 2:g} / {n - 1} replayed)"
            rows.append((base.devices, f"parity {run.label}", str(n), None, measured, lost))
            e2e = base.samples_per_s / run.samples_per_s - 1
            rows.append((base.devices, f"parity {run.label} e2e", str(n), None, e2e, lost))
    return rows


def less(ratio: float) -> str:
    """``0.1`` -> ``"90% less"``; ``2.5`` -> ``"2.5x more"``."""
    return f"{1 - ratio:.0%} less" if ratio <= 1 else f"{ratio:.1f}x more"


def print_checkpointing(runs: list[Run], args: argparse.Namespace) -> None:
    rows = overhead_rows(runs, args)
    if not rows:
        return
    saves = max((len(v) for r in runs for v in r.saves.values()), default=0)
    print(f"\n2. Periodic checkpointing vs parity: save = median of {saves} trainer.save_checkpoint during training "
          "(all ranks, rank 0 between barriers); overhead = save / interval as a share of the no-parity median step.")
    header = (f"{'ranks':>5}  {'method':<19}{'every':>6}{'save s':>8}{'overhead % step':>16}"
              f"{'steps lost avg / worst':>24}")
    print(header)
    print("-" * len(header))
    for devices, method, every, save_s, share, lost in rows:
        save = f"{save_s:.3f}" if save_s is not None else "-"
        print(f"{devices:>5}  {method:<19}{every:>6}{save:>8}{pct(share):>16}{lost:>24}")
    print("parity: (parity + capture sections) / no-parity step; parity e2e: no-parity throughput / parity throughput "
          "- 1 (noisy, includes everything parity changes). Parity recovers the last committed step.")
    print("\nparity overhead relative to checkpointing (section-measured overhead; e2e in brackets):")
    for run in (r for r in runs if r.parity is not None):
        base = next((r for r in runs if r.devices == run.devices and r.parity is None and r.saves), None)
        if base is None:
            continue
        parity = (run.parity_ms + run.capture_ms) / 1000
        e2e = max(base.step_s_median * (base.samples_per_s / run.samples_per_s - 1), 0.0)
        for backend, saves in base.saves.items():
            save_s = statistics.median(saves)
            parts = []
            for n in sorted({1, 10, run.parity[2]}):  # the commit interval N: checkpointing as often as parity commits
                ckpt = save_s / n
                parts.append(f"vs every {n:>2} step(s): {parity / ckpt:.3f} ({less(parity / ckpt)}) "
                             f"[{e2e / ckpt:.3f}]")
            print(f"  {run.devices} ranks {run.label} vs {backend:<13}: " + "; ".join(parts))


def print_drill(runs: list[Run]) -> None:
    for run in runs:
        d = run.drill
        if not d:
            continue
        decode = statistics.median(d["methods"]["decode"]["seconds"])
        print(f"\n3. Recovery of one lost rank: {run.devices} ranks, parity {run.label}, victim rank {d['victim']} "
              f"({d['victim_state_bytes'] / 2**20:.1f} MiB of coded state; {d['state_bytes'] / 2**20:.1f} MiB over all "
              f"ranks, parity {d['parity_bytes'] / 2**20:.1f} MiB); median of "
              f"{len(d['methods']['decode']['seconds'])}, the slowest rank's time.")
        header = f"{'method':<32}{'restores':<18}{'s':>8}{'vs decode':>10}  exact"
        print(header)
        print("-" * len(header))
        names = {"decode": f"parity decode (recover([{d['victim']}]))", "encode": "parity re-encode (encode())"}
        for method, m in d["methods"].items():
            seconds = statistics.median(m["seconds"])
            if method == "decode":
                restores = f"rank {d['victim']} (1 of {run.devices})"
            elif method == "encode":
                restores = "all parity"
            else:
                restores = f"all {run.devices} ranks"
            name = names.get(method, f"{method} load_checkpoint")
            print(f"{name:<32}{restores:<18}{seconds:>8.3f}{seconds / decode:>10.2f}  {'yes' if m['exact'] else 'NO'}")
        if "dcp" in d["methods"]:
            dcp = statistics.median(d["methods"]["dcp"]["seconds"])
            print(f"decode / dcp restore: {decode / dcp:.2f} (target <= 1: {'yes' if decode <= dcp else 'NO'})")
        for method, m in d["methods"].items():
            if "save_seconds" in m:
                print(f"  ({method} save of that checkpoint: {m['save_seconds'][0]:.3f} s)")
        print("vs decode: time / decode time (above 1: decode is faster). exact: training_state_digest and every "
              "rank's parity after == before the wipe. A checkpoint restore of a parity job also re-encodes the "
              "parity (last row). Checkpoints are read back from the page cache; one rank's coded state is "
              f"{d['victim_state_bytes'] / 2**20:.1f} MiB, decoding it reads k = {run.parity[0]} times as much from "
              "the survivors, and re-encoding its parity share as much again.")


def print_profiles(runs: list[Run]) -> None:
    for run in runs:
        if run.drill and run.drill.get("profile"):
            exact = "exact" if run.drill.get("profile_exact") else "NOT EXACT"
            print(f"\ncProfile of strategy.recover([{run.drill['victim']}]) on the victim rank, {run.devices} ranks "
                  f"{run.label}, one recovery ({exact}; top by cumulative time):")
            print(run.drill["profile"])
        if run.profile:
            print(f"\ncProfile of FaultManager.end_step on rank 0, {run.devices} ranks {run.label}, "
                  f"{run.profile_steps} steps (top by own time):")
            print(run.profile)


def merge(runs: list[Run]) -> Run:
    """One run's figures from its repeats: medians of the step times, means of the per-rank sections,
    every checkpoint save, the first profile and drill."""
    first = runs[0]
    per_rank = lambda name: [statistics.fmean(v) for v in zip(*(getattr(r, name) for r in runs))]  # noqa: E731
    saves: dict[str, list[float]] = {}
    for run in runs:
        for backend, times in run.saves.items():
            saves.setdefault(backend, []).extend(times)
    return Run(
        devices=first.devices, parity=first.parity, global_batch=first.global_batch, threads=first.threads,
        steps=sum(r.steps for r in runs),
        step_s_mean=statistics.fmean(r.step_s_mean for r in runs),
        step_s_median=statistics.median(r.step_s_median for r in runs),
        **{name: per_rank(name) for name in ("parity_s", "capture_s", "cpu_step_s", "cpu_parity_s", "cpu_capture_s",
                                               "delta_bytes")},
        capture_timed=first.capture_timed, saves=saves,
        profile=next((r.profile for r in runs if r.profile), None),
        profile_steps=next((r.profile_steps for r in runs if r.profile), 0),
        drill=next((r.drill for r in runs if r.drill), None),
        proc_cpu=[{key: statistics.fmean(r.proc_cpu[rank][key] for r in runs) for key in runs[0].proc_cpu[rank]}
                  for rank in range(len(first.proc_cpu))],
        wall_s=sum(r.wall_s for r in runs), tree_cpu_s=statistics.fmean(r.tree_cpu_s for r in runs), rounds=len(runs),
    )


def print_runs(done: list[tuple[int, Run]]) -> None:
    print("\nRuns in order (each its own process tree):")
    header = (f"{'run':>4}{'round':>6}  {'ranks':>5}  {'parity':<7}{'ms/step':>9}{'parity ms':>10}{'cpu ms':>8}"
              f"{'par cpu':>8}{'delta KiB':>10}{'saves s':>18}{'wall s':>8}")
    print(header)
    print("-" * len(header))
    for i, (round_, run) in enumerate(done, 1):
        parity = f"{run.parity_ms + run.capture_ms:.1f}" if run.parity else "-"
        cpu_parity = f"{run.cpu_parity_ms:.1f}" if run.parity else "-"
        delta = f"{statistics.fmean(run.delta_bytes) / 1024:.0f}" if run.parity else "-"
        saves = "/".join(f"{statistics.median(v):.2f}" for v in run.saves.values()) or "-"
        print(f"{i:>4}{round_:>6}  {run.devices:>5}  {run.label:<7}{run.step_ms:>9.1f}{parity:>10}"
              f"{run.cpu_step_ms:>8.1f}{cpu_parity:>8}{delta:>10}{saves:>18}{run.wall_s:>8.0f}")
    backends = next(("/".join(run.saves) for _, run in done if run.saves), "none")
    print("parity ms: parity + capture wall ms per step (mean over ranks); cpu ms, par cpu: CPU ms per step of a "
          "rank's process and of its post/finish_deltas + commit + capture; delta KiB: old XOR new bytes of the touched rows per step "
          f"and rank (each goes to r parity holders); saves s: median save per backend ({backends}).")


def record_costs(runs: list[Run], args: argparse.Namespace) -> None:
    """The costs the planner uses, per world size, into ``--history`` (key: the job's tables and batch): the step
    without parity, parity's per-step shares at r = 1 fitted to whole-process CPU per step at two or more commit
    intervals, a dcp save, and from the drill a decode (per source) and a dcp restore."""
    from lightning_dlrover.advisor.history import JobHistory, resolve_url
    from lightning_dlrover.planner import JobCosts
    from lightning_dlrover.planner.job import PlannedJob

    history = JobHistory(resolve_url(args.history))
    try:
        for base in (r for r in runs if r.parity is None):
            costs: dict[str, float] = {"step_s": base.step_s_median}
            if base.saves.get("dcp"):
                costs["save_s"] = statistics.median(base.saves["dcp"])
            cpu = {r.parity[2]: sum(p["timed"] for p in r.proc_cpu) for r in runs
                   if r.devices == base.devices and r.parity is not None and r.parity[1] == 1}
            if len(cpu) >= 2:
                costs["parity_capture"], costs["parity_commit"] = JobCosts.fit_parity(
                    sum(p["timed"] for p in base.proc_cpu), cpu)
            drilled = next((r for r in runs if r.devices == base.devices and r.drill), None)
            if drilled is not None:
                methods = drilled.drill["methods"]
                costs["decode_s"] = statistics.median(methods["decode"]["seconds"]) / drilled.parity[0]
                if "dcp" in methods:
                    costs["load_s"] = statistics.median(methods["dcp"]["seconds"])
            job = PlannedJob(((args.rows, args.dim),) * NUM_SPARSE, base.devices, 1, args.batch)
            history.add_costs(job.key(), costs)
            print(f"recorded in {args.history} for {base.devices} ranks (job key {job.key()}): "
                  + ", ".join(f"{k} {v:.4g}" for k, v in costs.items()))
    finally:
        history.close()


def orchestrate(args: argparse.Namespace) -> None:
    plan = [parse_run(None, run) for run in args.runs]
    drill_at = next((i for i, (d, p) in enumerate(plan) if p is not None and (d, p.k, p.r) == (3, 2, 1)),
                    next((i for i, (_, p) in enumerate(plan) if p is not None), None))
    start = time.perf_counter()
    done: list[tuple[int, Run]] = []
    by_run: dict[int, list[Run]] = {}
    for round_ in range(args.rounds):
        order = list(enumerate(plan)) if round_ % 2 == 0 else list(enumerate(plan))[::-1]
        for i, (devices, parity) in order:
            run = run_variant(args, devices, parity, drill_=round_ == 0 and i == drill_at)
            done.append((round_ + 1, run))
            by_run.setdefault(i, []).append(run)
            extra = f", parity {run.parity_ms + run.capture_ms:.1f} ms" if run.parity else ""
            print(f"round {round_ + 1}: {devices} ranks {run.label}: {run.step_ms:.1f} ms/step{extra} "
                  f"({run.wall_s:.0f} s)", file=sys.stderr, flush=True)
    runs = [merge(by_run[i]) for i in range(len(plan))]
    print_runs(done)
    print_throughput(runs, args)
    print_process_cpu(runs)
    print_checkpointing(runs, args)
    print_drill(runs)
    print_profiles(runs)
    if args.history:
        record_costs(runs, args)
    print(f"\nwall {time.perf_counter() - start:.0f} s; malloc {args.malloc}; rounds {args.rounds}; "
          f"runs: {' '.join(args.runs)}")


def main() -> None:
    args = parse_args()
    quiet()
    if args.variant == "train":
        run_train(args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
