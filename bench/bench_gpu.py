"""The CuPy parity kernels on one GPU against the device's copy bandwidth, measured in the same run (``make gpu-check``).

For ``--k`` data shards of ``--shard-mb`` MB each: encode (r = 1: XOR, r = 2: Reed-Solomon), the reconstruction of 1
(and 2) lost data shards, and ``update_rows`` of ``--rows`` random rows of 128 and 512 bytes (the per-step parity
update of embedding training). GB/s counts the bytes an operation takes in: the k shards for encode and decode, the
row deltas for ``update_rows``. "copy GB/s" is a torch device-to-device copy of the same number of bytes, timed in the
same run, and "x copy" their ratio: a copy reads and writes each byte once, encode reads k shards and writes r, so
about 1x copy is the memory-bound limit. Times are the best of ``--repeats`` runs (CUDA events) after a warm-up run,
which also compiles the kernels (NVRTC).

    PYTHONPATH=. python bench/bench_gpu.py            # 4 x 256 MB shards, seconds on an H100
    PYTHONPATH=. python bench/bench_gpu.py --quick    # 4 x 32 MB shards

Without CUDA it prints ``no CUDA: skipped`` and exits 0 (CPU machines, CI); with CUDA but without CuPy it says so and
exits 2 (the kernels cannot run: ``pip install cupy-cuda12x`` or ``cupy-cuda13x``). ``--device cpu`` runs the same
table on the CPU kernels (a smoke test of this script where no GPU is: ``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from lightning_dlrover.parity import ReedSolomonCode, cuda


def best_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Best time of ``fn`` in ms over ``repeats`` runs after one warm-up run (CUDA events on a GPU)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type != "cuda":
            start_s = time.perf_counter()
            fn()
            best = min(best, (time.perf_counter() - start_s) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def measure(args: argparse.Namespace, device: torch.device) -> tuple[list[tuple[str, str, int, float, float]], list[str]]:
    """``[(operation, r, bytes in, ms, copy ms of the same bytes)]`` and the correctness checks' lines."""
    k, n, m = args.k, args.shard_mb << 20, args.rows

    def random_bytes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device)

    data = random_bytes(k, n)
    copy_src = data.view(-1)  # the copy reads the very bytes the kernels read
    copy_dst = torch.empty_like(copy_src)
    out = torch.empty(2, n, dtype=torch.uint8, device=device)
    rows = {rb: (torch.randint(0, n // rb, (m,), device=device), random_bytes(m, rb)) for rb in (128, 512)}
    copy_ms: dict[int, float] = {}

    def copy_of(nbytes: int) -> float:
        if nbytes not in copy_ms:
            copy_ms[nbytes] = best_ms(lambda: copy_dst[:nbytes].copy_(copy_src[:nbytes]), args.repeats, device)
        return copy_ms[nbytes]

    results: list[tuple[str, str, int, float, float]] = []
    checks: list[str] = []

    def run(name: str, r: int, nbytes: int, fn: Callable[[], object]) -> None:
        results.append((name, str(r), nbytes, best_ms(fn, args.repeats, device), copy_of(nbytes)))

    head = min(n, 1 << 20)
    for r in (1, 2):
        code = ReedSolomonCode(k, r)
        parity = code.encode(data)
        run("encode", r, k * n, lambda code=code, parity=parity: code.encode(data, out=parity))
        same = torch.equal(parity[:, :head].cpu(), code.encode(data[:, :head].cpu().contiguous()))
        checks.append(f"r={r}: encode equals the CPU kernels' on the first {head >> 10} KiB of each shard: "
                      f"{'yes' if same else 'NO'}")
        for lost in range(1, r + 1):
            shards = {s: t for s, t in enumerate(list(data) + list(parity)) if s >= lost}
            run(f"decode {lost} lost", r, k * n, lambda code=code, shards=shards, lost=lost:
                code.reconstruct(shards, list(range(lost)), out=out[:lost]))
            same = torch.equal(out[:lost], data[:lost])
            checks.append(f"r={r}: decode of {lost} lost shard(s) returns them: {'yes' if same else 'NO'}")
        for rb, (index, delta) in rows.items():
            run(f"update_rows {m}x{rb}B", r, m * rb, lambda code=code, parity=parity, index=index, delta=delta:
                code.update_rows(parity, 1, index, delta, check_rows=False))
    return results, checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 MB shards, 3 repeats")
    parser.add_argument("--k", type=int, default=4, help="data shards (default 4)")
    parser.add_argument("--shard-mb", type=int, default=256, help="MB per shard (default 256)")
    parser.add_argument("--rows", type=int, default=1 << 20, help="rows per update_rows call (default 1048576)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs, best kept (default 10)")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke test of this script")
    args = parser.parse_args(argv)
    if args.quick:
        args.shard_mb, args.repeats = 32, 3
    device = torch.device(args.device)
    torch.manual_seed(0)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA: skipped (torch.cuda.is_available() is False)")
            return 0
        if not cuda.available():
            print("bench_gpu: CUDA is available but CuPy is not (or sees no GPU): the parity kernels cannot run. "
                  "pip install cupy-cuda12x (or cupy-cuda13x for CUDA 13).", file=sys.stderr)
            return 2
        import cupy

        props = torch.cuda.get_device_properties(device)
        print(f"device: {props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}, CuPy {cupy.__version__}")
    else:
        torch.set_num_threads(1)  # the C kernels run on one thread; so does the copy they are compared with
        print(f"device: {device} (smoke test: the CPU kernels, not the GPU's), torch {torch.__version__}")
    print(f"k={args.k}  shard={args.shard_mb} MB  rows={args.rows}  best of {args.repeats}")
    results, checks = measure(args, device)
    print(f"{'operation':<26}{'r':>3}{'MB in':>9}{'ms':>9}{'GB/s':>10}{'copy GB/s':>11}{'x copy':>8}")
    for name, r, nbytes, ms, copy_ms in results:
        gbps, copy_gbps = nbytes / ms / 1e6, nbytes / copy_ms / 1e6
        print(f"{name:<26}{r:>3}{nbytes / 2**20:9.1f}{ms:9.3f}{gbps:10.1f}{copy_gbps:11.1f}{gbps / copy_gbps:8.2f}")
    print("\n".join(checks))
    return 0 if all(line.endswith("yes") for line in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
