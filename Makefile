# `make test` and `make demo` each set themselves up from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

# OpenMP threads that sleep instead of spin while waiting: on a small, shared CPU the
# spinning default makes two-thread torch many times slower (docs/training.md).
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup test test-fast demo gpu-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.14.1 torchvision==0.29.1
	$(PIP) install -e ".[test,export]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

demo: $(STAMP)
	$(PY) tools/train.py --config configs/demo_shapes.yaml

# On a GPU machine: GPU tests, static-check and train benchmarks -> gpu-report.json.
# Without CUDA: one line, exit status 2.
gpu-check: $(STAMP)
	$(PY) tools/gpu_check.py

clean:
	rm -rf $(VENV) runs .pytest_cache
