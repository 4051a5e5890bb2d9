"""Shared helpers: run the package's real multi-process jobs as subprocesses and read what they print."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "tests" / "scripts" / "train.py"
DIGEST = re.compile(r"^state digest(?: at step (\d+))?: ([0-9a-f]{64})$", re.MULTILINE)


def run(args: list[str], cwd: Path, timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Runs ``python *args`` in ``cwd`` with the repository importable; returns stdout+stderr as ``.stdout``."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        pytest.fail(f"`python {' '.join(args)}` exited {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc


def train(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs ``tests/scripts/train.py`` (a multi-process DLRoverStrategy job)."""
    return run([str(TRAIN_SCRIPT), *args], cwd, check=check)


def digests(output: str) -> dict[str, str]:
    """``{"end": hex}`` for the strategy's final digest and ``{"<step>": hex}`` for StateDigest lines."""
    return {step or "end": value for step, value in DIGEST.findall(output)}
