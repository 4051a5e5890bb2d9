"""Throughput of lightning_dlrover.parity beside a plain copy, a torch XOR and ISA-L.

For k data shards of ``--shard-mb`` MB each and r = 1 (XOR) and r = 2 (Reed-Solomon), times
encode, a dense update of one shard, sparse updates of ``--rows`` random rows of 128 and 512
bytes, and the reconstruction of 1 (and 2) lost data shards. Throughput is GB/s of input bytes
(k shards for encode and decode, the delta for updates), best of ``--repeats``. On CPU it runs on
one thread (``--threads``) and also gives the ratio to ISA-L's ~7-11 GB/s per core for GF(2^8)
(9 GB/s is used); on CUDA (``--device cuda``) the ratio to a device-to-device copy.

    python bench/bench_parity.py            # 4 x 64 MB shards, about a minute on 2 cores
    python bench/bench_parity.py --quick    # 4 x 8 MB shards, seconds
    python bench/bench_parity.py --isa all  # every CPU instruction set this machine has
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from lightning_dlrover.parity import ReedSolomonCode, cpu

ISA_L_GBPS = 9.0


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Best wall time of ``fn`` over ``repeats`` runs, after one warm-up run."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def random_bytes(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=device)


def run(args: argparse.Namespace, device: torch.device, isa: str) -> None:
    k, n, m = args.k, args.shard_mb << 20, args.rows
    data = random_bytes((k, n), device)
    delta = random_bytes((n,), device)
    rows_delta = {
        rb: (torch.randint(0, n // rb, (m,), device=device), random_bytes((m, rb), device)) for rb in (128, 512)
    }
    scratch = torch.empty_like(data)

    results: list[tuple[str, str, int, float]] = []

    def measure(name: str, r: str, nbytes: int, fn: Callable[[], object]) -> None:
        results.append((name, r, nbytes, timed(fn, device, args.repeats)))

    measure("torch copy", "-", k * n, lambda: scratch.copy_(data))
    measure("torch XOR a^b->c", "-", 2 * n, lambda: torch.bitwise_xor(data[0], data[1], out=scratch[0]))
    for r in (1, 2):
        code = ReedSolomonCode(k, r)
        parity = code.encode(data)
        measure("encode", str(r), k * n, lambda: code.encode(data, out=parity))
        measure("update dense", str(r), n, lambda: code.update(parity, 1, delta))
        for rb, (rows, delta_rows) in rows_delta.items():
            # On CUDA, checking rows would add a host sync per call.
            check = device.type == "cpu"
            measure(f"update_rows {m}x{rb}B", str(r), m * rb,
                    lambda: code.update_rows(parity, 1, rows, delta_rows, check_rows=check))
        for lost in range(1, r + 1):
            shards = {s: t for s, t in enumerate(list(data) + list(parity)) if s >= lost}
            out = scratch[:lost]
            measure(f"decode {lost} lost", str(r), k * n,
                    lambda: code.reconstruct(shards, list(range(lost)), out=out))

    copy_gbps = results[0][2] / results[0][3] / 1e9
    on_cpu = device.type == "cpu"
    title = f"device={device}" + (f" isa={isa} threads={torch.get_num_threads()}" if on_cpu else "")
    print(f"\n{title}  k={k}  shard={args.shard_mb} MB  rows={m}")
    print(f"{'operation':<26}{'r':>3}{'MB in':>9}{'ms':>9}{'GB/s':>9}{'x copy':>9}" + (f"{'x ISA-L':>9}" if on_cpu else ""))
    for name, r, nbytes, seconds in results:
        gbps = nbytes / seconds / 1e9
        line = f"{name:<26}{r:>3}{nbytes / 2**20:9.0f}{seconds * 1e3:9.2f}{gbps:9.2f}{gbps / copy_gbps:9.2f}"
        print(line + (f"{gbps / ISA_L_GBPS:9.2f}" if on_cpu and r == "2" else ""))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="8 MB shards, 16k rows, 3 repeats")
    parser.add_argument("--k", type=int, default=4, help="data shards (default 4)")
    parser.add_argument("--shard-mb", type=int, default=64, help="MB per shard (default 64)")
    parser.add_argument("--rows", type=int, default=65536, help="rows per sparse update (default 65536)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs, best kept (default 5)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument(
        "--isa", default=None, help=f"CPU instruction set or 'all' (default: fastest), from {cpu.available_isas()}"
    )
    args = parser.parse_args()
    if args.quick:
        args.shard_mb, args.rows, args.repeats = 8, 16384, 3
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    if device.type != "cpu":
        run(args, device, "")
        return
    isas = cpu.available_isas() if args.isa == "all" else [args.isa or cpu.isa()]
    for isa in isas:
        cpu.set_isa(isa)
        run(args, device, isa)


if __name__ == "__main__":
    main()
