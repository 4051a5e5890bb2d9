"""Changes that need a restart (world size, nodes, a better sharding plan): deciding how the job gets there.

Two ways, chosen by :func:`decide_restart`:

- ``checkpoint``: the advisor (``restart="stop"``) saves the job's state at a step boundary with the strategy's
  own checkpoint (``DLRoverStrategy`` writes every rank's shards and loads them into any sharding and any smaller
  world size), stops the fit cleanly, and prints the exact command that resumes it with the new resources
  (``--ckpt_path``). Whoever runs the job (a person, a scheduler, ``bench/bench_advisor.py``) relaunches it.
- ``instructions``: nothing is stopped; the command, the config change and the Kubernetes replica change are
  printed and recorded (``restart="print"``, the default).
- ``join``: more machines for a job under ``lightning-dlrover launch --max-nnodes`` with room for them: nothing is
  stopped (in either mode); the command to run on each new machine is printed, and its ranks join the running job
  at a commit (``lightning_dlrover.fault.inplace.join``).

Under ``torchrun`` with an elastic node range, a shrink to fewer nodes inside the range is one the launcher
honours without a new command: when the surplus nodes' agents stop, the survivors' agent restarts its workers
and they restore the committed state exactly from their spills and parity (``lightning_dlrover.fault``). The
decision says so (``launcher_honours``) and names the nodes to stop; the advisor does not stop agents itself.
Every decision is a structured ``restart`` event (``monitor.events``).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from lightning_dlrover.advisor import control
from lightning_dlrover.advisor.resources import ResourceConfig

RestartMode = Literal["print", "stop"]


@dataclass(frozen=True)
class RestartDecision:
    """How the job moves to ``target``.

    Attributes:
        how: ``checkpoint`` (stop now, resume from a checkpoint), ``instructions`` (print only) or ``join`` (start
            ``command`` on each new machine; the job grows in process).
        pending: the knobs that need the restart (``nodes``, ``ranks_per_node``, ...).
        command: the ``torchrun`` line that starts the job with ``target`` (with ``--ckpt_path`` when stopping).
        config: LightningCLI keys to change.
        kubernetes: the PyTorchJob / ElasticJob replica change, as YAML.
        launcher_honours: whether ``torchrun``'s elastic range takes the job there by stopping nodes (a shrink
            within ``--nnodes MIN:MAX``), the survivors restoring from their spills.
        stop_nodes: node ranks to stop for that shrink (empty otherwise).
        checkpoint: where the state is saved (``checkpoint`` only).
    """

    how: str
    current: ResourceConfig
    target: ResourceConfig
    pending: tuple[str, ...]
    command: str
    config: dict[str, Any]
    kubernetes: str
    launcher_honours: bool = False
    stop_nodes: tuple[int, ...] = ()
    checkpoint: str | None = None

    def text(self) -> str:
        """What people read: the change, the command, the config and Kubernetes changes."""
        lines = [f"Restart needed for: {', '.join(self.pending)} ({self.current.short()} -> {self.target.short()})"]
        if self.how == "checkpoint":
            lines.append(f"  stopped at a step boundary; state saved to {self.checkpoint}")
        if self.how == "join":
            lines[0] = (f"More machines ({self.current.short()} -> {self.target.short()}): no restart; run on each new "
                        "machine (its ranks join the running job at a commit):")
            return "\n".join(lines + ["  " + line for line in self.command.split(" ; ")])
        lines.append("  command:  " + self.command)
        if self.config:
            lines.append("  config:   " + ", ".join(f"{k}={v}" for k, v in self.config.items()))
        if self.launcher_honours:
            lines.append(f"  torchrun: the elastic node range allows {self.target.nodes} node(s): stopping node(s) "
                         f"{list(self.stop_nodes)} (their agents) makes the others restart from their spills, "
                         "without a new command")
        lines.append("  Kubernetes:")
        lines += ["    " + line for line in self.kubernetes.splitlines()]
        if self.how != "checkpoint":
            lines.append("  Resume from the job's newest checkpoint (DLRoverStrategy checkpoints load into any world "
                         "size it can re-shard onto).")
        return "\n".join(lines)

    def event_fields(self) -> dict[str, Any]:
        return {"how": self.how, "pending": list(self.pending), "current": self.current.to_dict(),
                "recommended": self.target.to_dict(), "command": self.command, "config": self.config,
                "kubernetes": self.kubernetes, "launcher_honours": self.launcher_honours,
                "stop_nodes": list(self.stop_nodes), "checkpoint": self.checkpoint}

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["current"], out["target"] = self.current.to_dict(), self.target.to_dict()
        return out


def decide_restart(current: ResourceConfig, target: ResourceConfig, callbacks: Any, program: list[str],
                   mode: RestartMode = "print", checkpoint: str | None = None,
                   node_range: tuple[int, int] | None = None, join_room: dict | None = None) -> RestartDecision | None:
    """The decision for moving from ``current`` to ``target`` (``None`` when every change is live).

    ``mode="stop"`` with a ``checkpoint`` path: stop and resume from it; otherwise print. ``node_range`` is the
    elastic ``(min, max)`` nodes under ``torchrun`` (``lightning_dlrover.worker_env.node_range``); ``join_room``
    the room for machines joining under ``launch`` (``lightning_dlrover.worker_env.join_room``).
    """
    if mode not in ("print", "stop"):
        raise ValueError(f"ResourceAdvisor(restart={mode!r}) must be 'print' or 'stop'.")
    pending = tuple(control.needs_restart(current, target, callbacks))
    if not pending:
        return None
    if joins(current, target, pending, join_room):
        launch = (f"lightning-dlrover launch --max-nnodes {join_room['max_nnodes']} --nproc-per-node "
                  f"{join_room['nproc_per_node']} --master {join_room['master']}")
        each = [f"{launch} --node-rank {k} -- {' '.join(program)}" for k in range(current.nodes, target.nodes)]
        return RestartDecision("join", current, target, pending, " ; ".join(each), {},
                               control.kubernetes_patch(current, target, 1.0))
    stopping = mode == "stop" and checkpoint is not None
    resume = resume_program(program, current, target, checkpoint if stopping else None)
    max_nodes = node_range[1] if node_range else None
    honours = bool(node_range and set(pending) <= {"nodes"} and node_range[0] <= target.nodes < current.nodes)
    return RestartDecision(
        how="checkpoint" if stopping else "instructions", current=current, target=target, pending=pending,
        command=control.torchrun_command(target, resume, max_nodes), config=control.config_changes(current, target),
        kubernetes=control.kubernetes_patch(current, target, 1.0), launcher_honours=honours,
        stop_nodes=tuple(range(target.nodes, current.nodes)) if honours else (), checkpoint=checkpoint if stopping else None)


def joins(current: ResourceConfig, target: ResourceConfig, pending: Any, join_room: dict | None) -> bool:
    """Whether the job reaches ``target`` by machines joining it in process: only more machines are pending, and the
    job was launched with room for them."""
    return bool(join_room) and tuple(pending) == ("nodes",) and current.nodes < target.nodes <= join_room["max_nnodes"]


#: ``lightning-dlrover`` / LightningCLI subcommands whose command line takes ``--trainer.*`` / ``--data.*`` keys.
_CLI_SUBCOMMANDS = ("fit", "validate", "test", "predict")


def is_lightning_cli(program: list[str]) -> bool:
    """Whether ``program`` (as from :func:`program_argv`) is ``lightning-dlrover fit`` (``-m lightning_dlrover`` or
    the entry point) or another LightningCLI program given a ``--config``, so that its command line takes the
    config keys of :func:`~lightning_dlrover.advisor.control.config_changes`."""
    if program[:1] == ["-m"]:
        script, rest = program[1:2], program[2:]
    else:
        script, rest = program[:1], program[1:]
    if not script or not rest or rest[0] not in _CLI_SUBCOMMANDS:
        return False
    ours = script[0] == "lightning_dlrover" or Path(script[0]).name == "lightning-dlrover"
    return ours or any(a == "--config" or a.startswith("--config=") for a in rest)


def _without(program: list[str], keys: set[str]) -> list[str]:
    """``program`` without the options ``keys`` (``--key=value`` or ``--key value``)."""
    out, skip = [], False
    for arg in program:
        if skip:
            skip = False
        elif arg in keys:
            skip = True
        elif arg.split("=", 1)[0] not in keys:
            out.append(arg)
    return out


def resume_program(program: list[str], current: ResourceConfig, target: ResourceConfig,
                   checkpoint: str | None = None) -> list[str]:
    """``program`` for a restart with ``target``: with ``--ckpt_path=checkpoint`` (replacing an earlier one) and,
    for a LightningCLI program (:func:`is_lightning_cli`), the keys the change needs (``--data.global_batch_size``,
    ``--trainer.devices``, ``--trainer.num_nodes``) in place of those it had, so that the resumed job runs the
    recommended global batch, not the checkpoint's config's."""
    args: list[str] = []
    if is_lightning_cli(program):
        args = [f"--{k}={v}" for k, v in control.config_changes(current, target).items() if k.count(".") == 1
                and " " not in k]
    keys = {a.split("=", 1)[0] for a in args} | ({"--ckpt_path"} if checkpoint else set())
    resume = [*_without(program, keys), *args]
    return [*resume, f"--ckpt_path={checkpoint}"] if checkpoint else resume


def program_argv() -> list[str]:
    """This process's command line as ``torchrun`` arguments (``-m package`` for ``python -m``)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):
        return ["-m", Path(argv[0]).parent.name, *argv[1:]]
    return argv
