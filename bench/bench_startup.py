"""Start-up cost of the command lines: CPU seconds and peak memory of one process, until it exits.

Each command runs ``--repeats`` times, interleaved (so drifts of a shared machine hit every command alike); the
table gives the median CPU (user + sys, from ``os.wait4`` of that process alone) and its peak RSS, and the
ratio to the same command with every export of the package imported first (what ``import lightning_dlrover``
cost before its exports were lazy). The floor is what the launcher cannot avoid: ``torch.distributed`` (its
``TCPStore``); the worker line is what every training process pays anyway (Lightning and TorchRec).

    PYTHONPATH=. python bench/bench_startup.py               # about 2 minutes on 2 shared cores
    PYTHONPATH=. python bench/bench_startup.py --baseline DIR  # ratios to another checkout (e.g. an older commit)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EAGER = "import lightning_dlrover as p; [getattr(p, n) for n in p.__all__]; "
COMMANDS = {  # name -> (code run by `python -c`, whether an eager twin is measured)
    "launch --help": ("from lightning_dlrover.cli import main; main(['launch', '--help'])", True),
    "chaos --help": ("from lightning_dlrover.cli import main; main(['chaos', '--help'])", True),
    "advise --help": ("from lightning_dlrover.cli import main; main(['advise', '--help'])", True),
    "simulate --help": ("from lightning_dlrover.cli import main; main(['simulate', '--help'])", True),
    "gen-criteo --help": ("from lightning_dlrover.cli import main; main(['gen-criteo', '--help'])", True),
    "floor: import torch.distributed": ("import torch.distributed", False),
    "worker: import lightning.pytorch, torchrec": ("import lightning.pytorch, torchrec", False),
}


def measure(code: str, tree: Path) -> tuple[float, float]:
    """(CPU seconds, peak RSS in MiB) of ``python -c code`` with ``tree`` importable."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tree, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) not in (0,):
        raise SystemExit(f"`python -c {code!r}` failed: {proc.stderr.read().decode()[-2000:]}")
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout to compare with (its commands as they are) instead of the eager imports")
    args = parser.parse_args()
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.repeats):
        for name, (code, twin) in COMMANDS.items():
            runs.setdefault((name, "lazy"), []).append(measure(code, REPO))
            if twin and args.baseline is not None:
                runs.setdefault((name, "baseline"), []).append(measure(code, args.baseline))
            elif twin:
                runs.setdefault((name, "baseline"), []).append(measure(EAGER + code, REPO))
    label = f"baseline ({args.baseline})" if args.baseline else "eager exports"
    print(f"| command | CPU s (lazy) | CPU s ({label}) | ratio | peak RSS MiB (lazy) | peak RSS MiB (baseline) |")
    print("|---|---|---|---|---|---|")
    for name, (_, twin) in COMMANDS.items():
        cpu = statistics.median(c for c, _ in runs[(name, "lazy")])
        rss = statistics.median(r for _, r in runs[(name, "lazy")])
        if twin:
            base_cpu = statistics.median(c for c, _ in runs[(name, "baseline")])
            base_rss = statistics.median(r for _, r in runs[(name, "baseline")])
            print(f"| {name} | {cpu:.2f} | {base_cpu:.2f} | {cpu / base_cpu:.2f}x | {rss:.0f} | {base_rss:.0f} |")
        else:
            print(f"| {name} | {cpu:.2f} | | | {rss:.0f} | |")


if __name__ == "__main__":
    main()
