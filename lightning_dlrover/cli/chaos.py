"""``lightning-dlrover chaos``: a node-loss drill on one machine.

Starts a multi-node job as several ``torchrun`` agents on 127.0.0.1 (c10d rendezvous on a store this
runner hosts, so that no node's death takes the rendezvous with it), kills one node (its agent and
workers, SIGKILL) when it reaches a given step, optionally starts a replacement node, and reports whether
the job recovered, how long detection and resumption took, how many committed steps were lost, and
whether the final state digest equals that of the same job run without a fault::

    lightning-dlrover chaos --nodes 2 --kill-node 0 --at-step 12 --replace

Each node gets its own spill directory (``/dev/shm/lightning_dlrover-<uid>/<run>/node<i>``), as separate
machines would. Logs of every agent and the job's structured events (``events.jsonl``, read for the report)
are kept under ``--workdir``. ``--script`` drills your own training script instead of the DLRM config;
``--kill-all`` kills every rank at once (the job must fall back to its newest checkpoint).
``--in-process`` starts the nodes with ``lightning-dlrover launch`` instead and kills one rank
(``--kill-rank``): a hot spare (``--spares`` per node) takes it and the survivors recover inside ``fit``::

    lightning-dlrover chaos --in-process --nodes 1 --nproc-per-node 2 --kill-rank 1 --at-step 12

``--shrink`` (with ``--in-process``) starts no spare: the survivors shrink in process, and the drill compares them with
the same job shrunk by the restart path (:mod:`lightning_dlrover.cli.chaos_shrink`).

``--kills N`` drills at a kill rate instead, in every mode (``--in-process``; ``torchrun`` restarts that decode
the survivors' spills; with ``--no-parity``, restarts from the last checkpoint): N SIGKILLs of a random rank
(see :mod:`lightning_dlrover.cli.chaos_kills` for when), reported against a fault-free run of the same mode
(goodput by wall time, recoveries by kind, steps lost, digests); ``--json PATH`` writes the report's facts::

    lightning-dlrover chaos --nodes 1 --nproc-per-node 2 --kills 3 --seed 1 --json drill.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import psutil
from torch.distributed import TCPStore

from lightning_dlrover.cli import chaos_kills, chaos_shrink
from lightning_dlrover.cli.chaos_report import drill_facts, summarize
from lightning_dlrover.fault.inplace.supervisor import serve_store
from lightning_dlrover.fault.points import FAULT_ENV, PHASES, VERIFY_PARITY_ENV, VERIFY_RESIZE_ENV
from lightning_dlrover.fault.restart.spill import SPILL_ENV
from lightning_dlrover.monitor.events import DIGEST_EVERY_ENV, EVENTS_ENV, Event, read_events

#: Restarted workers must not share the agents' store: they would read addresses the dead workers left there.
STORE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
DEFAULT_CONFIG = resources.files("lightning_dlrover.cli") / "configs" / "chaos.yaml"
#: What ``--no-parity`` adds to a ``--config`` job: no erasure code, so a restart resumes from the last checkpoint.
NO_PARITY = "--trainer.strategy.init_args.parity=null"


@dataclass
class Run:
    """One run of the job: finished or not, its events, its wall time (start of its first agent to the exit of
    its last) and, for a ``--kills`` drill, how many kills landed and why not all."""

    finished: bool
    events: list[Event]
    wall_s: float | None = None
    landed: int = 0
    short: str = ""


@dataclass
class Job:
    """The agents of one multi-node run and their logs."""

    name: str
    workdir: Path
    agents: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def events(self) -> list[Event]:
        """The job's structured events (every rank of every node appends to one file)."""
        return read_events([self.workdir / "events.jsonl"])

    def kill(self) -> None:
        """SIGKILLs every agent still running and its workers (which ``torchrun`` starts in their own sessions)."""
        for agent in self.agents:
            if agent.poll() is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    for process in psutil.Process(agent.pid).children(recursive=True):
                        process.kill()
                agent.kill()
        for agent in self.agents:
            agent.wait()


def _loopback_store() -> tuple[TCPStore, socket.socket]:
    """A rendezvous store listening on 127.0.0.1 only (``TCPStore`` alone binds every interface)."""
    return serve_store("127.0.0.1:0")


class Cluster:
    """Starts ``torchrun`` agents of one job, each as a separate node with its own spill directory."""

    def __init__(self, args: argparse.Namespace, name: str, min_nodes: int, extra: list[str] | None = None) -> None:
        self.args, self.name, self.min_nodes, self.extra = args, name, min_nodes, extra or []
        self.store, self._socket = _loopback_store()
        self.port = self._socket.getsockname()[1]
        if args.in_process:  # node 0's launcher hosts the store itself
            self._socket.close()
            del self.store
        self.run_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.spill_root = Path("/dev/shm") / f"lightning_dlrover-{os.getuid()}" / self.run_id
        self.job = Job(name, args.workdir / name)
        shutil.rmtree(self.job.workdir, ignore_errors=True)  # no checkpoints of an earlier drill
        self.job.workdir.mkdir(parents=True)

    def start_node(self, index: int, env: dict[str, str] | None = None) -> None:
        """Starts agent ``index`` (a node) with ``--nproc-per-node`` workers."""
        a = self.args
        rdzv = f"is_host=false,join_timeout={a.timeout},last_call_timeout={a.last_call},keep_alive_interval=1"
        command = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.min_nodes}:{a.nodes}", f"--nproc-per-node={a.nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={rdzv}", f"--max-restarts={max(3, a.kills + 1)}", "--monitor-interval=0.2",
            *self._program(),
        ]  # fmt: skip
        if a.in_process:  # our launcher: node 0 hosts the job's store on the port this runner reserved
            command = [
                sys.executable, "-m", "lightning_dlrover", "launch", "--nnodes", str(a.nodes), "--node-rank", str(index),
                "--nproc-per-node", str(a.nproc_per_node), *chaos_shrink.launch_options(a), "--run-id", self.run_id,
                "--max-restarts", str(max(3, a.kills + 1)),
                "--master", f"127.0.0.1:{self.port}", "--", *self._program(),
            ]  # fmt: skip
        full_env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, DIGEST_EVERY_ENV)}
        full_env.update({SPILL_ENV: str(self.spill_root / f"node{index}"), EVENTS_ENV: str(self.job.workdir / "events.jsonl"),
                         **STORE_ENV, **(env or {})})
        if not a.no_reference or a.kills:  # the kill rule and the report read the digests too
            full_env[DIGEST_EVERY_ENV] = "1"  # digests at the start and after every step, to compare states
        full_env.update({VERIFY_PARITY_ENV: "1", VERIFY_RESIZE_ENV: "1"})  # a restore checks parity, a grow its state
        log = self.job.workdir / f"node{index}.log"
        with open(log, "w") as out:
            agent = subprocess.Popen(command, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=self.job.workdir)  # a script's relative paths (checkpoints) stay per run
        self.job.agents.append(agent)
        self.job.logs.append(log)

    def _program(self) -> list[str]:
        return program(self.args, self.job.workdir, self.extra)

    def wait(self, until: float) -> bool:
        """Waits for every agent to exit; ``False`` if one is still running at time ``until``."""
        for agent in self.job.agents:
            try:
                agent.wait(timeout=max(until - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                return False
        return True

    def close(self) -> None:
        self.job.kill()
        self._socket.close()
        shutil.rmtree(self.spill_root, ignore_errors=True)


def program(args: argparse.Namespace, workdir: Path, extra: list[str] | None = None) -> list[str]:
    """The job's command line after the interpreter: the ``--script``, or ``fit`` of the ``--config`` in ``workdir``."""
    if args.script is not None:
        return [str(args.script), *args.overrides]
    return ["-m", "lightning_dlrover", "fit", "--config", str(args.config), f"--trainer.default_root_dir={workdir}",
            *([NO_PARITY] if args.no_parity else []), *args.overrides, *(extra or [])]


def _reference_run(args: argparse.Namespace) -> Run:
    """The same job without a fault, in the same mode (for ``--shrink``: the job shrunk by the restart path)."""
    if args.shrink:
        return Run(*chaos_shrink.restart_path_shrink(args, program(args, args.workdir / "reference"), STORE_ENV))
    cluster = Cluster(args, "reference", args.nodes, _reference_overrides(args))
    try:
        started = time.time()
        for index in range(args.nodes):
            cluster.start_node(index)
        finished = cluster.wait(started + args.timeout)
        return Run(finished, cluster.job.events(), time.time() - started if finished else None)
    finally:
        cluster.close()


def _reference_overrides(args: argparse.Namespace) -> list[str]:
    """What the fault-free run adds to the job's arguments: ``--reference-steps`` stops it early."""
    return [] if args.reference_steps is None else [f"--trainer.max_steps={args.reference_steps}"]


def _faulted_run(args: argparse.Namespace) -> Run:
    """Runs the job with its faults: ``--kills`` random kills, else node ``--kill-node`` (or every rank) killed at
    ``--at-step``, optionally replaced."""
    if args.kills:
        return _drill_run(args)
    started = time.time()
    finished, events = _one_fault_run(args)
    return Run(finished, events, time.time() - started if finished else None)


def _drill_run(args: argparse.Namespace) -> Run:
    """Runs the job and delivers ``--kills`` kills to random ranks (the launcher or agent restarts each)."""
    cluster = Cluster(args, "faulted", args.nodes)
    started = time.time()
    deadline = started + args.timeout
    kills = chaos_kills.plan(args.kills, args.nodes * args.nproc_per_node, args.seed, args.kill_jitter, args.kill_rate)
    try:
        for index in range(args.nodes):
            cluster.start_node(index)
        killer = chaos_kills.Killer(cluster.job.agents, f"127.0.0.1:{cluster.port}" if args.in_process else None)
        landed, short = chaos_kills.run_kills(kills, killer, cluster.job.events, str(cluster.job.workdir / "events.jsonl"),
                                              deadline, poisson=args.kill_rate is not None)
        finished = all(a.wait(timeout=max(deadline - time.time(), 0.1)) == 0 for a in cluster.job.agents)
        return Run(finished, cluster.job.events(), time.time() - started if finished else None, landed, short)
    except subprocess.TimeoutExpired:
        return Run(False, cluster.job.events())
    finally:
        cluster.close()


def _one_fault_run(args: argparse.Namespace) -> tuple[bool, list[Event]]:
    """Kills node ``--kill-node`` (or every rank, or ``--kill-rank`` in process) at ``--at-step``; returns
    (finished, events)."""
    min_nodes = args.nodes if args.replace or args.kill_all else args.nodes - 1
    cluster = Cluster(args, "faulted", min_nodes)
    fault = f"step={args.at_step},phase={args.phase},target={'all' if args.kill_all else 'node'}"
    deadline = time.time() + args.timeout
    if args.in_process:  # one rank dies; its launcher stays to hand the rank to a spare
        try:
            fault = f"rank={args.kill_rank},step={args.at_step},phase={args.phase}"
            for index in range(args.nodes):
                cluster.start_node(index, {FAULT_ENV: fault})
            finished = all(a.wait(timeout=max(deadline - time.time(), 0.1)) == 0 for a in cluster.job.agents)
            return finished, cluster.job.events()
        except subprocess.TimeoutExpired:
            return False, cluster.job.events()
        finally:
            cluster.close()
    try:
        for index in range(args.nodes):
            cluster.start_node(index, {FAULT_ENV: fault} if args.kill_all or index == args.kill_node else None)
        if args.kill_all:
            finished = all(a.wait(timeout=max(deadline - time.time(), 0.1)) == 0 for a in cluster.job.agents)
            return finished, cluster.job.events()
        victim = cluster.job.agents[args.kill_node]
        while victim.poll() is None and time.time() < deadline:
            if any(a.poll() is not None for a in cluster.job.agents if a is not victim):
                break
            time.sleep(0.2)
        if victim.poll() not in (None, 0) and args.replace:
            print(f"chaos: node {args.kill_node} is down; starting a replacement node", flush=True)
            cluster.start_node(args.nodes)
        elif victim.poll() not in (None, 0) and args.rejoin_after is not None:
            while not any(e.kind == "resumed" for e in cluster.job.events()) and time.time() < deadline:
                time.sleep(0.2)
            time.sleep(args.rejoin_after)
            print(f"chaos: a node rejoins {args.rejoin_after} s after the shrunk job resumed", flush=True)
            cluster.start_node(args.nodes)
        survivors = [a for a in cluster.job.agents if a is not victim]
        finished = all(a.wait(timeout=max(deadline - time.time(), 0.1)) == 0 for a in survivors)
        return finished, cluster.job.events()
    except subprocess.TimeoutExpired:
        return False, cluster.job.events()
    finally:
        cluster.close()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lightning-dlrover chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path(str(DEFAULT_CONFIG)), help="a `lightning-dlrover fit` config")
    parser.add_argument("--script", type=Path, default=None,
                        help="your own training script, run by torchrun in place of `lightning-dlrover fit` (it must take "
                             "devices and nodes from lightning_dlrover.elastic_trainer_args()); extra arguments go to it")
    parser.add_argument("--nodes", type=int, default=2, help="torchrun agents to start, each a node")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node")
    parser.add_argument("--kill-node", type=int, default=0, help="index of the node to kill (0-based)")
    parser.add_argument("--in-process", action="store_true",
                        help="launch with `lightning-dlrover launch` and kill one rank: survivors recover in process")
    parser.add_argument("--spares", type=int, default=1, help="hot spares per node (--in-process)")
    parser.add_argument("--kill-rank", type=int, default=0, help="rank to kill (--in-process)")
    chaos_shrink.add_arguments(parser)  # --shrink, --regrow
    parser.add_argument("--kills", type=int, default=0,
                        help="instead of one kill at --at-step, SIGKILL a random rank this many times (any mode), each a "
                             "random 0..--kill-jitter s after the job committed a step past the previous recovery")
    parser.add_argument("--kill-jitter", type=float, default=1.0, help="--kills: up to this many seconds after a step")
    parser.add_argument("--kill-rate", type=float, default=None, metavar="PER_MINUTE",
                        help="--kills: a Poisson schedule instead (exponential inter-arrival times at this many kills per "
                             "minute, counted from the job's first committed step)")
    parser.add_argument("--seed", type=int, default=0, help="--kills: seed of the random ranks and moments")
    parser.add_argument("--no-parity", action="store_true",
                        help="run --config without parity: a restart resumes from the last checkpoint")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report's facts as JSON")
    parser.add_argument("--kill-all", action="store_true",
                        help="SIGKILL every rank at once (agents live on and restart them; nobody can spill)")
    parser.add_argument("--at-step", type=int, default=None, help="training step at which the node dies (unused with --kills)")
    parser.add_argument("--phase", choices=PHASES, default="before_forward")
    parser.add_argument("--replace", action="store_true", help="start a replacement node (else the job shrinks)")
    parser.add_argument("--rejoin-after", type=float, default=None, metavar="SECONDS",
                        help="without --replace: a new node joins this long after the shrunk job resumed, and the "
                             "job grows again")
    parser.add_argument("--no-reference", action="store_true", help="skip the fault-free run (no digest match)")
    parser.add_argument("--reuse-reference", action="store_true",
                        help="reuse the fault-free run a previous drill with the same config and options left in --workdir")
    parser.add_argument("--reference-steps", type=int, default=None, metavar="N",
                        help="the fault-free run trains only N steps (N >= --at-step): enough to check the restored state "
                             "of a long job at a fraction of the cost; the final digests are then not compared")
    parser.add_argument("--timeout", type=int, default=600, help="seconds each run may take")
    parser.add_argument("--last-call", type=int, default=3, help="rendezvous last-call wait, seconds")
    parser.add_argument("--workdir", type=Path, default=Path("runs/chaos"))
    parser.add_argument("overrides", nargs="*", help="extra `fit` arguments, e.g. --trainer.max_steps=40")
    args, unknown = parser.parse_known_args(argv)
    args.overrides += unknown
    if args.at_step is None and not args.kills:
        parser.error("give --at-step S (one kill at step S) or --kills N (N random kills)")
    if args.kills < 0:
        parser.error(f"--kills {args.kills} must be >= 0")
    if args.kills and (args.kill_all or args.replace or args.rejoin_after is not None):
        parser.error("--kills kills one random rank at a time; leave out --kill-all, --replace and --rejoin-after")
    if args.kill_rate is not None and (not args.kills or args.kill_rate <= 0):
        parser.error("--kill-rate R (> 0 kills per minute) schedules the kills of --kills N; give both")
    if args.no_parity and args.script is not None:
        parser.error("--no-parity overrides --config's strategy; with --script, turn parity off in your script")
    if not 0 <= args.kill_node < args.nodes:
        parser.error(f"--kill-node {args.kill_node} is not a node of --nodes {args.nodes}")
    if args.replace and args.rejoin_after is not None:
        parser.error("--rejoin-after is for a job that shrinks first; leave out --replace")
    if args.in_process and not 0 <= args.kill_rank < args.nodes * args.nproc_per_node:
        parser.error(f"--kill-rank {args.kill_rank} is not a rank of {args.nodes} x {args.nproc_per_node}")
    if args.in_process and (args.kill_all or args.rejoin_after is not None):
        parser.error("--in-process replaces one rank; leave out --kill-all and --rejoin-after")
    if args.nodes < 2 and not args.replace and not args.kill_all and not args.in_process and not args.kills:
        parser.error("a job of one node cannot shrink: pass --replace or --nodes >= 2")
    if args.script is None and not args.config.is_file():
        parser.error(f"--config {args.config} does not exist")
    if args.script is not None and not args.script.is_file():
        parser.error(f"--script {args.script} does not exist")
    if args.reference_steps is not None and (args.script is not None or args.no_reference):
        parser.error("--reference-steps shortens the fault-free run of --config; leave it out with --script or --no-reference")
    if args.reference_steps is not None and args.kills:
        parser.error("--reference-steps shortens the fault-free run, which a --kills drill measures its goodput against")
    if args.reference_steps is not None and args.at_step is not None and args.reference_steps < args.at_step:
        parser.error(f"--reference-steps {args.reference_steps} stops before --at-step {args.at_step}: the restored state "
                     "(at --at-step or the commit before it) would have nothing to compare with")
    if args.kill_all and (args.replace or args.rejoin_after is not None):
        parser.error("--kill-all restarts the same nodes; leave out --replace and --rejoin-after")
    chaos_shrink.check(parser, args)
    args.workdir = args.workdir.resolve()
    args.config = args.config.resolve()
    args.script = args.script.resolve() if args.script is not None else None
    return args


def _reference(args: argparse.Namespace) -> Run | None:
    """The fault-free run of the same job and mode (``None`` with ``--no-reference``), reused from ``--workdir``
    with ``--reuse-reference``."""
    if args.no_reference:
        return None
    program = (args.script or args.config).read_bytes()
    mode = [args.in_process, args.spares if args.in_process else None, args.no_parity, args.shrink]
    key = hashlib.sha256(repr([program, args.nodes, args.nproc_per_node, args.overrides + _reference_overrides(args),
                               *mode]).encode())
    cached = args.workdir / f"reference-{key.hexdigest()[:16]}.jsonl"
    wall = cached.with_suffix(".wall.json")
    if args.reuse_reference and cached.is_file():
        return Run(True, read_events([cached]), json.loads(wall.read_text())["wall_s"] if wall.is_file() else None)
    print(f"chaos: {'the job shrunk by the restart path' if args.shrink else 'fault-free reference run'} ...", flush=True)
    reference = _reference_run(args)
    if reference.finished:
        shutil.copy(args.workdir / "reference" / "events.jsonl", cached)
        wall.write_text(json.dumps({"wall_s": reference.wall_s}))
    return reference


def main(argv: list[str] | None = None) -> int:
    """Runs the drill and prints its summary; exit status 0 when the job recovered and finished (and, with
    ``--kills N``, all N kills landed)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    reference = _reference(args)
    if args.kills:
        print(f"chaos: run with {args.kills} random ranks SIGKILLed (seed {args.seed}) ...", flush=True)
    else:
        victim = "every rank" if args.kill_all else f"rank {args.kill_rank}" if args.in_process else f"node {args.kill_node}"
        print(f"chaos: run with {victim} killed at step {args.at_step} ...", flush=True)
    run = _faulted_run(args)
    ref_events = reference.events if reference is not None and reference.finished else None
    print("\nchaos summary")
    for line in summarize(args, run.finished, run.events, ref_events, walls=(
            run.wall_s, reference.wall_s if reference is not None else None), landed=(run.landed, run.short)):
        print(f"  {line}")
    if args.json is not None:
        facts = drill_facts(args, run.finished, run.events, ref_events, (run.wall_s, reference.wall_s if reference
                                                                          else None), (run.landed, run.short))
        args.json.write_text(json.dumps(facts, indent=1))
    sys.stdout.flush()
    if args.kills and run.landed < args.kills:
        print(f"chaos: FAILED: only {run.landed} of {args.kills} kills landed ({run.short}); this drill did not drill. "
              "Give the job more steps (--trainer.max_steps) or a shorter --kill-jitter / higher --kill-rate.",
              file=sys.stderr, flush=True)
        return 2
    return 0 if run.finished else 1
