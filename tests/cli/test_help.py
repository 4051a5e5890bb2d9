"""``lightning-dlrover --help`` (the console script, a real process) lists every subcommand with a working example and
prints nothing on stderr; an unknown subcommand is named with the list of the known ones."""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

CONSOLE_SCRIPT = str(Path(sys.executable).parent / "lightning-dlrover")
SUBCOMMANDS = ["fit", "validate", "test", "predict", "export", "launch", "chaos", "advise", "plan", "simulate", "gen-criteo", "profile"]
LIGHTNING = {"fit", "validate", "test", "predict"}


def lightning_dlrover(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([CONSOLE_SCRIPT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def examples(help_text: str) -> dict[str, str]:
    """``{subcommand: its example}`` from the top-level help: a line ``  name  summary`` then ``e.g. <example>``."""
    found, name = {}, None
    for line in help_text.splitlines():
        if m := re.match(r"^  (\S+)\s{2,}\S", line):
            name = m.group(1)
        elif (m := re.match(r"^\s+e\.g\. (lightning-dlrover .*)$", line)) and name:
            found[name] = m.group(1)
    return found


def test_help_lists_every_subcommand_with_an_example_whose_options_exist_and_warns_of_nothing():
    top = lightning_dlrover("--help")
    assert top.returncode == 0 and top.stderr == "", top.stderr
    listed = examples(top.stdout)
    assert list(listed) == SUBCOMMANDS, top.stdout
    for name, example in listed.items():
        assert example.startswith(f"lightning-dlrover {name} "), example
    fit = lightning_dlrover("fit", "--help")  # LightningCLI's own help, without its warning about `args`
    assert fit.returncode == 0 and fit.stderr == "", fit.stderr
    assert fit.stdout.startswith("usage: lightning-dlrover [options] fit")
    for name, example in listed.items():
        own = fit if name in LIGHTNING else lightning_dlrover(name, "--help")
        assert own.returncode == 0 and own.stderr == "", (name, own.stderr)
        if name not in LIGHTNING:
            assert own.stdout.startswith(f"usage: lightning-dlrover {name}"), own.stdout[:200]
        options = re.findall(r"(--[a-z_.-]+)", example.split(" -- ")[0])
        assert options and all(option in own.stdout for option in options), (name, options)


def test_an_unknown_subcommand_is_named_with_the_known_ones():
    out = lightning_dlrover("chaos-report")
    assert out.returncode == 2 and out.stdout == ""
    assert "unknown command 'chaos-report'; choose one of fit, validate, test, predict, export, launch, chaos" in out.stderr


def test_help_imports_neither_torch_nor_lightning_nor_torchrec():
    code = ("import runpy, sys\n"
            "sys.argv = ['lightning-dlrover', '--help']\n"
            "try:\n"
            "    runpy.run_module('lightning_dlrover', run_name='__main__')\n"
            "except SystemExit as stop:\n"
            "    print('exit', stop.code)\n"
            "print(sorted(m for m in ('torch', 'lightning', 'torchrec') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines()[-2:] == ["exit 0", "[]"], out.stdout[-2000:] + out.stderr[-2000:]
