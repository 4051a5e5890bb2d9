"""``make gpu-check`` keeps working on a GPU machine without TorchRec, checked here where there is neither GPU nor need.

The GPU machines lent to this project have PyTorch, CuPy and Lightning but no TorchRec CUDA build: the target must
install nothing, collect only test files that import without TorchRec, and its benchmark must skip cleanly without
CUDA (docs/gpu.md, "Checking on a GPU").
"""

import re
import subprocess

import pytest
import torch

from tests.conftest import REPO, run

#: Makes ``import torchrec`` / ``import fbgemm_gpu`` fail in a child interpreter, as on the GPU machines.
NO_TORCHREC = """
import sys
class _NoTorchRec:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torchrec", "fbgemm_gpu"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: a GPU machine without TorchRec)", name=name)
sys.meta_path.insert(0, _NoTorchRec())
"""


def recipe() -> str:
    text = (REPO / "Makefile").read_text()
    match = re.search(r"^gpu-check:.*?(?=^\S|\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, "the Makefile has no gpu-check target"
    return match.group(0)


def gpu_test_files() -> list[str]:
    """The files ``make gpu-check`` hands to pytest (the Makefile's own ``GPU_TESTS`` expansion)."""
    out = subprocess.run(["make", "-s", "-n", "gpu-check"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    (pytest_line,) = [line for line in out.splitlines() if " -m pytest " in line]
    return [word for word in pytest_line.split() if word.startswith("tests/")]


def test_the_target_installs_nothing_and_uses_the_machines_python():
    body = recipe()
    for forbidden in ("torchrec", "pip install", "$(STAMP)", "$(VENV)", ".venv"):
        assert forbidden not in body, f"gpu-check must not use {forbidden!r}"
    assert "PYTHONPATH=." in body and "build_ext --inplace" in body and "-m gpu" in body
    assert "bench/bench_gpu.py" in body


def test_gpu_marked_tests_collect_without_torchrec(tmp_path):
    files = gpu_test_files()
    assert "tests/parity/test_cuda.py" in files
    (tmp_path / "sitecustomize.py").write_text(NO_TORCHREC)
    proc = run(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", *files], REPO,
               check=False, env={"PYTHONPATH": f"{tmp_path}:{REPO}"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "test_gpu_matches_cpu" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu-check runs the benchmark")
def test_the_benchmark_skips_without_cuda():
    proc = run([str(REPO / "bench" / "bench_gpu.py")], REPO)
    assert "no CUDA: skipped" in proc.stdout


def test_the_benchmark_table_on_the_cpu_kernels():
    proc = run([str(REPO / "bench" / "bench_gpu.py"), "--device", "cpu", "--shard-mb", "1", "--rows", "1024",
                "--repeats", "1"], REPO)
    lines = proc.stdout.splitlines()
    assert any(line.startswith("operation") and "copy GB/s" in line and "x copy" in line for line in lines)
    for operation in ("encode", "decode 1 lost", "decode 2 lost", "update_rows 1024x128B", "update_rows 1024x512B"):
        assert any(line.startswith(operation) for line in lines), operation
    checks = [line for line in lines if line.startswith("r=")]
    assert len(checks) == 5 and all(line.endswith(": yes") for line in checks)
