"""``lightning-dlrover export``: a strategy checkpoint as an unsharded artefact for serving
(:func:`lightning_dlrover.export.export_checkpoint`). A bad checkpoint or path ends it with one line on stderr and
exit status 2."""

from __future__ import annotations

import argparse
import sys
import time


def parser() -> argparse.ArgumentParser:
    """The command line's options."""
    p = argparse.ArgumentParser(
        prog="lightning-dlrover export",
        description="Write a DLRoverStrategy checkpoint (any world size and sharding) as model.pt (the unsharded "
                    "state dict), config.json and model.pt2 (a torch.export program of plain tensors) into --out.",
    )
    p.add_argument("--ckpt_path", "--ckpt-path", required=True, help="the checkpoint directory, e.g. .../last.ckpt")
    p.add_argument("--out", required=True, help="the directory to write (must not exist unless --overwrite)")
    p.add_argument("--module-class", default=None,
                   help="package.module.Class of the LightningModule, when the checkpoint does not name it")
    p.add_argument("--dense-features", type=int, default=None,
                   help="dense features per sample (the program's input), when the module does not say")
    p.add_argument("--no-program", action="store_true", help="leave model.pt2 out")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="also write model_int8.pt: the module with row-wise int8 tables (TorchRec's inference path)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return p


def main(argv: list[str]) -> int:
    """Runs ``lightning-dlrover export``; returns the exit status."""
    args = parser().parse_args(argv)
    from lightning_dlrover.export import BadCheckpoint, CheckpointFileError, export_checkpoint
    from lightning_dlrover.log import quiet_known_warnings

    quiet_known_warnings()
    start = time.perf_counter()
    try:
        out = export_checkpoint(args.ckpt_path, args.out, module_class=args.module_class,
                                dense_features=args.dense_features, program=not args.no_program,
                                quantize=args.quantize, overwrite=args.overwrite)
    except (BadCheckpoint, CheckpointFileError) as err:
        print(f"lightning-dlrover export: error: {err}", file=sys.stderr, flush=True)
        return 2
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"exported {args.ckpt_path} to {out} ({files}) in {time.perf_counter() - start:.1f}s")
    return 0
