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

One machine with room to grow: the job starts at 2 ranks and may grow to 4 in process when it asks
(``DLRoverStrategy.resize_in_process``, e.g. ``ResourceAdvisor(apply=True)``)::

    lightning-dlrover launch --nproc-per-node 2 --max-nproc-per-node 4 -- train.py --config job.yaml

A machine added to a running job: launched with room for a second machine, the job trains on one; a launcher started
later on the new machine (``--node-rank`` 1) sets its ranks up and they join at a commit, with no rank restarted::

    # machine A, at the start                # machine B, any time later
    lightning-dlrover launch --max-nnodes 2 --nproc-per-node 2 \
        --master 10.0.0.1:29500 -- train.py --config job.yaml
    lightning-dlrover launch --max-nnodes 2 --node-rank 1 --nproc-per-node 2 \
        --master 10.0.0.1:29500 -- train.py --config job.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
import uuid
from pathlib import Path

from lightning_dlrover.fault.inplace import membership
from lightning_dlrover.fault.inplace.supervisor import Supervisor, SupervisorConfig, serve_store
from lightning_dlrover.machine import memory_limit_bytes

#: ``1``: ``--no-zygote`` (for launches started by another command, e.g. ``chaos --in-process``).
NO_ZYGOTE_ENV = "LIGHTNING_DLROVER_NO_ZYGOTE"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lightning-dlrover launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nnodes", type=int, default=1, help="machines in the job")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this machine's index (0 hosts the store); from --nnodes up to --max-nnodes: a machine that "
                        "joins the running job")
    p.add_argument("--max-nnodes", type=int, default=None,
                   help="the most machines the job may have: machines may join it while it trains, each a launcher "
                        "started with the next --node-rank (default: --nnodes, none joins)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this machine")
    p.add_argument("--spares", default="1",
                   help="hot spares kept on this machine (0: replacements start cold); auto: the fault-tolerance "
                        "plan's, from the program's --config, $LIGHTNING_DLROVER_HISTORY and "
                        "$LIGHTNING_DLROVER_MTBF_HOURS, as `lightning-dlrover plan` makes it")
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
    p.add_argument("--no-cold-start", dest="cold_start", action="store_false",
                   help="with no hot spare left, a lost rank is not taken by a process started at the loss: the "
                        "survivors shrink in process and train on at the smaller world size (one machine; parity "
                        "needs k + r survivors, else every worker restarts)")
    p.add_argument("--regrow", action="store_true",
                   help="with --no-cold-start: after the survivors shrank, start a process in the background and grow "
                        "the job back to its launch size in process once it is set up (at a commit; no restart)")
    p.add_argument("--max-nproc-per-node", type=int, default=None,
                   help="the most ranks this machine may run when the job asks to grow in process (DLRoverStrategy."
                        "resize_in_process, e.g. the resource advisor's more ranks; one machine; default: "
                        "--nproc-per-node, no grow beyond it)")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="memory the job may use on this machine (default: its cgroup limit, else the machine's "
                        "memory); a shrink in process that would not fit in it restarts every worker instead")
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
    if args.memory_limit_gb is not None and args.memory_limit_gb <= 0:
        p.error(f"--memory-limit-gb {args.memory_limit_gb} must be > 0.")
    args.memory_limit_bytes = int(args.memory_limit_gb * 2**30) if args.memory_limit_gb else memory_limit_bytes()
    if args.regrow and (args.cold_start or args.nnodes > 1 or args.no_in_process):
        p.error("--regrow grows the job back after a shrink in process, which needs --no-cold-start, one machine "
                "(--nnodes 1) and in-process recovery (no --no-in-process).")
    args.max_nproc_per_node = args.max_nproc_per_node or args.nproc_per_node
    if args.max_nproc_per_node < args.nproc_per_node:
        p.error(f"--max-nproc-per-node {args.max_nproc_per_node} must be >= --nproc-per-node {args.nproc_per_node}.")
    if args.max_nproc_per_node > args.nproc_per_node and (args.nnodes > 1 or args.no_in_process):
        p.error("--max-nproc-per-node lets the job grow in process on its one machine: it needs --nnodes 1 and "
                "in-process recovery (no --no-in-process).")
    args.max_nnodes = args.max_nnodes or args.nnodes
    if args.max_nnodes < args.nnodes:
        p.error(f"--max-nnodes {args.max_nnodes} must be >= --nnodes {args.nnodes}.")
    if args.max_nnodes > args.nnodes and args.no_in_process:
        p.error("--max-nnodes lets machines join the job in process: it needs in-process recovery (no --no-in-process).")
    if not 0 <= args.node_rank < args.max_nnodes:
        p.error(f"--node-rank {args.node_rank} is outside [0, {args.max_nnodes}) (machines past --nnodes join a "
                "running job, up to --max-nnodes).")
    if args.spares == "auto":
        try:
            args.spares = planned_spares(args.program, args.nnodes, args.nproc_per_node)
        except ValueError as err:
            p.error(f"--spares auto: {err}")
    else:
        try:
            args.spares = int(args.spares)
        except ValueError:
            p.error(f"--spares {args.spares!r} must be a number of hot spares >= 0, or auto.")
        if args.spares < 0:
            p.error(f"--spares {args.spares} must be >= 0 (0: replacements start cold), or auto.")
    return args


def _config_of(program: list[str]) -> Path:
    for i, arg in enumerate(program):
        if arg == "--config" and i + 1 < len(program):
            return Path(program[i + 1])
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1])
    raise ValueError("the program has no --config job.yaml to plan from; give the spares as a number "
                     "(e.g. --spares 1), or run a program that takes the job's config (e.g. -- -m lightning_dlrover fit "
                     "--config job.yaml).")


def planned_spares(program: list[str], nnodes: int, nproc_per_node: int) -> int:
    """This machine's hot spares from the job's fault-tolerance plan (:mod:`lightning_dlrover.planner.inputs`): the
    pick's spares over the job, spread over its machines (each machine keeps its own pool; rounded up); 0 when the
    pick does not recover in process. ``ValueError`` for a missing or bad config or environment."""
    import yaml

    from lightning_dlrover.planner.inputs import HISTORY_ENV, Pick, mtbf_from_env, plan_inputs
    from lightning_dlrover.planner.job import PlannedJob

    path = _config_of(program)
    if not path.is_file():
        raise ValueError(f"the program's --config {path} does not exist.")
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"the program's --config {path} is not YAML: {err}")
    job = PlannedJob.from_config(config if isinstance(config, dict) else {})
    world = nnodes * nproc_per_node
    inputs = plan_inputs(job, world, nproc_per_node, os.environ.get(HISTORY_ENV), mtbf_from_env())
    plan = inputs.plan()
    pick = Pick.of(plan.best)
    per_machine = math.ceil(pick.spares / nnodes)
    label = plan.best.candidate.label
    print(f"lightning-dlrover launch: --spares auto: the plan for {path} at {world} ranks picks {label} (goodput "
          f"{plan.best.goodput:.4f}, {inputs.failures.source}): {per_machine} hot spare(s) on this machine"
          + ("" if pick.spares else " (the pick does not recover in process)"), file=sys.stderr, flush=True)
    return per_machine


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
