"""Export time and peak memory against checkpoint size (``lightning-dlrover export``, issue #21).

For each size (``--sizes-mb``: fp32 embedding tables of a ``DLRMModule``, dim 64, half of the bytes in one table
``t_cat_0``, the rest in 25 equal tables: the skew of real CTR models, where one table dominates) a strategy
checkpoint directory is written in this process (``meta.pt``, ``dlrover.json`` and the ``sharded/`` DCP files, as
one rank writes them: every table one chunk, as table-wise sharding saves it). Then, each in a fresh process (peak
RSS is that process's ``ru_maxrss``, minus the same process's RSS after its imports, so torch/TorchRec's own
memory is left out; the peak is reset there, ``/proc/self/clear_refs``):

- ``export (state dict)``: ``export_checkpoint(..., program=False)``: the tables streamed from the shard files into
  the module, ``model.pt`` written;
- ``export (+ program)``: the same and ``model.pt2`` (``torch.export``);
- ``dcp.load no_dist``: the same tensors, preallocated, loaded with ``torch.distributed.checkpoint.load(...,
  no_dist=True)`` (what export would cost through DCP's own reader);
- ``floor: read files``: reading the checkpoint's bytes from disk in 16 MiB blocks (nothing kept).

The files were just written, so every read comes from the page cache (the floor too). ``largest table`` is the
bytes of ``t_cat_0``: streaming means peak - tables stays well below it.

    PYTHONPATH=. python bench/bench_export.py                     # 64, 256, 1024 MiB, a few minutes
    PYTHONPATH=. python bench/bench_export.py --sizes-mb 16       # seconds
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
DIM = 64
MODES = ("export (state dict)", "export (+ program)", "dcp.load no_dist", "floor: read files")


def sizes_for(total_mb: int) -> list[int]:
    """Rows per table: half of ``total_mb`` in ``t_cat_0``, the rest over the other 25 tables."""
    row_bytes = DIM * 4
    big = total_mb * MiB // 2 // row_bytes
    small = max(1, total_mb * MiB // 2 // 25 // row_bytes)
    return [big] + [small] * 25


def write_checkpoint(path: Path, total_mb: int) -> int:
    """A one-rank strategy checkpoint of a DLRM with ``total_mb`` MiB of tables at ``path``; returns the tables' bytes."""
    import torch
    import torch.distributed.checkpoint as dcp

    from lightning_dlrover.checkpoint import directory
    from lightning_dlrover.models import DLRMModule

    sizes = sizes_for(total_mb)
    module = DLRMModule(sizes, embedding_dim=DIM, dense_arch_layer_sizes=[128, DIM], over_arch_layer_sizes=[128, 1])
    state, table_bytes = {}, 0
    g = torch.Generator().manual_seed(0)
    for key, value in module.state_dict().items():
        if value.is_meta:
            value = torch.rand(value.shape, generator=g)
            table_bytes += value.numel() * 4
        state[key] = value
    (path / directory.SHARDED_DIR).mkdir(parents=True)
    dcp.save({"model": state}, checkpoint_id=str(path / directory.SHARDED_DIR), no_dist=True)
    meta = {"global_step": 1, "hyper_parameters": dict(module.hparams),
            "dlrover_module_class": "lightning_dlrover.models.dlrm.DLRMModule"}
    directory.write_meta(path, meta, {"global_step": 1, "world_size": 1, "backend": "dcp"})
    return table_bytes


def child(mode: str, ckpt: Path, out: Path) -> None:
    """Runs one mode and prints ``{"seconds", "peak_mb"}`` (peak RSS above the RSS after the imports)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from lightning_dlrover.checkpoint.stream import BLOCK_BYTES, DCPReader
    from lightning_dlrover.export import export_checkpoint
    from lightning_dlrover.log import quiet_known_warnings
    from lightning_dlrover.models import DLRMModule  # noqa: F401  (imported before the baseline is taken)

    quiet_known_warnings()
    base = _reset_peak()
    start = time.perf_counter()
    if mode == MODES[0]:
        export_checkpoint(ckpt, out, program=False)
    elif mode == MODES[1]:
        export_checkpoint(ckpt, out, program=True)
    elif mode == MODES[2]:
        reader = DCPReader(ckpt / "sharded")
        state = {k: torch.empty(reader.shape(k), dtype=reader.dtype(k)) for k in reader.tensors}
        dcp.load(state, checkpoint_id=str(ckpt / "sharded"), no_dist=True)
    else:
        buffer = bytearray(BLOCK_BYTES)
        for file in sorted((ckpt / "sharded").iterdir()):
            with open(file, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_mb": _status("VmHWM") - base}))


def _status(field: str) -> float:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``), MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _reset_peak() -> float:
    """Resets this process's peak RSS to its RSS now (Linux: ``/proc/self/clear_refs``) and returns that, MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--tmp", default=None, help="where checkpoints and exports are written (default: a temp dir)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, Path(args.ckpt), Path(args.out))
        return
    root = Path(tempfile.mkdtemp(prefix="bench_export_", dir=args.tmp))
    rows = []
    try:
        for size in args.sizes_mb:
            ckpt = root / f"ckpt-{size}"
            tables = write_checkpoint(ckpt, size)
            on_disk = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
            largest = sizes_for(size)[0] * DIM * 4
            for mode in MODES:
                out = root / f"export-{size}"
                shutil.rmtree(out, ignore_errors=True)
                proc = subprocess.run([sys.executable, __file__, "--child", mode, "--ckpt", str(ckpt), "--out",
                                       str(out)], capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SystemExit(f"{mode} at {size} MiB failed:\n{proc.stderr[-3000:]}")
                result = json.loads(proc.stdout.strip().splitlines()[-1])
                artefact = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.exists() else 0
                rows.append((size, on_disk / MiB, largest / MiB, mode, result["seconds"], result["peak_mb"],
                             result["peak_mb"] - tables / MiB, on_disk / MiB / result["seconds"], artefact / MiB))
            shutil.rmtree(ckpt)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    header = ("tables MiB", "ckpt MiB", "largest table MiB", "mode", "seconds", "peak RSS MiB",
              "peak - tables MiB", "ckpt MiB/s", "artefact MiB")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for size, disk, largest, mode, seconds, peak, over, rate, artefact in rows:
        print(f"| {size} | {disk:.0f} | {largest:.0f} | {mode} | {seconds:.2f} | {peak:.0f} | {over:+.0f} | "
              f"{rate:.0f} | {artefact:.0f} |")


if __name__ == "__main__":
    main()
