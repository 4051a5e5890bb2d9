"""Per-step parity cost against its floor, measured in the same run on the same rows.

A real multi-process DLRM job (Lightning's popen launcher re-runs this script per rank; gloo on CPU,
``DLRoverStrategy(parity=ParityConfig(k, r, N))``, 26 tables of ``--rows`` x ``--dim``, row-wise Adagrad).
For every timed commit this script measures, on every rank:

- **ours**: ``CodedEmbeddings.post_deltas`` + ``finish_deltas`` (row deltas to the parity holders, folded into their parity)
  plus the vote and the decision (``CodedEmbeddings.vote`` + ``decide``), wall and CPU time of the process;
- **floor**: the unavoidable work for the same commit's rows, done right before ours on the same
  touched rows: one gather of the rows' old and one of their new bytes (``index_select``), one XOR, one
  ``all_to_all_single`` of exactly the bytes ours sends to each rank, one ``update_rows`` per received
  block into a scratch parity.

The floor's gathers read the live tables (the old bytes come from the undo log in ours: the same amount
of memory traffic). Ratios ours / floor are per rank and step, then the median; the table also gives the
bytes each rank sends per commit. The machine is shared (2 cores): compare the ratio, not milliseconds.

    PYTHONPATH=. python bench/bench_parity_floor.py                      # 3 ranks k2r1 and 4 ranks k2r2, N = 1
    PYTHONPATH=. python bench/bench_parity_floor.py --runs 4:2,1,16      # ranks:k,r[,N]
    PYTHONPATH=. python bench/bench_parity_floor.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_dlrover import DLRoverStrategy, ParityConfig
from lightning_dlrover.data import DLRMDataModule
from lightning_dlrover.fault.coding.coded_state import INT_OF_SIZE
from lightning_dlrover.models import DLRMModule
from lightning_dlrover.parity import ReedSolomonCode, as_bytes

RESULT = "FLOOR_RESULT "


class Timed:
    """Wall and process-CPU seconds of a block."""

    def __enter__(self) -> "Timed":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


class FloorProbe(pl.Callback):
    """Times ours (post_deltas + finish_deltas + vote + decide) and the floor on the same rows of every timed commit."""

    def __init__(self, warmup: int, commits: int, every: int) -> None:
        self.first, self.last = warmup * every, (warmup + commits) * every  # timed commits: global steps in (first, last]
        self.ours: list[tuple[float, float]] = []
        self.floor: list[tuple[float, float]] = []
        self.sent: list[int] = []
        self._pending: Timed | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        coded = trainer.strategy.fault.coded
        self.coded, self.code = coded, ReedSolomonCode(coded.placement.k, coded.placement.r)
        self.scratch = torch.zeros_like(coded.parity)
        post, finish, vote, decide = coded.post_deltas, coded.finish_deltas, coded.vote, coded.decide

        def timed_post() -> None:
            with Timed() as t:
                post()
            self._pending = t

        def add(t: Timed) -> None:
            if self._pending is not None:
                self._pending.wall += t.wall
                self._pending.cpu += t.cpu

        def timed_finish() -> None:
            with Timed() as t:
                finish()
            add(t)

        def timed_vote(*args: Any) -> Any:
            with Timed() as t:
                out = vote(*args)
            add(t)
            return out

        def timed_decide(*args: Any) -> None:
            with Timed() as t:
                decide(*args)
            add(t)
            if self._pending is not None and self._timed(trainer):
                self.ours.append((self._pending.wall, self._pending.cpu))
            self._pending = None

        coded.post_deltas, coded.finish_deltas, coded.vote, coded.decide = timed_post, timed_finish, timed_vote, timed_decide

    def _timed(self, trainer: pl.Trainer) -> bool:
        return self.first < trainer.global_step <= self.last

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        """Runs the floor on this commit's rows (the commit itself runs after every callback)."""
        n = trainer.strategy.parity.commit_every_n_steps
        if trainer.global_step - trainer.strategy.committed_step < n:
            return  # no commit at this step
        sent, wall, cpu = self._floor()
        if self._timed(trainer):
            self.floor.append((wall, cpu))
            self.sent.append(sent)

    def _floor(self) -> tuple[int, float, float]:
        """Bytes sent, and wall and CPU seconds of the floor's passes (gathers + XOR, the exchange, the update;
        not the bookkeeping between them: finding the destinations, concatenating the payload, the sizes)."""
        coded, state, placement = self.coded, self.coded.state, self.coded.placement
        me, world = dist.get_rank(), dist.get_world_size()
        blocks: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {d: [] for d in range(world)}
        deltas, touched = {}, {index: rows for index, rows, _ in state.touched()}
        with Timed() as compute:
            for index, rows in touched.items():
                segment = state.segments[index]
                old = segment.tensor.index_select(0, rows)
                new = segment.tensor.index_select(0, rows)
                words = INT_OF_SIZE[old.element_size()]
                new.view(words).bitwise_xor_(old.view(words))
                deltas[index] = as_bytes(new.reshape(len(rows), -1))
        for index, delta in deltas.items():
            rows = touched[index]
            chunks, slots = state.locate(index, rows)  # rows are sorted: each chunk's rows are one slice
            first, last = int(chunks[0]), int(chunks[-1])
            bounds = torch.searchsorted(chunks, torch.arange(first, last + 2)).tolist()
            for chunk, lo, hi in zip(range(first, last + 1), bounds, bounds[1:]):
                group = placement.group_of_chunk(me, chunk)
                for p in range(placement.r):
                    blocks[placement.parity_rank(group, p)].append((p, chunk, slots[lo:hi], delta[lo:hi]))
        send_bytes = [sum(d.numel() for _, _, _, d in blocks[dst]) for dst in range(world)]
        payload = torch.cat([d.reshape(-1) for dst in range(world) for _, _, _, d in blocks[dst]] or
                            [torch.empty(0, dtype=torch.uint8)])
        counts = torch.tensor(send_bytes, dtype=torch.int64)
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts)  # the floor is told the sizes: this collective is not counted
        out = torch.empty(int(incoming.sum()), dtype=torch.uint8)
        splits = incoming.tolist()
        with Timed() as exchange:
            dist.all_to_all_single(out, payload, splits, send_bytes)
        width = state.segments[0].row_bytes
        received_rows = out.numel() // max(1, width)
        rows = torch.arange(received_rows, dtype=torch.int64) % (coded.parity.shape[1] // width)
        with Timed() as update:  # one update_rows over the received bytes, as rows of the first segment's width
            if received_rows:
                self.code.update_rows(self.scratch[0:1], 0, rows, out[: received_rows * width].view(-1, width),
                                      parity_ids=[placement.k], check_rows=False)
        parts = (compute, exchange, update)
        return sum(send_bytes), sum(t.wall for t in parts), sum(t.cpu for t in parts)

    def result(self) -> dict[str, Any]:
        return {"ours": self.ours, "floor": self.floor, "sent": self.sent}


def run_rank(args: argparse.Namespace) -> None:
    parity = ParityConfig.parse(args.parity)
    k, r, n = parity.k, parity.r, parity.commit_every_n_steps
    sizes = [args.rows] * 26
    commits = args.steps if n == 1 else max(3, args.steps // 3)
    probe = FloorProbe(args.warmup, commits, n)
    strategy = DLRoverStrategy(sharding_types=["table_wise"], parity=parity, print_digest=False)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                         max_steps=probe.last + 1, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[probe])
    model = DLRMModule(sizes, embedding_dim=args.dim, dense_arch_layer_sizes=[128, args.dim])
    trainer.fit(model, DLRMDataModule(sizes, global_batch_size=args.batch, train_batches=10_000, val_batches=0))
    gathered = [None] * trainer.world_size
    dist.all_gather_object(gathered, probe.result())
    if trainer.is_global_zero:
        print(RESULT + json.dumps({"devices": args.devices, "parity": [k, r, n, parity.overlap], "ranks": gathered}), flush=True)


def summarize(result: dict[str, Any]) -> list[str]:
    ratios_wall, ratios_cpu, ours_cpu, floor_cpu, sent = [], [], [], [], []
    for rank in result["ranks"]:
        for (ow, oc), (fw, fc) in zip(rank["ours"], rank["floor"]):
            ratios_wall.append(ow / fw)
            ratios_cpu.append(oc / fc)
            ours_cpu.append(oc)
            floor_cpu.append(fc)
        sent += rank["sent"]
    k, r, n, overlap = result["parity"]
    label = f"k{k}r{r}" + (f"n{n}" if n > 1 else "") + ("" if overlap else "s")
    target = 1.3
    med = statistics.median
    return [f"{result['devices']:>5}  {label:<8}{med(sent) / 2**20:>11.2f}{1000 * med(ours_cpu):>10.1f}"
            f"{1000 * med(floor_cpu):>10.1f}{med(ratios_cpu):>9.2f}{med(ratios_wall):>9.2f}{target:>8.1f}  "
            f"{'yes' if med(ratios_cpu) <= target else 'NO'}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=["3:2,1", "4:2,2"], metavar="RANKS:K,R[,N]")
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4104)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke test")
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parity", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.dim, args.batch, args.warmup, args.steps = 2000, 16, 480, 2, 4
    if args.variant == "rank":
        run_rank(args)
        return
    started = time.time()
    header = f"{'ranks':>5}  {'parity':<8}{'MiB/commit':>11}{'ours ms':>10}{'floor ms':>10}{'x cpu':>9}{'x wall':>9}{'target':>8}  ok"
    lines = []
    for spec in args.runs:
        devices, parity = spec.split(":")
        command = [sys.executable, os.path.abspath(__file__), "--variant", "rank", "--devices", devices,
                   "--parity", parity, "--rows", str(args.rows), "--dim", str(args.dim), "--batch", str(args.batch),
                   "--warmup", str(args.warmup), "--steps", str(args.steps)]
        out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        found = [line for line in out.stdout.splitlines() if line.startswith(RESULT)]
        if out.returncode != 0 or not found:
            sys.exit(f"run {spec} failed (exit {out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
        lines += summarize(json.loads(found[-1][len(RESULT):]))
        print(f"{spec}: done ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
    print(f"\nParity per commit vs its floor: DLRM 26 x {args.rows} x {args.dim}, global batch {args.batch}, gloo on CPU, "
          f"median over ranks and {args.steps} commits after {args.warmup} (N > 1: a third of them, of N steps each).")
    print(header)
    print("-" * len(header))
    print("\n".join(lines))
    print("ours: post_deltas + finish_deltas + vote + decide, CPU ms of the process per commit; floor: index_select of old and new rows, XOR, "
          "all_to_all_single of the same bytes per destination, update_rows of the received bytes (sizes exchanged "
          "beforehand, not counted); x cpu / x wall: ours / floor per rank and commit, median. Target: <= 1.3x. A trailing s: overlap=False.")
    print(f"wall {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
