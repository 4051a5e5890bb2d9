# `make demo` trains the demo DLRM; `make test` runs the test suite. Both set up .venv first.
# `make gpu-check` runs the CUDA kernel tests and bench/bench_gpu.py on a GPU machine, with its own python.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench gpu-check clean

$(STAMP): pyproject.toml setup.py lightning_dlrover/parity/_gf256.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel
	# CPU recipe (see README): torchrec's declared fbgemm-gpu dependency is the CUDA build, which does not
	# load without CUDA, so torchrec is installed without dependencies next to fbgemm-gpu-cpu.
	$(PIP) install --quiet torch==2.13.0 fbgemm-gpu-cpu==1.8.0
	$(PIP) install --quiet --no-deps torchrec==1.8.0
	$(PIP) install --quiet tensordict torchmetrics==1.0.3 tqdm pyre-extensions iopath
	$(PIP) install --quiet --no-build-isolation -e ".[test,parquet]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lightning-dlrover fit --config configs/demo.yaml

test: $(STAMP)
	$(PY) -m pytest -q --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) bench/bench_parity.py
	$(PY) bench/bench_checkpoint.py
	$(PY) bench/bench_strategy.py
	$(PY) bench/bench_fault_tolerance.py
	$(PY) bench/bench_recovery.py
	$(PY) bench/bench_parity_floor.py

# For one GPU with PyTorch, CuPy and Lightning but no TorchRec CUDA build (docs/gpu.md): no .venv (its recipe
# installs torchrec's CPU build), nothing installed. The C kernels are built in place (optional: without a compiler
# the CPU side of the comparisons runs the torch fallback); only test files with gpu-marked tests are collected,
# and they import without TorchRec (tests/test_gpu_check.py checks that on every run of the suite). Minutes.
GPU_PYTHON ?= python3
GPU_TESTS = $(shell grep -rlE '^[[:space:]]*(@pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu)' tests --include='*.py')

gpu-check:
	@$(GPU_PYTHON) -c "import torch, pytest" || { echo "gpu-check needs torch and pytest in $(GPU_PYTHON)"; exit 1; }
	$(GPU_PYTHON) setup.py build_ext --inplace -q || echo "gpu-check: C kernels not built; the CPU side uses the torch fallback"
	PYTHONPATH=. timeout 420 $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m gpu $(GPU_TESTS)
	PYTHONPATH=. timeout 120 $(GPU_PYTHON) bench/bench_gpu.py

clean:
	rm -rf $(VENV) build runs *.egg-info
