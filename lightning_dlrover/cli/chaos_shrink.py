"""``chaos --in-process --shrink [--regrow]``: a shrink drill, and its reference, the same job shrunk by the restart path.

With no spare and none started (``launch --spares 0 --no-cold-start``) a lost rank leaves the survivors training at
``N - 1`` ranks in their own processes (:mod:`lightning_dlrover.fault.inplace.shrink`). They must end where the
restart path ends: the job at ``N`` ranks under ``torchrun`` with the same rank killed at the same point and no
restart left (the survivors spill their committed state), then ``torchrun`` at ``N - 1`` ranks, which decodes the
lost rank from the spills and re-shards onto the smaller world (what ``torchrun --nnodes MIN:MAX`` restarts do). A
fault-free run at ``N`` ranks is no reference: each rank's share of the global batch changes with the world size, so
the floating-point sums differ from the shrink on.

With ``--regrow`` the job grows back to ``N`` ranks in process once the launcher's new process is set up
(:mod:`lightning_dlrover.fault.inplace.grow`), at a step that depends on how fast it sets up: there is no fixed
reference run, and the drill checks the grow itself (every worker runs with ``$LIGHTNING_DLROVER_VERIFY_RESIZE=1``:
rank 0 compares the whole training state's digest after the grow with the committed state's before it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import uuid

from lightning_dlrover.fault.inplace.store import serve_store
from lightning_dlrover.fault.points import FAULT_ENV
from lightning_dlrover.fault.restart.spill import JOB_ID_ENV, SPILL_ENV
from lightning_dlrover.monitor.events import DIGEST_EVERY_ENV, EVENTS_ENV, Event, read_events

HELP = ("with --in-process: no spare and none started at the loss (launch --spares 0 --no-cold-start): the "
        "survivors shrink in process; the reference is the same job shrunk by the restart path (torchrun at N "
        "ranks, then at N - 1 from the survivors' spills)")
REGROW_HELP = ("with --shrink: then grow back to N ranks in process (launch --regrow: a process started after the shrink "
               "joins at a commit); checked by the whole state's digest before and after the grow, with no reference run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shrink", action="store_true", help=HELP)
    parser.add_argument("--regrow", action="store_true", help=REGROW_HELP)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses a ``--shrink`` drill the launcher cannot run (before any job starts)."""
    if args.regrow and not args.shrink:
        parser.error("--regrow grows the job back after a shrink: give --shrink too")
    if args.regrow:  # the restart path's shrink is no reference for a job that grew again: the grow checks itself
        args.no_reference = True
    if not args.shrink:
        return
    if not args.in_process or args.kills or args.nodes != 1:
        parser.error("--shrink drills one rank lost in process on one machine: give --in-process --nodes 1 and "
                     "--at-step, without --kills")
    if args.nproc_per_node < 3:
        parser.error(f"--shrink needs --nproc-per-node >= 3: {args.nproc_per_node - 1} survivor(s) cannot hold the "
                     "parity of k=1 r=1 (k + r ranks)")


def launch_options(args: argparse.Namespace) -> list[str]:
    """The ``launch`` options of the drill's job: ``--spares N``, or none and no cold start for a shrink."""
    if not args.shrink:
        return ["--spares", str(args.spares)]
    return ["--spares", "0", "--no-cold-start", *(["--regrow"] if args.regrow else [])]


def restart_path_shrink(args: argparse.Namespace, program: list[str],
                        torchrun_env: dict[str, str]) -> tuple[bool, list[Event], float | None]:
    """Runs the job shrunk by the restart path in ``<--workdir>/reference`` (see the module docs), its ``torchrun``
    runs with ``torchrun_env`` added (chaos's): ``(finished, events, wall)``."""
    workdir = args.workdir / "reference"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    job = f"shrink-reference-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, DIGEST_EVERY_ENV)}
    env.update({SPILL_ENV: str(workdir / "spill"), JOB_ID_ENV: job, EVENTS_ENV: str(workdir / "events.jsonl"),
                DIGEST_EVERY_ENV: "1", **torchrun_env})
    started, deadline = time.time(), time.time() + args.timeout
    n = args.nproc_per_node
    try:
        for nproc, fault in ((n, f"rank={args.kill_rank},step={args.at_step},phase={args.phase}"), (n - 1, None)):
            # the same run id for both (the spills name the run that wrote them); a rendezvous store of its own each,
            # on 127.0.0.1 only (torchrun's own binds every interface)
            store, sock = serve_store("127.0.0.1:0")
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
                       "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{sock.getsockname()[1]}",
                       f"--rdzv-id={job}", f"--rdzv-conf=is_host=false,join_timeout={args.timeout}",
                       "--max-restarts", "0", *program]
            with open(workdir / f"torchrun{nproc}.log", "w") as log:
                try:
                    code = subprocess.run(command, env={**env, **({FAULT_ENV: fault} if fault else {})}, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=workdir,
                                          timeout=max(deadline - time.time(), 1)).returncode
                except subprocess.TimeoutExpired:
                    return False, read_events([workdir / "events.jsonl"]), None
                finally:
                    sock.close()
                    del store
            if fault is None and code != 0:
                return False, read_events([workdir / "events.jsonl"]), None
    finally:
        shutil.rmtree(workdir / "spill", ignore_errors=True)
    events = read_events([workdir / "events.jsonl"])
    if not any(e.kind == "restored" for e in events):  # the N - 1 job started afresh: no reference for a shrink
        print(f"chaos: the restart path's shrink did not restore from the spills (see {workdir}/torchrun{n - 1}.log)",
              file=sys.stderr, flush=True)
        return False, events, None
    return True, events, time.time() - started
