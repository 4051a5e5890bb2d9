"""``lightning-dlrover``: ``fit`` (and the other LightningCLI subcommands) for the DLRM, ``chaos``, a node-loss drill,
``launch``, a launcher that recovers lost ranks in process, ``advise``, resource advice, ``gen-criteo``,
Criteo-format TSV test data, and ``simulate``, the multi-job simulator."""

from __future__ import annotations

import sys


def main(args: list[str] | None = None) -> None:
    """Runs the command line (``args`` defaults to ``sys.argv[1:]``)."""
    args = sys.argv[1:] if args is None else args
    if args[:1] == ["chaos"]:
        from lightning_dlrover.cli.chaos import main as chaos

        sys.exit(chaos(args[1:]))
    if args[:1] == ["launch"]:
        from lightning_dlrover.cli.launch import main as launch

        sys.exit(launch(args[1:]))
    if args[:1] == ["gen-criteo"]:
        from lightning_dlrover.cli.gen_criteo import main as gen_criteo

        sys.exit(gen_criteo(args[1:]))
    if args[:1] == ["advise"]:
        from lightning_dlrover.cli.advise import main as advise

        sys.exit(advise(args[1:]))
    if args[:1] == ["simulate"]:
        from lightning_dlrover.cli.simulate import main as simulate

        sys.exit(simulate(args[1:]))
    from lightning_dlrover.cli.fit import fit

    fit(args)
