"""The data pipeline at its edges: a process that stopped a loader on a malformed line exits, and the in-process and
staged loaders parse by one rule."""

import sys

import pytest
import torch

from lightning_dlrover.data import CriteoTSV, ResumableLoader
from lightning_dlrover.data.generate import GeneratorConfig, generate_days
from lightning_dlrover.data.staged import PipelineConfig, PipelinedLoader
from lightning_dlrover.data.tsv_parse import MalformedLine
from tests.conftest import REPO, run

SIZES = [1000] * 26


def test_a_process_exits_after_loaders_with_worker_processes_stop_on_a_malformed_line(tmp_path):
    # Before: multiprocessing's exit handler joined a queue's feeder thread that was writing a 655 KB block into a
    # pipe no worker read any more, and the process never exited. The timeout only detects that hang.
    script = REPO / "tests" / "scripts" / "stop_on_malformed.py"
    out = run([script, tmp_path / "data", 3], tmp_path, timeout=180).stdout
    assert out.count("stopped at line 2055") == 1 and out.count("stopped at line 6000") == 3 and "exiting" in out
