"""``lightning-dlrover``: ``fit`` (and the other LightningCLI subcommands) for the DLRM, ``launch``, a launcher that
recovers lost ranks in process, ``export``, a checkpoint as an unsharded model for serving, ``chaos``, a node-loss drill, ``advise``, resource advice, ``plan``, the fault-tolerance plan, ``simulate``, the multi-job
simulator, ``gen-criteo``, Criteo-format TSV test data, and ``profile``, the measurement the simulator uses.

``lightning-dlrover --help`` lists them all (:data:`COMMANDS`) without importing Lightning or TorchRec."""

from __future__ import annotations

import sys
from importlib import import_module
from typing import NamedTuple


class Command(NamedTuple):
    """A subcommand: the module whose ``main(argv) -> int`` runs it (``None``: LightningCLI), what it does, an
    example."""

    module: str | None
    summary: str
    example: str


#: Every subcommand of ``lightning-dlrover``, in the order ``--help`` lists them.
COMMANDS: dict[str, Command] = {
    "fit": Command(None, "train the DLRM from a YAML config (LightningCLI)",
                   "lightning-dlrover fit --config configs/demo.yaml --trainer.devices=2"),
    "validate": Command(None, "one evaluation pass over the validation set (LightningCLI)",
                        "lightning-dlrover validate --config configs/demo.yaml --ckpt_path last.ckpt"),
    "test": Command(None, "log loss, AUC, calibration and NE over the test set (LightningCLI)",
                    "lightning-dlrover test --config configs/demo.yaml --ckpt_path last.ckpt"),
    "predict": Command(None, "one click probability per sample, in input order, to a CSV/Parquet file (LightningCLI)",
                       "lightning-dlrover predict --config configs/demo.yaml --ckpt_path last.ckpt "
                       "--predictions.out preds.csv"),
    "export": Command("lightning_dlrover.cli.export",
                      "write a checkpoint as an unsharded model for serving (state dict, torch.export program)",
                      "lightning-dlrover export --ckpt_path checkpoints/last.ckpt --out exported"),
    "launch": Command("lightning_dlrover.cli.launch",
                      "start one machine's ranks like torchrun; a lost rank is replaced while the others train on",
                      "lightning-dlrover launch --nproc-per-node 2 --spares 1 -- train.py --config my.yaml"),
    "chaos": Command("lightning_dlrover.cli.chaos",
                     "node-loss drill: run a job, kill a node (or rank) at a step, report the recovery",
                     "lightning-dlrover chaos --nodes 2 --kill-node 0 --at-step 12 --replace"),
    "advise": Command("lightning_dlrover.cli.advise", "list the job history and recommend resources for a job",
                      "lightning-dlrover advise --config configs/demo.yaml"),
    "plan": Command("lightning_dlrover.cli.plan",
                    "choose parity, commit interval, checkpoints and spares for a job; its goodput at 8-4096 ranks",
                    "lightning-dlrover plan --config configs/benchmark.yaml --ranks 1024 --plot goodput.png"),
    "simulate": Command("lightning_dlrover.cli.simulate", "replay a trace of jobs on a cluster under several policies",
                        "lightning-dlrover simulate --trace synthetic --devices 32 --plot sim.png"),
    "gen-criteo": Command("lightning_dlrover.cli.gen_criteo", "write synthetic Criteo-format TSV day files",
                          "lightning-dlrover gen-criteo --out data/criteo --files 2 --size-mb 10"),
    "profile": Command("lightning_dlrover.cli.profile",
                       "measure the DLRM step times and convergence the simulator uses (minutes)",
                       "lightning-dlrover profile --out dlrm_profile.json"),
}


def usage() -> str:
    """The top-level help: every subcommand with what it does and an example."""
    width = max(map(len, COMMANDS))
    lines = ["usage: lightning-dlrover <command> [options]   (lightning-dlrover <command> --help: its options)", "",
             "commands:"]
    for name, command in COMMANDS.items():
        lines += [f"  {name:<{width}}  {command.summary}", f"  {'':<{width}}    e.g. {command.example}"]
    lines += ["", "fit/validate/test/predict also take LightningCLI's top-level options (-c/--config, --print_config)",
              "before the subcommand; `python -m lightning_dlrover` runs the same as `lightning-dlrover`."]
    return "\n".join(lines)


def main(args: list[str] | None = None) -> None:
    """Runs the command line (``args`` defaults to ``sys.argv[1:]``); exits with the subcommand's status."""
    from_argv = args is None
    args = sys.argv[1:] if args is None else args
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        sys.exit(0 if args else 2)
    command = COMMANDS.get(args[0])
    if command is None and not args[0].startswith("-"):
        print(f"lightning-dlrover: unknown command {args[0]!r}; choose one of {', '.join(COMMANDS)} "
              "(lightning-dlrover --help lists them with examples).", file=sys.stderr)
        sys.exit(2)
    if command is not None and command.module is not None:
        sys.exit(import_module(command.module).main(args[1:]))
    from lightning_dlrover.cli.fit import fit

    # LightningCLI warns when given both args and a command line; from the console it reads sys.argv itself
    fit(None if from_argv else args)
