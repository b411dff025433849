# Entry points of the lab suite. `make lab` and `make test` are all most people need.
# Each target that runs something first runs scripts/setup.sh, which skips what is
# already done (a few seconds once everything is installed): `--for lab` installs what
# the labs need, `--for test` adds the tests' tools (pytest, Playwright and chromium,
# Slurm's daemons).

SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV := .venv
PY := $(VENV)/bin/python

ARGS ?=
SUBMISSION ?=
LAB_ARGS ?=
PYTEST_ARGS ?=
TEST_TIMEOUT ?= 600
TEST_WORKERS ?= 2
TEST_RESULTS := .pytest_cache/make-test-junit.xml
# One closing line with the counts from pytest's JUnit report.
TEST_SUMMARY := import sys, xml.etree.ElementTree as ET; \
    root = ET.parse(sys.argv[1]).getroot(); \
    suite = root if root.tag == "testsuite" else root[0]; \
    t, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")); \
    print(f"summary: {t - f - e - s} passed, {f + e} failed, {s} skipped")

# Jupyter refuses to run as root unless asked to (containers, CI machines).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

RUN_TARGETS := lab test grade bench science

# OpenMPI refuses to start as root without these two, and to start more ranks
# than there are cores without oversubscription (2-process labs on small machines).
$(RUN_TARGETS): export OMPI_ALLOW_RUN_AS_ROOT ?= 1
$(RUN_TARGETS): export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1
$(RUN_TARGETS): export OMPI_MCA_rmaps_base_oversubscribe ?= 1
# The tests run every process on this one machine, so Gloo may use the loopback
# interface (containers often have no interface Gloo can guess). Not a default
# elsewhere: processes on several machines must use a real network interface.
test: export GLOO_SOCKET_IFNAME ?= lo
# Two pytest workers on two cores: one thread per process, or they slow each other down.
test: export OMP_NUM_THREADS ?= 1
# A process that sets its own thread count (a 1-process job given both cores, the grader's
# references) would otherwise keep its idle OpenMP threads spinning while the other worker
# runs: measured 35 CPU-s against 8 for the same 150 steps, the same numbers to the digit.
test: export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: help setup setup-lab lab test grade submission-given bench science lint clean distclean \
	gpu-bundle gpu-check

help:
	@echo "make lab        set up what the labs need, then start JupyterLab on labs/ (LAB_ARGS='--ip 0.0.0.0 ...')"
	@echo "make test       set everything up, then run the whole test suite (PYTEST_ARGS='-k ...')"
	@echo "make setup      what the labs and the tests need (scripts/setup.sh --for test)"
	@echo "make setup-lab  what the labs need: no test tools (scripts/setup.sh --for lab)"
	@echo "make grade      grade an assessment submission: make grade SUBMISSION=path/to/train.py"
	@echo "make bench      run the performance harness (ARGS='...' passed to python -m benchmarks)"
	@echo "make science    run the Lab 1 and Lab 3 experiments behind their claims (make test asserts them too)"
	@echo "make lint       ruff check and ruff format --check (what CI and pre-commit run)"
	@echo "make gpu-bundle the wheels and data the GPU check carries to an offline GPU machine (.gpu_bundle/)"
	@echo "make gpu-check  on a GPU machine: every lab's GPU paths in <= 8 min, a table (GPU_PYTHON=python3, ARGS='...')"
	@echo "make clean      remove caches and build outputs; make distclean also removes .venv and runs/"

setup:
	@bash scripts/setup.sh --for test

setup-lab:
	@bash scripts/setup.sh --for lab

lab: setup-lab
	$(VENV)/bin/jupyter lab --notebook-dir=labs $(ALLOW_ROOT) $(LAB_ARGS)

# pytest's exit codes: 1 tests failed, 2 interrupted, 3 internal error,
# 4 usage error, 5 no tests collected. Every non-zero code fails the target.
test: setup
	@rm -f $(TEST_RESULTS)
	@echo "make test: LABS_PROFILE=quick LABS_SOLUTIONS=1 pytest on tests/ and labs/ ($(TEST_WORKERS) workers, $(TEST_TIMEOUT) s per test)"
	@rc=0; \
	LABS_PROFILE=quick LABS_SOLUTIONS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder \
	    --nbval-lax --nbval-current-env --timeout $(TEST_TIMEOUT) \
	    --junitxml=$(TEST_RESULTS) $(PYTEST_ARGS) tests labs || rc=$$?; \
	case $$rc in \
	    0) ;; \
	    1) echo "make test: FAILED: some tests failed (details above)" ;; \
	    5) echo "make test: FAILED: pytest collected no tests" ;; \
	    *) echo "make test: FAILED: pytest stopped with exit code $$rc (2 interrupted, 3 internal error, 4 usage error)" ;; \
	esac; \
	[[ -f $(TEST_RESULTS) ]] && $(PY) -c '$(TEST_SUMMARY)' $(TEST_RESULTS); \
	exit $$rc

grade: submission-given setup-lab
	$(VENV)/bin/lab-grade "$(SUBMISSION)" $(ARGS)

submission-given:
	@test -n "$(SUBMISSION)" || { echo "usage: make grade SUBMISSION=path/to/train.py [ARGS='...']" >&2; exit 2; }

bench: setup-lab
	$(PY) -m benchmarks $(ARGS)

science: setup-lab
	$(PY) labs/lab3_large_batch/science.py $(ARGS)
	$(PY) labs/lab1_optimisation/steps_to_target.py

# The GPU check (CONTRIBUTING.md, "GPU check"). gpu-bundle runs here, with the network:
# the wheels the GPU machine's Python 3.12 lacks and Fashion-MNIST, into .gpu_bundle/.
# gpu-check runs on the GPU machine with its own Python (no .venv, no set-up, offline);
# `make gpu-check GPU_PYTHON=.venv/bin/python ARGS=--cpu` is its CPU form here.
GPU_PYTHON ?= python3
GPU_CHECK_OUT ?= runs/gpu_check

gpu-bundle:
	$(PY) -m benchmarks.gpu_check.bundle $(ARGS)

gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu_check --out $(GPU_CHECK_OUT) $(ARGS)

# Needs only ruff, so a missing .venv is made without building Horovod.
lint:
	@test -x $(VENV)/bin/ruff || LABS_SKIP_HOROVOD=1 bash scripts/setup.sh --for test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name .ipynb_checkpoints \) -type d -prune -exec rm -rf {} +
	rm -rf .pytest_cache .ruff_cache build dist *.egg-info benchmarks/results

distclean: clean
	rm -rf $(VENV) runs
