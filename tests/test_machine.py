"""The machine's cores and memory as every package sees them: the affinity mask capped by a cgroup CPU quota (v2
``cpu.max``, else v1 ``cpu.cfs_quota_us``), and the cgroup memory limit capped by physical memory."""

from __future__ import annotations

import os

import psutil

from lightning_dlrover import machine
from lightning_dlrover.data.staged.config import FEW_CORES, for_machine


def _cgroup(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_without_cgroup_files_the_affinity_mask_counts(tmp_path):
    assert machine.cpu_quota(tmp_path) is None
    assert machine.available_cores(tmp_path) == len(os.sched_getaffinity(0))
    assert machine.memory_limit_bytes(tmp_path) == psutil.virtual_memory().total


def test_a_v2_quota_caps_the_cores_and_max_means_none(tmp_path):
    assert machine.cpu_quota(_cgroup(tmp_path, {"cpu.max": "150000 100000\n"})) == 1.5
    assert machine.available_cores(tmp_path) == 1  # 1.5 cores of quota: one whole core
    assert machine.cpu_quota(_cgroup(tmp_path, {"cpu.max": "max 100000\n"})) is None
    assert machine.available_cores(tmp_path) == len(os.sched_getaffinity(0))


def test_a_quota_above_the_affinity_mask_changes_nothing_and_v1_is_read(tmp_path):
    root = _cgroup(tmp_path, {"cpu/cpu.cfs_quota_us": "6400000", "cpu/cpu.cfs_period_us": "100000"})
    assert machine.cpu_quota(root) == 64.0
    assert machine.available_cores(root) == len(os.sched_getaffinity(0))
    root = _cgroup(tmp_path, {"cpu/cpu.cfs_quota_us": "-1"})  # v1: no quota
    assert machine.cpu_quota(root) is None


def test_a_malformed_file_is_no_limit_not_an_error(tmp_path):
    root = _cgroup(tmp_path, {"cpu.max": "garbage", "memory.max": "lots"})
    assert machine.cpu_quota(root) is None
    assert machine.memory_limit_bytes(root) == psutil.virtual_memory().total


def test_a_memory_limit_below_physical_memory_is_the_limit(tmp_path):
    assert machine.memory_limit_bytes(_cgroup(tmp_path, {"memory.max": str(2**30)})) == 2**30
    assert machine.memory_limit_bytes(_cgroup(tmp_path, {"memory.max": "max"})) == psutil.virtual_memory().total
    root = _cgroup(tmp_path / "v1", {"memory/memory.limit_in_bytes": str(3 * 2**30)})
    assert machine.memory_limit_bytes(root) == 3 * 2**30


def test_the_pipelines_start_follows_the_quota_limited_cores():
    # 2 quota cores on a 64-core host with 2 ranks: no core left per rank, everything inline
    assert for_machine(ranks_per_node=2, trainer_threads=1, cores=2) == FEW_CORES
    assert for_machine(ranks_per_node=2, trainer_threads=1, cores=64) != FEW_CORES
