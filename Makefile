# `make demo` trains the demo DLRM; `make test` runs the test suite. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml setup.py lightning_dlrover/parity/_gf256.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel
	# CPU recipe (see README): torchrec's declared fbgemm-gpu dependency is the CUDA build, which does not
	# load without CUDA, so torchrec is installed without dependencies next to fbgemm-gpu-cpu.
	$(PIP) install --quiet torch==2.13.0 fbgemm-gpu-cpu==1.8.0
	$(PIP) install --quiet --no-deps torchrec==1.8.0
	$(PIP) install --quiet tensordict torchmetrics==1.0.3 tqdm pyre-extensions iopath
	$(PIP) install --quiet --no-build-isolation -e ".[test]"
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

clean:
	rm -rf $(VENV) build runs *.egg-info
