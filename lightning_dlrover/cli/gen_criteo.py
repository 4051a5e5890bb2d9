"""``lightning-dlrover gen-criteo``: Criteo-format TSV day files (:mod:`lightning_dlrover.data.generate`) from the
shell. Needs only numpy.

    lightning-dlrover gen-criteo --out data/criteo --files 2 --size-mb 200
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_dlrover.data import generate
from lightning_dlrover.data.generate import GeneratorConfig, generate_days, rows_for_size


def main(argv: list[str] | None = None) -> int:
    """``lightning-dlrover gen-criteo``: writes Criteo-format day files."""
    parser = argparse.ArgumentParser(prog="lightning-dlrover gen-criteo", description=generate.__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory of the day files (created)")
    parser.add_argument("--files", type=int, default=1, help="number of day files")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--rows", type=int, default=None, help="lines per file")
    size.add_argument("--size-mb", type=float, default=None, help="size per file in MB (10^6 bytes; within about 1%%; default 100)")
    parser.add_argument("--max-vocab", type=int, default=GeneratorConfig.max_vocab)
    parser.add_argument("--alpha", type=float, default=GeneratorConfig.alpha, help="id popularity power law")
    parser.add_argument("--ctr", type=float, default=GeneratorConfig.ctr)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.size_mb is not None and args.size_mb <= 0:
        parser.error(f"--size-mb {args.size_mb} must be positive.")
    try:
        config = GeneratorConfig(args.max_vocab, args.alpha, args.ctr, args.seed)
    except ValueError as err:
        parser.error(str(err))
    rows = args.rows or rows_for_size((args.size_mb or 100.0) * 1e6, config)
    paths = generate_days(args.out, args.files, rows, config)
    total = sum(p.stat().st_size for p in paths)
    print(f"wrote {len(paths)} file(s), {rows} lines each, {total / 1e6:.1f} MB: {', '.join(map(str, paths))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
