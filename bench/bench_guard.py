"""The cost of the add-on guard (``lightning_dlrover.monitor.guard.guarded``) on a hook call: a plain method beside
the same method guarded, called in a loop in one process; prints a table (ns per call, medians of ``--repeats``).

    PYTHONPATH=. python bench/bench_guard.py [--calls 1000000] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

from lightning_dlrover.monitor.guard import guarded


class Plain:
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        return batch_idx


class Guarded:
    @guarded
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        return batch_idx


def per_call_ns(addon: object, calls: int) -> float:
    hook = addon.on_train_batch_end
    start = time.perf_counter_ns()
    for i in range(calls):
        hook(None, None, None, None, i)
    return (time.perf_counter_ns() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="100k calls, 3 repeats")
    args = p.parse_args()
    calls, repeats = (100_000, 3) if args.quick else (args.calls, args.repeats)
    rows = {"plain": [], "guarded": []}
    for _ in range(repeats):  # alternate, so that a busy moment of the machine hits both
        rows["plain"].append(per_call_ns(Plain(), calls))
        rows["guarded"].append(per_call_ns(Guarded(), calls))
    plain = statistics.median(rows["plain"])
    print(f"{'hook':<10} {'ns/call (median)':>17} {'min':>8} {'max':>8} {'added ns':>9}")
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"{name:<10} {med:>17.0f} {min(values):>8.0f} {max(values):>8.0f} {med - plain:>9.0f}")


if __name__ == "__main__":
    main()
