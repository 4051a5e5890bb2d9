"""``lightning-dlrover launch``: one launcher per machine that keeps survivors running when a rank is lost.

Its options and command line; the supervisor of the workers is
:class:`~lightning_dlrover.fault.inplace.supervisor.Supervisor` (see its module for how a loss is handled).
The workers of a launch wait for each other to start their process group for ``$LIGHTNING_DLROVER_START_TIMEOUT``
seconds (default 600: each imports torch, Lightning and TorchRec first, slow on a loaded machine), not for the
job's collective timeout; a rank that never starts is named in the error.

Example (two machines, two ranks each, one hot spare each)::

    # machine A (hosts the store)            # machine B
    lightning-dlrover launch --nnodes 2 --node-rank 0 --nproc-per-node 2 --spares 1 \\
        --master 10.0.0.1:29500 -- train.py --config job.yaml
    lightning-dlrover launch --nnodes 2 --node-rank 1 --nproc-per-node 2 --spares 1 \\
        --master 10.0.0.1:29500 -- train.py --config job.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import uuid

from lightning_dlrover.fault.inplace import membership
from lightning_dlrover.fault.inplace.supervisor import Supervisor, SupervisorConfig, serve_store

#: ``1``: ``--no-zygote`` (for launches started by another command, e.g. ``chaos --in-process``).
NO_ZYGOTE_ENV = "LIGHTNING_DLROVER_NO_ZYGOTE"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lightning-dlrover launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nnodes", type=int, default=1, help="machines in the job")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index (0 hosts the store)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this machine")
    p.add_argument("--spares", type=int, default=1, help="hot spares kept on this machine (0: replacements start cold)")
    p.add_argument("--master", default="127.0.0.1:29500", help="host:port of the store (on machine 0)")
    p.add_argument("--run-id", default=None, help="job id (default: random)")
    p.add_argument("--max-restarts", type=int, default=3, help="full restarts when in-process recovery fails")
    p.add_argument("--stop-grace", type=float, default=30.0,
                   help="seconds between SIGTERM and SIGKILL when every worker is restarted (survivors spill meanwhile)")
    p.add_argument("--no-in-process", action="store_true", help="restart every worker on any failure, like torchrun")
    p.add_argument("--monitor-interval", type=float, default=0.05, help="seconds between checks of the workers")
    p.add_argument("--node-timeout", type=float, default=3.0,
                   help="seconds of silence after which machine 0 declares another machine's launcher lost (keep it "
                        "below LIGHTNING_DLROVER_PLAN_TIMEOUT, 10 s, which the survivors wait for a plan)")
    p.add_argument("--settle", type=float, default=0.1,
                   help="seconds to wait after a first failure for others that come with it, so they share one recovery")
    p.add_argument("--no-zygote", dest="zygote", action="store_false", default=os.environ.get(NO_ZYGOTE_ENV) != "1",
                   help="start every worker as a fresh interpreter instead of forking it from a warm process that "
                        f"imported torch, TorchRec and Lightning once (spares are ready later); also ${NO_ZYGOTE_ENV}=1")
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- script.py [args] (or -m module [args])")
    args = p.parse_args(argv)
    if args.program[:1] == ["--"]:
        args.program = args.program[1:]
    if not args.program:
        p.error("give the program to run after `--`, e.g. `-- train.py --config job.yaml`.")
    for name in ("nnodes", "nproc_per_node"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1.")
    for name in ("settle", "stop_grace"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0 seconds.")
    for name in ("monitor_interval", "node_timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0 seconds.")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank {args.node_rank} is outside [0, {args.nnodes}).")
    return args


def _stop(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # the supervisor's ``finally`` stops the workers (each in a session of its own)


def main(argv: list[str]) -> int:
    args = parse(argv)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop)
    store, sock = serve_store(args.master) if args.node_rank == 0 else (membership.connect(args.master), None)
    config = SupervisorConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SupervisorConfig)})
    supervisor = Supervisor(config, store, args.run_id or f"dlrover-{uuid.uuid4().hex[:8]}")
    try:
        return supervisor.run()
    finally:
        supervisor.stop()
        if sock is not None:
            sock.close()
