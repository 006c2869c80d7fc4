# Quick start: `make demo` (set up + run the default comparison) and `make test` (set up + run the tests).
# `make test-fast`: the fast tier (marker fast), at least one test of every package of src/fedgalore, under 3 minutes on
# 2 cores; for a quick check while working. `make test` (CI) runs everything.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-fast bench
setup:
	bash scripts/setup.sh

# six runs (3 methods x IID/Dirichlet 0.5), each method at its own probed learning rate
# (conf/demo_rates.yaml), one shared budget (conf/repro/offline_text_50.yaml): ~15 min on 2 idle CPU cores
demo: setup
	@echo "make demo: 6 federated runs (FedGaLore, FedIT, FedAvg-Full x IID, Dirichlet 0.5), about 15 min on 2 idle CPU cores (longer on a busy one)"
	$(VENV)/bin/fedgalore compare --config conf/repro/offline_text_50.yaml \
	  --methods fedgalore,fedit,fedavg_full --settings iid,dirichlet:0.5 --seeds 1 \
	  --method-options conf/demo_rates.yaml --out runs/demo

# all tests, then the numerically sensitive ones (marker isa) again with the CPU kernels forced down (torch's
# portable kernels, MKL and oneDNN at most AVX2; issue 29): a test that would pass with one kind of kernels only fails on every machine.
# Two pytest-xdist workers (TEST_WORKERS=0: one process), each single-threaded (tests/conftest.py): the suite's long tests
# (Flower deployments, the documented commands) run beside the rest instead of after it
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)
test: setup
	$(PYTHON) -m pytest -q $(XDIST)
	ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 $(PYTHON) -m pytest -q -m isa $(XDIST)

# the fast tier (marker fast, given to the tests in tests/fast_tier.txt; tests/README.md says how they are chosen)
test-fast: setup
	$(PYTHON) -m pytest -q -m fast $(XDIST)

bench: setup
	$(PYTHON) -m fedgalore.cli bench all
