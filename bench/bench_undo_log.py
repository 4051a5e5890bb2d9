"""CPU cost of the undo log behind per-step parity (``CodedState``), old against new, beside its floor.

One process (gloo, world size 1, a file store), a real TorchRec model: an ``EmbeddingBagCollection`` of ``--tables``
tables of ``--rows`` x ``--dim`` fp32 with fused row-wise Adagrad, table-wise under ``DistributedModelParallel``,
trained on the power-law ids of ``SyntheticCriteo`` (``alpha`` 1.5, ``--batch`` ids per table per step: what one
rank of a table-wise job receives). One thread (``torch.set_num_threads(1)``).

For every commit window ``N`` of ``--windows`` (``ParityConfig.commit_every_n_steps``) three ``CodedState``s run
on the same model and the same steps: **old** (the undo log before issue #10's fourth pass, kept in this script:
``torch.unique``, a seen-mask, one ``index_select`` per step and segment into a fresh tensor, merged at the commit by
concatenation, ``argsort`` and reordering), **new** (``lightning_dlrover.fault.coding.undo_log.UndoLog`` with its C
kernels) and **new-torch** (the same without the C kernels: the fallback when the extension is not built). A
single forward pre-hook on the fused kernels calls each state's ``CodedState._touch`` in turn, the order rotating
every step, and times it (process CPU time). At the end of each window, in rotating order again, each state is
read as ``CodedEmbeddings.post_deltas`` reads it and cleared: old ``touched()`` (the merge) and one gather-XOR
pass of the current rows against the aligned old rows (``gather_xor``), new ``logged()`` and the same pass reading
the old rows in place (``gather_xor_at``), then ``commit()``. Every window the three must agree: the same rows in
the same order with the same committed bytes, and the same deltas.

**floor**, timed the same way on the same rows: per step one ``index_select`` of every segment at that step's
first-touch rows (the rows the window has not logged yet, deduplicated outside the timing) into preallocated
buffers; per window one gather-XOR pass of the window's rows against their old rows already aligned (the bytes a
delta needs, read once). Columns are ms of CPU per training step (window costs divided by ``N``), medians over
the timed windows; ``x floor`` is total / floor's total, ``x old`` total / old's total. ``step`` is the forward +
backward of the model alone (the captures' time taken out), for scale.

    PYTHONPATH=. python bench/bench_undo_log.py                  # 7 x 50000 x 64, batch 4104, N = 1, 4, 16
    PYTHONPATH=. python bench/bench_undo_log.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_dlrover.data.sources import SyntheticCriteo
from lightning_dlrover.fault.coding.coded_state import INT_OF_SIZE, CodedState
from lightning_dlrover.parity import cpu as gf_cpu
from lightning_dlrover.strategy.sharding import plan_sharding
from lightning_dlrover.torchrec_glue import fused_embedding_kernels


class OldCodedState(CodedState):
    """The undo log as it was before this pass (baseline): per-step parts merged in row order when read."""

    def __init__(self, module: torch.nn.Module, k: int) -> None:
        super().__init__(module, k)
        self._touched: dict[int, list[Tensor]] = {}
        self._undo: dict[int, list[Tensor]] = {}
        self._seen: dict[int, Tensor] = {}

    def _touch(self, table: int, ids: Tensor) -> None:
        rows = torch.unique(ids.to(torch.int64))
        seen = self._seen.get(table)
        if seen is None:
            rows_of_table = self.segments[self._segments_of_table[table][0]].rows
            seen = self._seen[table] = torch.zeros(rows_of_table, dtype=torch.bool)
        if table in self._touched:
            rows = rows[~seen[rows]]
        if not rows.numel():
            return
        seen[rows] = True
        self._touched.setdefault(table, []).append(rows)
        for index in self._segments_of_table[table]:
            self._undo.setdefault(index, []).append(self.segments[index].tensor.index_select(0, rows))

    def touched(self) -> list[tuple[int, Tensor, Tensor]]:
        for table, parts in self._touched.items():
            if len(parts) > 1:
                rows = torch.cat(parts)
                order = torch.argsort(rows)
                self._touched[table] = [rows[order]]
                for j in self._segments_of_table[table]:
                    if j in self._undo:
                        self._undo[j] = [torch.cat(self._undo[j])[order]]
        return [(index, self._touched[self.segments[index].table][0], old[0]) for index, old in self._undo.items()]

    def commit(self) -> None:
        for table, parts in self._touched.items():
            for rows in parts:
                self._seen[table][rows] = False
        self._touched.clear()
        self._undo.clear()


class TorchCodedState(CodedState):
    """The new undo log without the C kernels (the fallback of a build without the extension)."""

    def __init__(self, module: torch.nn.Module, k: int) -> None:
        super().__init__(module, k)
        for log in self._logs.values():
            log._raw = False


def cpu_ms(fn, *args):
    start = time.process_time()
    out = fn(*args)
    return 1000 * (time.process_time() - start), out


def gather_xor(segment, rows: Tensor, out: Tensor, old: Tensor | None = None, at: Tensor | None = None,
               log: Tensor | None = None, kernels: bool = True) -> None:
    """One delta pass over a segment's rows, as ``post_deltas`` makes it: ``out = table[rows] ^ old`` (old rows
    aligned) or ``^ log[at]`` (read in place); with ``kernels=False`` the torch fallback."""
    table, n, width = segment.tensor, len(rows), segment.row_bytes
    if kernels and at is not None:
        gf_cpu.gather_xor_at_raw(out.data_ptr(), table.data_ptr(), segment.rows, rows.data_ptr(), n, log.data_ptr(),
                                 log.shape[0], at.data_ptr(), width)
    elif kernels:
        gf_cpu.gather_xor_raw(out.data_ptr(), table.data_ptr(), segment.rows, rows.data_ptr(), n, old.data_ptr(), width)
    else:
        old = old if old is not None else log.index_select(0, at)
        view = out[: n * width].view(table.dtype).view(n, *table.shape[1:])
        torch.index_select(table, 0, rows, out=view)
        kind = INT_OF_SIZE[view.element_size()]  # as post_deltas: whole elements
        view.view(kind).bitwise_xor_(old.view(kind))


def build_model(args: argparse.Namespace) -> DistributedModelParallel:
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows,
                                 feature_names=[f"f{i}"]) for i in range(args.tables)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.01})
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
                   for i in range(args.tables)}
    plan = plan_sharding(ebc, constraints, torch.device("cpu"), local_world_size=1)
    return DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                    device=torch.device("cpu"), plan=plan)


def run(args: argparse.Namespace) -> list[str]:
    dmp = build_model(args)
    impls = ["old", "new", "new-torch", "floor"]
    kinds = {"old": OldCodedState, "new": CodedState, "new-torch": TorchCodedState}
    states = {(n, impl): kinds[impl](dmp, k=2) for n in args.windows for impl in kinds}
    for state in states.values():
        state.close()  # our own hook drives them
    probe = states[args.windows[0], "new"]
    segments = probe.segments
    tables_of = {t: [i for i, s in enumerate(segments) if s.table == t] for t in range(args.tables)}
    # The floor's own log: each window's first-touch rows per table and their values, in preallocated buffers.
    floor_seen = {n: [torch.zeros(args.rows, dtype=torch.bool) for _ in range(args.tables)] for n in args.windows}
    floor_rows = {n: [[] for _ in range(args.tables)] for n in args.windows}
    floor_log = {n: {i: torch.empty((min(args.rows, args.batch * n), *s.tensor.shape[1:]), dtype=s.tensor.dtype)
                     for i, s in enumerate(segments)} for n in args.windows}
    delta_out = torch.empty(max(s.rows * s.row_bytes for s in segments), dtype=torch.uint8)
    step_cost = defaultdict(float)  # (n, impl) -> ms in the current window
    windows = defaultdict(list)  # (n, impl, part) -> per-step ms of each timed window
    counter = {"step": 0, "capture": 0.0}

    def hook(module, hook_args) -> None:
        if not torch.is_grad_enabled():
            return
        ids = [v.to(torch.int64) for v in hook_args[0].values().split(hook_args[0].length_per_key())]
        fresh = {}
        for n in args.windows:  # the floor's first-touch rows: deduplicated outside the timing
            for t, table_ids in enumerate(ids):
                rows = torch.unique(table_ids)
                fresh[n, t] = rows[~floor_seen[n][t][rows]]
                floor_seen[n][t][fresh[n, t]] = True
        order = [(n, impl) for n in args.windows for impl in impls]
        shift = counter["step"] % len(order)
        for n, impl in order[shift:] + order[:shift]:
            start = time.process_time()
            if impl == "floor":
                for t in range(args.tables):
                    rows, at = fresh[n, t], sum(len(part) for part in floor_rows[n][t])
                    for i in tables_of[t]:
                        torch.index_select(segments[i].tensor, 0, rows, out=floor_log[n][i][at : at + len(rows)])
                    floor_rows[n][t].append(rows)
            else:
                state = states[n, impl]
                for t, table_ids in enumerate(ids):
                    state._touch(t, table_ids)
            ms = 1000 * (time.process_time() - start)
            step_cost[n, impl, "capture"] += ms
            counter["capture"] += ms

    kernel = fused_embedding_kernels(dmp)[0]
    handle = kernel.register_forward_pre_hook(hook)
    source = SyntheticCriteo([args.rows] * 26, num_samples=args.batch * 10_000, seed=1, alpha=1.5)

    def floor_entries(n: int) -> list[tuple[int, Tensor, Tensor]]:
        """The floor's window: rows in increasing order and their old values aligned (prepared, not timed)."""
        entries = []
        for t in range(args.tables):
            if floor_rows[n][t]:
                rows = torch.cat(floor_rows[n][t])
                rows, order = torch.sort(rows)
                entries += [(i, rows, floor_log[n][i][: len(rows)][order]) for i in tables_of[t]]
            floor_rows[n][t].clear()
            floor_seen[n][t].zero_()
        return sorted(entries, key=lambda entry: entry[0])

    def commit(n: int, impl: str) -> tuple[float, float, list]:
        """(read ms, delta-pass ms, deltas) of one window's commit for ``impl``; the state is cleared."""
        if impl == "floor":
            read, entries = 0.0, floor_entries(n)
        else:
            state = states[n, impl]
            read, entries = cpu_ms(state.touched if impl == "old" else state.logged)
        deltas, passes = [], 0.0
        for entry in entries:
            index, rows = entry[0], entry[1]
            if len(entry) == 3:  # aligned old rows
                ms, _ = cpu_ms(gather_xor, segments[index], rows, delta_out, entry[2])
            else:
                ms, _ = cpu_ms(gather_xor, segments[index], rows, delta_out, None, entry[2], entry[3], impl == "new")
            passes += ms
            deltas.append((index, rows.clone(), delta_out[: len(rows) * segments[index].row_bytes].clone()))
        if impl != "floor":
            ms, _ = cpu_ms(states[n, impl].commit)
            read += ms
        return read, passes, deltas

    total_steps = max(args.windows) * (args.warmup + args.timed)
    fwd_bwd = []
    for step in range(total_steps):
        _, ids, _ = source.rows(step * args.batch, (step + 1) * args.batch)
        ids = ids[:, : args.tables]
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(args.tables)],
                                                  values=ids.t().reshape(-1).contiguous(),
                                                  lengths=torch.ones(ids.numel(), dtype=torch.int32))
        counter["capture"], start = 0.0, time.process_time()
        dmp(kjt).values().sum().backward()
        fwd_bwd.append(1000 * (time.process_time() - start) - counter["capture"])
        counter["step"] += 1
        for n in args.windows:
            if (step + 1) % n:
                continue
            order = impls[step % len(impls):] + impls[: step % len(impls)]
            results = {impl: commit(n, impl) for impl in order}
            reference = results["floor"][2]
            for impl in ("old", "new", "new-torch"):  # the same rows, order and deltas
                got = results[impl][2]
                if len(got) != len(reference) or any(a[0] != b[0] or not torch.equal(a[1], b[1]) or
                                                     not torch.equal(a[2], b[2]) for a, b in zip(got, reference)):
                    raise AssertionError(f"{impl} disagrees with the reference at step {step}, N = {n}")
            timed = step + 1 > max(args.windows) * args.warmup
            for impl in impls:
                capture = step_cost.pop((n, impl, "capture"), 0.0)
                if timed:
                    read, passes, _ = results[impl]
                    windows[n, impl, "capture"].append(capture / n)
                    windows[n, impl, "read"].append(read / n)
                    windows[n, impl, "deltas"].append(passes / n)
            if timed:
                windows[n, "rows"].append(sum(len(rows) for i, rows, _ in results["floor"][2]
                                              if segments[i].name.endswith("/weight")) / n)
    handle.remove()
    med = statistics.median
    step_ms = med(fwd_bwd[max(args.windows) * args.warmup:])
    lines = [f"Undo log CPU per training step (ms), {args.tables} tables x {args.rows} x {args.dim} fp32 + row-wise "
             f"Adagrad, batch {args.batch} ids per table, power-law ids, 1 thread, C kernels "
             f"{'on' if gf_cpu.has_undo_kernels() else 'OFF'}; fwd+bwd alone {step_ms:.1f} ms/step; "
             f"median over {args.timed} windows after {args.warmup}.",
             f"{'N':>3} {'impl':<10}{'rows/step':>10}{'capture':>9}{'read':>8}{'deltas':>8}{'total':>8}"
             f"{'x floor':>9}{'x old':>7}{'% step':>8}"]
    lines.append("-" * len(lines[-1]))
    for n in args.windows:
        parts_of = {impl: zip(*(windows[n, impl, p] for p in ("capture", "read", "deltas"))) for impl in impls}
        totals = {impl: med([sum(parts) for parts in parts_of[impl]]) for impl in impls}
        for impl in impls:
            parts = [med(windows[n, impl, p]) for p in ("capture", "read", "deltas")]
            lines.append(f"{n:>3} {impl:<10}{med(windows[n, 'rows']):>10.0f}{parts[0]:>9.2f}{parts[1]:>8.2f}"
                         f"{parts[2]:>8.2f}{totals[impl]:>8.2f}{totals[impl] / totals['floor']:>9.2f}"
                         f"{totals[impl] / totals['old']:>7.2f}{100 * totals[impl] / step_ms:>7.1f}%")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=7, help="tables on the rank (26 split over 4 ranks: 7)")
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4104, help="ids per table per step (the global batch)")
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 4, 16], help="commit windows N")
    parser.add_argument("--warmup", type=int, default=1, help="untimed windows of the largest N")
    parser.add_argument("--timed", type=int, default=4, help="timed windows of the largest N")
    parser.add_argument("--quick", action="store_true", help="a small model and few steps (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.tables, args.rows, args.dim, args.batch, args.windows, args.timed = 3, 2000, 16, 256, [1, 4], 2
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            print("\n".join(run(args)), flush=True)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
