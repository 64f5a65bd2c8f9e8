# The two commands a new user runs: `make demo` and `make test`. Both set everything up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
export TORCH_SPEC VENV

.PHONY: setup demo test bench clean wheelhouse gpu-check
setup:
	@bash scripts/setup.sh

demo: setup
	@$(VENV)/bin/sluice demo

test: setup
	@$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	@$(PY) -m pip install -q -e '.[bench]'
	@# LitData, the scale-out benchmark's peer, without its dependencies (they would pull a CUDA torch and torchvision)
	@$(PY) -m pip install -q --no-deps litdata==0.2.76 lightning-utilities tifffile obstore
	@for b in shard loader selection compression pipeline time_to_accuracy demo tiny_budget host_layout shard_order nightly_growth nightly_warm_sweep text_growth photos scale_out train_ray; do $(PY) -m benchmarks.$$b --quick || exit 1; done

# GPU check (docs/benchmarks.md, "The GPU check"): build the wheelhouse (Sluice, Prefect and what else a CUDA image
# lacks, Fashion-MNIST; at most 64 MiB) where PyPI is reachable, carry it to the GPU machine, run `make gpu-check`
# there: sluice demo, a second night on a grown source, pytest -m gpu, benchmarks.gpu --quick, in 9 minutes
# (GPU_CHECK_DRY_RUN=1: the CPU dry run, anywhere, with a wheelhouse for this Python: WHEEL_PY=3.11).
WHEEL_PY ?= 3.12
wheelhouse:
	@WHEEL_PY=$(WHEEL_PY) bash scripts/build_wheelhouse.sh

gpu-check:
	@python3 scripts/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .venv-mlflow .pytest_cache sluice-data
