"""The command line that measures the DLRM profile the simulator uses (:mod:`lightning_dlrover.elastic.profile`):

    lightning-dlrover profile --out lightning_dlrover/elastic/dlrm_profile.json \
        --seeds 0 1 2 --warmup-steps 10 [--workers 3] [--curves-dir runs/curves]

(``python -m lightning_dlrover.cli.profile`` runs the same.) Imports torch when it runs, not when imported.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lightning_dlrover.elastic import profile
from lightning_dlrover.elastic.profile import (
    DEFAULT_PROFILE,
    measure_allreduce,
    measure_convergence,
    measure_step_times,
)


def main(argv: list[str] | None = None) -> int:
    """Measures the profile, writes it to ``--out`` and prints its curves."""
    import torch

    parser = argparse.ArgumentParser(prog="lightning-dlrover profile", description="Measure the DLRM profile the simulator uses.")
    parser.add_argument("--out", default=str(Path(profile.__file__).with_name(DEFAULT_PROFILE)))
    parser.add_argument("--step-batches", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--base-batch", type=int, default=128)
    parser.add_argument("--budget", type=int, default=24576, help="samples the smallest batch trains for")
    parser.add_argument("--eval-every", type=int, default=1024)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warmup-steps", type=int, default=10,
                        help="steps over which the LRs ramp from the base batch's to the rule's (0: none)")
    parser.add_argument("--workers", type=int, default=1, help="processes measuring convergence curves at once")
    parser.add_argument("--curves-dir", default=None,
                        help="a folder keeping each convergence curve as measured; a rerun reuses them")
    parser.add_argument("--step-times-from", default=None,
                        help="a profile whose step_s and allreduce_s to keep instead of measuring them again")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.time()
    if args.step_times_from:
        kept = json.loads(Path(args.step_times_from).read_text())
        step_s, allreduce_s = kept["step_s"], kept["allreduce_s"]
    else:
        step_s, allreduce_s = measure_step_times(args.step_batches), measure_allreduce()
    samples, per_seed, meta = measure_convergence(sorted(args.batches), args.base_batch, args.budget, args.eval_every,
                                                  args.seeds, args.warmup_steps, args.workers,
                                                  args.curves_dir)
    meta.update(seconds=time.time() - started, command="python -m lightning_dlrover.cli.profile " + " ".join(
                    argv if argv is not None else sys.argv[1:]), lr_rule="sqrt", warmup_steps=args.warmup_steps,
                step_times_from=args.step_times_from,
                target="90% of the loss drop of the smallest batch in budget samples", torch=torch.__version__,
                threads=1)
    Path(args.out).write_text(json.dumps({"step_s": step_s, "allreduce_s": allreduce_s, "samples_to_target": samples,
                                          "samples_to_target_seeds": per_seed, "censored_at": 3 * args.budget,
                                          "base_batch": args.base_batch, "meta": meta}, indent=1))
    print(json.dumps({"step_s": step_s, "allreduce_s": allreduce_s, "samples_to_target": samples,
                      "samples_to_target_seeds": per_seed}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
