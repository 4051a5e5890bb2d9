"""What DDP's bucket policies cost per step on the demo DLRM (``configs/demo.yaml``'s model and global batch), 2 ranks.

The strategy needs DDP's buckets fixed for bit-exact resumes (``lightning_dlrover/strategy/sharding.py``,
``DDP_BUCKETS``). The policies, each a ``DistributedModelParallel`` of the same model in the same processes:

- ``per_parameter`` (the strategy's): every dense parameter its own bucket (``bucket_cap_mb_list=[0]``);
- ``find_unused``: ``find_unused_parameters=True`` (DDP then never rebuilds its buckets, but traverses the
  autograd graph after every forward);
- ``rebuilt``: DDP's default (one bucket rebuilt after the first step; not bit-exact after a resume), the baseline.

Each rank (gloo on CPU, ``torch.multiprocessing.spawn``) builds the three, then runs ``--rounds`` rounds; a round
runs every policy for ``--steps`` steps in ABBA order (the order reversed every other round) after ``--warmup``
steps of each. A step: forward, BCE loss, backward (the fused embedding optimizer runs in it), dense Adagrad step,
``zero_grad``. Rank 0 records per step the wall time and its process's CPU time (all threads, gloo's included),
and prints the medians per policy and their ratios to ``rebuilt``, as a table.

    PYTHONPATH=. python bench/bench_ddp_buckets.py                 # about a minute on 2 cores
    PYTHONPATH=. python bench/bench_ddp_buckets.py --rounds 2 --steps 10
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torchrec.optim.optimizers import in_backward_optimizer_filter

from lightning_dlrover.data import ResumableLoader
from lightning_dlrover.data.sources import SyntheticCriteo
from lightning_dlrover.models import DLRMModule
from lightning_dlrover.strategy.sharding import (
    build_constraints,
    distribute,
    embedding_tables,
    plan_sharding,
)

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml")
POLICIES = ("rebuilt", "find_unused", "per_parameter")


def quiet() -> None:
    """The bench's own output only (the find_unused warning is the subject, not news)."""
    for name in ("lightning", "torchrec", "torch.distributed", "torch.fx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def build(policy: str, config: dict, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """The demo DLRM sharded as the demo shards it, its dense part in DDP under ``policy``; the dense optimizer and
    the number of DDP buckets."""
    torch.manual_seed(0)
    model = DLRMModule(**config["model"])
    strategy = config["trainer"]["strategy"]["init_args"]
    constraints = build_constraints(embedding_tables(model), strategy["sharding_types"], "fused", {}, "gloo")
    plan = plan_sharding(model, constraints, torch.device("cpu"), local_world_size=world_size)
    dmp = distribute(model, plan, torch.device("cpu"), buckets=policy)
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    ddp = dmp._dmp_wrapped_module
    buckets = len(ddp._get_ddp_logging_data().get("bucket_sizes", "").split(","))
    return dmp, torch.optim.Adagrad(dense, lr=config["model"]["dense_lr"]), buckets


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    quiet()
    world_size = 2
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    with open(CONFIG) as f:
        config = yaml.safe_load(f)
    built = {policy: build(policy, config, world_size) for policy in POLICIES}
    sizes, global_batch = config["model"]["num_embeddings_per_feature"], config["data"]["global_batch_size"]
    total = (args.warmup + args.steps) * len(POLICIES) * args.rounds
    source = SyntheticCriteo(sizes, global_batch * total, seed=0)
    batches = iter(ResumableLoader(source, rank, world_size, global_batch))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    wall: dict[str, list[float]] = {p: [] for p in POLICIES}
    cpu: dict[str, list[float]] = {p: [] for p in POLICIES}
    for round_ in range(args.rounds):
        for policy in POLICIES if round_ % 2 == 0 else reversed(POLICIES):
            dmp, optimizer, _ = built[policy]
            for step in range(args.warmup + args.steps):
                batch = next(batches)
                w0, c0 = time.perf_counter(), time.process_time()
                loss_fn(dmp(batch), batch.labels).backward()
                optimizer.step()
                optimizer.zero_grad()
                if step >= args.warmup:
                    wall[policy].append(time.perf_counter() - w0)
                    cpu[policy].append(time.process_time() - c0)
    if rank == 0:
        base_wall, base_cpu = statistics.median(wall["rebuilt"]), statistics.median(cpu["rebuilt"])
        print(f"demo DLRM, 2 ranks (gloo, CPU), {torch.get_num_threads()} threads per rank, "
              f"global batch {global_batch}, "
              f"{args.rounds} rounds x {args.steps} steps per policy (medians of rank 0's steps)")
        print("| policy | DDP buckets | wall ms/step | CPU ms/step | wall / rebuilt | CPU / rebuilt "
              "| bit-exact resume |")
        print("|---|---|---|---|---|---|---|")
        for policy in POLICIES:
            w, c = statistics.median(wall[policy]), statistics.median(cpu[policy])
            exact = "no" if policy == "rebuilt" else "yes"
            print(f"| {policy} | {built[policy][2]} | {w * 1e3:.2f} | {c * 1e3:.2f} | {w / base_wall:.3f} | "
                  f"{c / base_cpu:.3f} | {exact} |")
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    mp.spawn(worker, args=(args, free_port()), nprocs=2, join=True)


if __name__ == "__main__":
    main()
