"""What a commit every N steps saves on one table: the undo log's capture and the commit's gather-XOR of
``old XOR new`` per step, at N = 1 and N = 16, on power-law ids like the data module's (CPU time of this process).

    PYTHONPATH=. python bench/bench_coalesce.py                  # 100 000 x 64 table, 4096 ids a step, alpha 1.5
    PYTHONPATH=. python bench/bench_coalesce.py --rows 50000
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_dlrover.fault.coding.undo_log import UndoLog
from lightning_dlrover.parity import cpu as gf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--alpha", type=float, default=1.5)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 16, 1, 16])
    args = parser.parse_args()
    torch.manual_seed(0)
    weights, state = torch.randn(args.rows, args.dim), torch.rand(args.rows, 1)  # a table, its row-wise Adagrad state

    def ids() -> torch.Tensor:
        u = torch.rand(args.batch, dtype=torch.float64)
        return (args.rows * u.pow(args.alpha)).long().clamp_max_(args.rows - 1)

    def commit(log: UndoLog) -> int:
        rows, at = log.sorted()
        sent = 0
        for j, table in enumerate(log.tables):
            row_bytes = table[0].numel() * table.element_size()
            out = torch.empty(rows.numel() * row_bytes, dtype=torch.uint8)
            gf.gather_xor_at_raw(gf.host_ptr(out, "out"), gf.host_ptr(table, "table"), table.shape[0],
                                 gf.host_ptr(rows, "rows"), rows.numel(), gf.host_ptr(log.values[j], "log"),
                                 log.values[j].shape[0], gf.host_ptr(at, "at"), row_bytes)
            sent += out.numel()
        log.clear()
        return sent

    print(f"{'N':>3}{'capture ms/step':>17}{'commit ms/step':>16}{'delta KiB/step':>16}")
    for n in args.windows:
        log = UndoLog([weights, state])
        capture = committing = 0.0
        sent = 0
        for step in range(args.steps):
            start = time.process_time()
            log.capture(ids())
            capture += time.process_time() - start
            if (step + 1) % n == 0:
                start = time.process_time()
                sent += commit(log)
                committing += time.process_time() - start
        print(f"{n:>3}{1000 * capture / args.steps:>17.2f}{1000 * committing / args.steps:>16.2f}"
              f"{sent / args.steps / 1024:>16.0f}")
    print("CPU ms per step of this process; a window's rows are logged once (its first touch) and sent once.")


if __name__ == "__main__":
    main()
