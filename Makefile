# `make test` and `make demo` each set themselves up from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
# The torch pair CI tests in full. The oldest and newest supported pairs are tested with
# `make test-fast` in .ci/run (README, "Supported versions").
TORCH       ?= 2.14.1
TORCHVISION ?= 0.29.1

# OpenMP threads that sleep instead of spin while waiting: on a small, shared CPU the
# spinning default makes two-thread torch many times slower (docs/training.md).
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup test test-fast demo gpu-check clean distclean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==$(TORCH) torchvision==$(TORCHVISION)
	$(PIP) install -e ".[test,export]"
	touch $(STAMP)

setup: $(STAMP)

# Tests run in two parts, both always (the status is the first failure's), each in JOBS
# pytest-xdist workers: the single-process ones with one torch thread per worker (the
# tiny test models gain nothing from a second intra-op thread, and two workers of two
# threads on two cores need twice the CPU time), then the multi-process (dist) ones, whose
# ranks keep their threads. A file's tests stay in one worker, in order (--dist loadfile).
# JOBS=0: one process. Measured: docs/training.md, "Supported versions".
JOBS ?= 2
# $(call pytest_parts,EXPR): the tests that the pytest -m expression EXPR selects.
pytest_parts = OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(JOBS) --dist loadfile -m "($(1)) and not dist" tests; a=$$?; \
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile -m "($(1)) and dist" tests; b=$$?; [ $$b -eq 5 ] && b=0; \
	[ $$a -ne 0 ] && exit $$a; exit $$b

test: $(STAMP)
	$(call pytest_parts,dist or not dist)

# MARKS: which tests; .ci/run leaves the multi-process (dist) tests to the pinned pair's full
# run when it tests the oldest and newest torch.
MARKS ?= not slow
test-fast: $(STAMP)
	$(call pytest_parts,$(MARKS))

# --resume: the first `make demo` starts the run; a later one continues an interrupted
# run, or re-evaluates a finished one (runs/demo/eval/). ARGS: extra key=value overrides.
demo: $(STAMP)
	$(PY) tools/train.py --config configs/demo_shapes.yaml --resume $(ARGS)
	@echo "next: source $(VENV)/bin/activate, then the README's commands"

# On a GPU machine, in one 10-minute call: GPU tests, demos, static-check, train and inference
# benchmarks against torchvision -> gpu-report.json (tools/gpu_check.py --list: the plan).
# Without CUDA: one line, exit status 2. The probe's line (--why-not) stops make through
# $(error), so that make adds no "*** [gpu-check] Error 2" line of its own.
gpu-check: $(STAMP)
	$(eval NO_GPU := $(shell $(PY) tools/gpu_check.py --why-not))
	$(if $(NO_GPU),$(error $(NO_GPU)))
	@$(PY) tools/gpu_check.py

# runs/ and caches; the environment stays (make distclean removes it too).
clean:
	rm -rf runs .pytest_cache

distclean: clean
	rm -rf $(VENV)
