"""``lightning-dlrover chaos``: a node-loss drill on one machine.

Starts a multi-node job as several ``torchrun`` agents on 127.0.0.1 (c10d rendezvous on a store this
runner hosts, so that no node's death takes the rendezvous with it), kills one node (its agent and
workers, SIGKILL) when it reaches a given step, optionally starts a replacement node, and reports whether
the job recovered, how long detection and resumption took, how many committed steps were lost, and
whether the final state digest equals that of the same job run without a fault::

    lightning-dlrover chaos --nodes 2 --kill-node 0 --at-step 12 --replace

Each node gets its own spill directory (``/dev/shm/lightning_dlrover/<run>/node<i>``), as separate
machines would. Logs of every agent are kept under ``--workdir``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from torch.distributed import TCPStore

from lightning_dlrover.fault.injector import FAULT_ENV, PHASES
from lightning_dlrover.fault.recovery import SPILL_ENV

#: Restarted workers must not share the agents' store: they would read addresses the dead workers left there.
STORE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "chaos.yaml"
_TIME = r"(\d+\.\d+)"
_KILLED = re.compile(rf"FaultInjector: killing node at {_TIME}")
_STOPPED = re.compile(rf"lightning_dlrover \[{_TIME}\]: rank \d+ stopped at {_TIME}")
_RECOVERED = re.compile(rf"lightning_dlrover \[{_TIME}\]: (recovered step (\d+) .*?); resuming")
_FALLBACK = re.compile(rf"lightning_dlrover \[{_TIME}\]: (.*Resuming from checkpoint .* (\d+) committed steps lost)")
_RESUMED = re.compile(rf"lightning_dlrover \[{_TIME}\]: training resumed")
_DIGEST = re.compile(r"^state digest: ([0-9a-f]{64})$", re.MULTILINE)
_STEP_DIGEST = re.compile(r"^state digest at step (\d+): ([0-9a-f]{64})$", re.MULTILINE)
#: With a reference run, both runs print the state digest at their start and after every step (a gather of the
#: whole state per step), to compare the restored state with the fault-free one.
DIGEST_ARGS = [
    "--trainer.callbacks+=lightning_dlrover.StateDigest",
    "--trainer.callbacks.at_start=true",
    "--trainer.callbacks.every_n_steps=1",
]


@dataclass
class Job:
    """The agents of one multi-node run and their logs."""

    name: str
    workdir: Path
    agents: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def output(self) -> str:
        return "\n".join(path.read_text(errors="replace") for path in self.logs if path.exists())

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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    """Starts ``torchrun`` agents of one job, each as a separate node with its own spill directory."""

    def __init__(self, args: argparse.Namespace, name: str, min_nodes: int) -> None:
        self.args, self.name, self.min_nodes = args, name, min_nodes
        self.port = _free_port()
        self.store = TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False)
        self.run_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.spill_root = Path("/dev/shm/lightning_dlrover") / self.run_id
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
            f"--rdzv-conf={rdzv}", "--max-restarts=3", "--monitor-interval=0.2",
            "-m", "lightning_dlrover", "fit", "--config", str(a.config),
            f"--trainer.default_root_dir={self.job.workdir}", *a.overrides, *([] if a.no_reference else DIGEST_ARGS),
        ]  # fmt: skip
        full_env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
        full_env.update({SPILL_ENV: str(self.spill_root / f"node{index}"), **STORE_ENV, **(env or {})})
        log = self.job.workdir / f"node{index}.log"
        with open(log, "w") as out:
            agent = subprocess.Popen(command, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.job.agents.append(agent)
        self.job.logs.append(log)

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
        shutil.rmtree(self.spill_root, ignore_errors=True)


def _reference_run(args: argparse.Namespace) -> str | None:
    """The output of the same job without a fault (``None`` if it did not finish)."""
    cluster = Cluster(args, "reference", args.nodes)
    try:
        for index in range(args.nodes):
            cluster.start_node(index)
        return cluster.job.output() if cluster.wait(time.time() + args.timeout) else None
    finally:
        cluster.close()


def _faulted_run(args: argparse.Namespace) -> tuple[bool, str]:
    """Runs the job, kills node ``--kill-node`` at ``--at-step``, optionally replaces it; returns (finished, output)."""
    min_nodes = args.nodes if args.replace else args.nodes - 1
    cluster = Cluster(args, "faulted", min_nodes)
    fault = f"step={args.at_step},phase={args.phase},target=node"
    deadline = time.time() + args.timeout
    try:
        for index in range(args.nodes):
            cluster.start_node(index, {FAULT_ENV: fault} if index == args.kill_node else None)
        victim = cluster.job.agents[args.kill_node]
        while victim.poll() is None and time.time() < deadline:
            if any(a.poll() is not None for a in cluster.job.agents if a is not victim):
                break
            time.sleep(0.2)
        if victim.poll() not in (None, 0) and args.replace:
            print(f"chaos: node {args.kill_node} is down; starting a replacement node", flush=True)
            cluster.start_node(args.nodes)
        elif victim.poll() not in (None, 0) and args.rejoin_after is not None:
            while not _RESUMED.search(cluster.job.output()) and time.time() < deadline:
                time.sleep(0.2)
            time.sleep(args.rejoin_after)
            print(f"chaos: a node rejoins {args.rejoin_after} s after the shrunk job resumed", flush=True)
            cluster.start_node(args.nodes)
        survivors = [a for a in cluster.job.agents if a is not victim]
        finished = all(a.wait(timeout=max(deadline - time.time(), 0.1)) == 0 for a in survivors)
        return finished, cluster.job.output()
    except subprocess.TimeoutExpired:
        return False, cluster.job.output()
    finally:
        cluster.close()


def summarize(args: argparse.Namespace, finished: bool, output: str, reference_output: str | None) -> list[str]:
    """The report's lines: recovered or not, detection time, time to resume, steps lost, digest match."""
    reference = (_DIGEST.findall(reference_output) or [None])[-1] if reference_output else None
    reference_steps = dict(_STEP_DIGEST.findall(reference_output or ""))
    killed = [float(t) for t in _KILLED.findall(output)]
    stopped = [float(t) for _, t in _STOPPED.findall(output)]
    recovered = _RECOVERED.findall(output)
    fallback = _FALLBACK.findall(output)
    resumed = [float(t) for t in _RESUMED.findall(output)]
    digests = _DIGEST.findall(output)
    kill = killed[0] if killed else None
    lines = [
        f"nodes: {args.nodes} x {args.nproc_per_node} ranks; killed node {args.kill_node} at step {args.at_step} "
        f"({args.phase}); replacement: {'yes' if args.replace else 'no (shrink)'}"
        + (f", a node rejoins {args.rejoin_after} s after it resumed" if args.rejoin_after is not None else ""),
        f"node killed: {'yes' if kill is not None else 'no'}",
    ]
    if recovered:
        lines += [f"recovered: yes, from survivors' spills ({event[1]})" for event in recovered]
        lost = "0"
        step = recovered[0][2]
        restored = {d for s, d in _STEP_DIGEST.findall(output) if s == step}
        if step in reference_steps:
            same = restored == {reference_steps[step]}
            lines.append(f"restored state equals the fault-free state at step {step}: {'yes' if same else 'no'}")
    elif fallback:
        lines.append(f"recovered: from the last checkpoint ({fallback[-1][1]})")
        lost = fallback[-1][2]
    else:
        lines.append("recovered: no")
        lost = "unknown"
    if kill is not None and stopped:
        lines.append(f"detection: {min(stopped) - kill:.2f} s (kill to the first survivor stopping)")
    if kill is not None and (recovered or fallback):
        at = float((recovered or fallback)[0][0])
        lines.append(f"state restored: {at - kill:.2f} s after the kill (restart, rendezvous, decode, re-shard)")
    if kill is not None and resumed:
        lines.append(f"time to resume: {resumed[0] - kill:.2f} s (kill to the first committed step after)")
    lines.append(f"steps lost: {lost}")
    lines.append(f"job finished: {'yes' if finished else 'no'}")
    lines.append(f"final digest: {digests[-1] if digests else 'none'}")
    if reference is not None:
        lines.append(f"fault-free digest: {reference}")
    match = bool(digests) and reference is not None and digests[-1] == reference and finished
    lines.append(f"digest match: {'yes' if match else 'no'}{'' if reference_output else ' (no fault-free run to compare)'}")
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lightning-dlrover chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a `lightning-dlrover fit` config")
    parser.add_argument("--nodes", type=int, default=2, help="torchrun agents to start, each a node")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node")
    parser.add_argument("--kill-node", type=int, required=True, help="index of the node to kill (0-based)")
    parser.add_argument("--at-step", type=int, required=True, help="training step at which the node dies")
    parser.add_argument("--phase", choices=PHASES, default="before_forward")
    parser.add_argument("--replace", action="store_true", help="start a replacement node (else the job shrinks)")
    parser.add_argument("--rejoin-after", type=float, default=None, metavar="SECONDS",
                        help="without --replace: a new node joins this long after the shrunk job resumed, and the "
                             "job grows again")
    parser.add_argument("--no-reference", action="store_true", help="skip the fault-free run (no digest match)")
    parser.add_argument("--reuse-reference", action="store_true",
                        help="reuse the fault-free run a previous drill with the same config and options left in --workdir")
    parser.add_argument("--timeout", type=int, default=600, help="seconds each run may take")
    parser.add_argument("--last-call", type=int, default=3, help="rendezvous last-call wait, seconds")
    parser.add_argument("--workdir", type=Path, default=Path("runs/chaos"))
    parser.add_argument("overrides", nargs="*", help="extra `fit` arguments, e.g. --trainer.max_steps=40")
    args, unknown = parser.parse_known_args(argv)
    args.overrides += unknown
    if not 0 <= args.kill_node < args.nodes:
        parser.error(f"--kill-node {args.kill_node} is not a node of --nodes {args.nodes}")
    if args.replace and args.rejoin_after is not None:
        parser.error("--rejoin-after is for a job that shrinks first; leave out --replace")
    if args.nodes < 2 and not args.replace:
        parser.error("a job of one node cannot shrink: pass --replace or --nodes >= 2")
    if not args.config.is_file():
        parser.error(f"--config {args.config} does not exist")
    args.workdir = args.workdir.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the drill and prints its summary; exit status 0 when the job recovered and finished."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    reference = None
    if not args.no_reference:
        key = hashlib.sha256(repr([args.config.read_bytes(), args.nodes, args.nproc_per_node, args.overrides]).encode())
        cached = args.workdir / f"reference-{key.hexdigest()[:16]}.log"
        if args.reuse_reference and cached.is_file():
            reference = cached.read_text()
        else:
            print("chaos: fault-free reference run ...", flush=True)
            reference = _reference_run(args)
            if reference is not None:
                cached.write_text(reference)
    print(f"chaos: run with node {args.kill_node} killed at step {args.at_step} ...", flush=True)
    finished, output = _faulted_run(args)
    print("\nchaos summary")
    for line in summarize(args, finished, output, reference):
        print(f"  {line}")
    sys.stdout.flush()
    return 0 if finished else 1
