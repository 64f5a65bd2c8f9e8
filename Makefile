# The two commands a new user runs: `make demo` and `make test`. Both set everything up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
export TORCH_SPEC VENV

.PHONY: setup demo test bench clean
setup:
	@bash scripts/setup.sh

demo: setup
	@$(VENV)/bin/sluice demo

test: setup
	@$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	@$(PY) -m pip install -q -e '.[bench]'
	@for b in shard loader selection compression pipeline time_to_accuracy demo tiny_budget host_layout; do $(PY) -m benchmarks.$$b --quick || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache sluice-data
