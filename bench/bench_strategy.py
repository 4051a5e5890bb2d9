"""Training throughput of DLRoverStrategy beside a hand-written TorchRec loop on the same model and data.

Both variants train the same DLRM (26 tables of ``--rows`` x ``--dim``, fused row-wise Adagrad on
the tables, Adagrad on the MLPs) on the same ``SyntheticCriteo`` stream, with ``--devices`` ranks
over gloo on CPU, every table sharded ``table_wise``, and ``cpu_count // devices`` threads per rank:

- ``lightning``: ``Trainer(strategy=DLRoverStrategy(print_digest=False))`` with ``DLRMModule`` and
  ``DLRMDataModule``; logger, progress bar, checkpointing and model summary disabled. Lightning's
  popen launcher starts the ranks (it re-runs this script).
- ``loop``: ``torch.multiprocessing.spawn``, ``init_process_group("gloo")``, TorchRec's ``DLRM``,
  ``EmbeddingShardingPlanner`` and ``DistributedModelParallel``, and a plain loop: forward, BCE loss,
  backward, dense ``Adagrad`` step, ``zero_grad``.

Each variant runs in its own process tree, ``--warmup`` steps and then ``--steps`` timed steps: wall
clock, CPU time and minor page faults of rank 0's process between the ends of step ``warmup`` and of
the last step. CPU time counts the work done whatever else runs on the machine, so it separates real
overhead from a busy neighbour better than wall time.

The page faults matter: with glibc's default malloc, a process may hand the freed activation
buffers back to the kernel at every step and fault them in again (thousands of faults and 10-25 ms
of system time per step here, varying from one process to the next with its heap layout). Each
variant therefore also runs with ``--malloc tuned``: ``GLIBC_TUNABLES`` raising glibc's mmap and
trim thresholds, which keeps those buffers in the heap.

Without ``--variant`` the script orchestrates: it runs each variant ``--rounds`` times per malloc
setting in ABBA order (lightning, loop, loop, lightning, ...), parses the ``BENCH_RESULT {json}``
line each run prints, and prints a table per run and the medians per malloc setting and variant,
with the throughput ratio to the loop under the same malloc setting.

    PYTHONPATH=. python bench/bench_strategy.py              # about 2 minutes on 2 cores
    PYTHONPATH=. python bench/bench_strategy.py --quick      # tiny model, a few steps, one round
    PYTHONPATH=. python bench/bench_strategy.py --variant loop --steps 20   # one variant, result line only
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, replace

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.models.dlrm import DLRM
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from lightning_dlrover import DLRoverStrategy
from lightning_dlrover.data import DLRMDataModule, ResumableLoader
from lightning_dlrover.data.sources import NUM_DENSE, NUM_SPARSE, SPARSE_NAMES, SyntheticCriteo
from lightning_dlrover.models import DLRMModule
from lightning_dlrover.models.dlrm import table_name

VARIANTS = ("lightning", "loop")
# Raising both thresholds turns off glibc's dynamic ones: buffers up to 64 MiB come from the heap, and
# the heap keeps up to 512 MiB of free memory instead of returning it to the kernel.
MALLOC_SETTINGS = {
    "system": None,
    "tuned": "glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=536870912",
}
RESULT_TAG = "BENCH_RESULT"
LR = 0.05  # DLRMModule's default embedding and dense learning rates
SEED = 0


@dataclass
class Result:
    """Steady-state timing of one run of one variant."""

    variant: str
    steps: int
    seconds: float
    cpu_seconds: float
    page_faults: int
    global_batch: int
    threads: int
    malloc: str = ""

    @property
    def samples_per_s(self) -> float:
        return self.steps * self.global_batch / self.seconds

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / self.steps

    @property
    def cpu_ms_per_step(self) -> float:
        return 1000 * self.cpu_seconds / self.steps

    @property
    def faults_per_step(self) -> float:
        return self.page_faults / self.steps


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=VARIANTS, help="run one variant and print its result line")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of each variant per malloc setting, ABBA order (default: 2)")
    parser.add_argument("--malloc", choices=[*MALLOC_SETTINGS, "both"], default="both",
                        help="glibc malloc settings to run under: the environment's (system), tuned, or both")
    parser.add_argument("--devices", type=int, default=2, help="ranks (default: 2)")
    parser.add_argument("--rows", type=int, default=100_000, help="rows of each of the 26 tables (default: 100000)")
    parser.add_argument("--dim", type=int, default=64, help="embedding dimension (default: 64)")
    parser.add_argument("--batch", type=int, default=4096, help="global batch size (default: 4096)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first, at least 1 (default: 5)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (default: 30)")
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps, one round: a smoke test")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    if args.quick:
        args.rows, args.dim, args.batch, args.warmup, args.steps, args.rounds = 1000, 16, 256, 2, 5, 1
    return args


def model_kwargs(args: argparse.Namespace) -> dict:
    """The DLRM shape shared by both variants (``configs/benchmark.yaml``'s MLPs)."""
    return {
        "embedding_dim": args.dim,
        "dense_arch_layer_sizes": [256, args.dim],
        "over_arch_layer_sizes": [256, 128, 1],
    }


Clock = tuple[float, float, int]


def clock() -> Clock:
    """Wall-clock seconds, CPU seconds (all threads of this process) and its minor page faults so far."""
    return time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def report(variant: str, args: argparse.Namespace, ends: list[Clock]) -> None:
    """Prints the result line of a run from the :func:`clock` at the end of each step (warm-up included)."""
    (wall_0, cpu_0, faults_0), (wall_1, cpu_1, faults_1) = ends[args.warmup - 1], ends[-1]
    steps = len(ends) - args.warmup
    threads = torch.get_num_threads()
    result = Result(variant, steps, wall_1 - wall_0, cpu_1 - cpu_0, faults_1 - faults_0, args.batch, threads)
    print(f"{RESULT_TAG} {json.dumps(vars(result))}", flush=True)


def quiet() -> None:
    """Silences per-run info logs and warnings of Lightning and TorchRec."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torchrec", "torch.distributed", "torch.fx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


# --- variant "lightning" ---------------------------------------------------------------------------------


class StepClock(pl.Callback):
    """Records the :func:`clock` at the end of every training step."""

    def __init__(self) -> None:
        self.ends: list[Clock] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.ends.append(clock())


def run_lightning(args: argparse.Namespace) -> None:
    pl.seed_everything(SEED, verbose=False)
    step_clock = StepClock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=DLRoverStrategy(sharding_types=["table_wise"], print_digest=False),
        max_steps=args.warmup + args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[step_clock],
    )
    sizes = [args.rows] * NUM_SPARSE
    model = DLRMModule(sizes, embedding_lr=LR, dense_lr=LR, **model_kwargs(args))
    data = DLRMDataModule(
        sizes, global_batch_size=args.batch, train_batches=args.warmup + args.steps, val_batches=0, seed=SEED
    )
    trainer.fit(model, data)
    if trainer.is_global_zero:
        report("lightning", args, step_clock.ends)


# --- variant "loop" --------------------------------------------------------------------------------------


def build_dlrm(args: argparse.Namespace) -> DLRM:
    """TorchRec's DLRM with meta-device tables and a fused row-wise Adagrad on them, as ``DLRMModule`` builds it."""
    kwargs = model_kwargs(args)
    tables = [
        EmbeddingBagConfig(
            name=table_name(feature), embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[feature]
        )
        for feature in SPARSE_NAMES
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=kwargs["dense_arch_layer_sizes"],
        over_arch_layer_sizes=kwargs["over_arch_layer_sizes"],
    )
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": LR})
    return model


def shard(model: DLRM, world_size: int) -> DistributedModelParallel:
    """Plans every table ``table_wise`` with the fused kernel and wraps the model in DMP (collective)."""
    device = torch.device("cpu")
    topology = Topology(world_size=world_size, compute_device=device.type, local_world_size=world_size)
    constraints = {
        table_name(feature): ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
        for feature in SPARSE_NAMES
    }
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    plan = planner.collective_plan(model, get_default_sharders(), dist.GroupMember.WORLD)
    return DistributedModelParallel(module=model, device=device, plan=plan)


def loop_worker(rank: int, args: argparse.Namespace, port: int) -> None:
    """One rank of the hand-written loop."""
    quiet()
    world_size = args.devices
    if "OMP_NUM_THREADS" not in os.environ:  # as Lightning's launcher does for its ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(SEED)
    dmp = shard(build_dlrm(args), world_size)
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    optimizer = torch.optim.Adagrad(dense, lr=LR)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    source = SyntheticCriteo([args.rows] * NUM_SPARSE, args.batch * (args.warmup + args.steps), seed=SEED)
    ends = []
    for batch in ResumableLoader(source, rank, world_size, args.batch):
        logits = dmp(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss_fn(logits, batch.labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        ends.append(clock())
    if rank == 0:
        report("loop", args, ends)
    dist.barrier()  # no rank tears down the process group while another still uses it
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_loop(args: argparse.Namespace) -> None:
    mp.spawn(loop_worker, args=(args, free_port()), nprocs=args.devices, join=True)


# --- orchestration ---------------------------------------------------------------------------------------


def run_variant(variant: str, malloc: str, args: argparse.Namespace) -> Result:
    """Runs ``variant`` in a fresh process tree under the ``malloc`` setting and parses its result line."""
    forwarded = ["--devices", args.devices, "--rows", args.rows, "--dim", args.dim, "--batch", args.batch,
                 "--warmup", args.warmup, "--steps", args.steps]
    command = [sys.executable, os.path.abspath(__file__), "--variant", variant, *map(str, forwarded)]
    env = dict(os.environ)
    if MALLOC_SETTINGS[malloc] is not None:
        env["GLIBC_TUNABLES"] = MALLOC_SETTINGS[malloc]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if done.returncode or not lines:
        sys.stderr.write(done.stdout + done.stderr)
        raise RuntimeError(f"variant {variant!r} failed (exit code {done.returncode}); its output is above.")
    return replace(Result(**json.loads(lines[-1].removeprefix(RESULT_TAG))), malloc=malloc)


def schedule(rounds: int, mallocs: list[str]) -> list[tuple[str, str]]:
    """(variant, malloc) runs: per malloc setting lightning, loop, then loop, lightning, ... (ABBA)."""
    return [
        (variant, malloc)
        for r in range(rounds)
        for malloc in mallocs
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1])
    ]


def medians(results: list[Result], variant: str, malloc: str) -> tuple[float, float, float]:
    """Median ms/step, CPU ms/step and page faults/step of ``variant``'s runs under ``malloc``."""
    runs = [r for r in results if (r.variant, r.malloc) == (variant, malloc)]
    return (
        statistics.median(r.ms_per_step for r in runs),
        statistics.median(r.cpu_ms_per_step for r in runs),
        statistics.median(r.faults_per_step for r in runs),
    )


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    print(f"\nDLRM 26 x {args.rows} x {args.dim}, global batch {args.batch}, {args.devices} ranks (gloo, CPU, "
          f"{results[0].threads} thread(s) each), table_wise; {args.steps} timed steps after {args.warmup}.")
    header = (f"{'run':>4}  {'variant':<10}{'malloc':<8}{'samples/s':>10}{'ms/step':>9}{'cpu ms/step':>12}"
              f"{'faults/step':>12}{'x loop':>8}{'cpu x loop':>11}")
    print(header)
    print("-" * len(header))
    for i, r in enumerate(results, 1):
        print(f"{i:>4}  {r.variant:<10}{r.malloc:<8}{r.samples_per_s:>10.0f}{r.ms_per_step:>9.1f}"
              f"{r.cpu_ms_per_step:>12.1f}{r.faults_per_step:>12.0f}")
    for malloc in dict.fromkeys(r.malloc for r in results):
        loop_ms, loop_cpu_ms, _ = medians(results, "loop", malloc)
        for variant in VARIANTS:
            ms, cpu_ms, faults = medians(results, variant, malloc)
            print(f"{'med':>4}  {variant:<10}{malloc:<8}{1000 * args.batch / ms:>10.0f}{ms:>9.1f}{cpu_ms:>12.1f}"
                  f"{faults:>12.0f}{loop_ms / ms:>8.3f}{loop_cpu_ms / cpu_ms:>11.3f}")
    print("x loop: throughput relative to the loop under the same malloc setting (medians); cpu ms/step and "
          "faults/step: CPU time and minor page faults of rank 0's process.")


def main() -> None:
    args = parse_args()
    quiet()
    if args.variant == "lightning":
        run_lightning(args)
    elif args.variant == "loop":
        run_loop(args)
    else:
        mallocs = list(MALLOC_SETTINGS) if args.malloc == "both" else [args.malloc]
        results = []
        for variant, malloc in schedule(args.rounds, mallocs):
            results.append(run_variant(variant, malloc, args))
            print(f"{variant} ({malloc} malloc): {results[-1].ms_per_step:.1f} ms/step", file=sys.stderr, flush=True)
        print_table(results, args)


if __name__ == "__main__":
    main()
