# Quick start: `make demo` (set up + run the default comparison) and `make test` (set up + run the tests).
VENV ?= .venv
PYTHON := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test bench
setup:
	bash scripts/setup.sh

# six runs (3 methods x IID/Dirichlet 0.5) at a budget that fits ~15 min on 2 CPU cores
demo: setup
	$(VENV)/bin/fedgalore compare --config conf/pipeline/offline_text.yaml \
	  --methods fedgalore,fedit,fedavg_full --settings iid,dirichlet:0.5 --out runs/demo \
	  federation.rounds=6 task.options.max_length=64

test: setup
	$(PYTHON) -m pytest -q

bench: setup
	$(PYTHON) -m fedgalore.cli bench all
