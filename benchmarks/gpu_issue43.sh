#!/usr/bin/env bash
# Issue 43's GPU checks in one go, for a lent GPU (the `device` tool runs it in the repository root;
# results land in $OUT, or benchmarks/results/ when OUT is unset). At most 9.5 minutes (the steps' limits
# add up to 570 s), so it fits one 10-minute device call:
#   1. tests/engine/test_gpu.py            the engine and the bucket forms (stacked GEMMs, compiled moments) on CUDA
#   2. optimizer_step_gpu.py        the step: fused AdamW vs per-matrix / stacked / auto / compiled / galore-torch
#   3. examples/fsdp_galore.py      GaLoreAdamW on FSDP2 shards, one rank per GPU (NCCL)
#   4. time_to_accuracy.py          what users pay, per method, on the GPU (6 rounds; 12 with FULL=1)
# Each step has its own time limit, so one that hangs does not take the others' time.
set -u
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu_issue43_card.txt"
timeout 120 "$PY" -m pytest -q tests/engine/test_gpu.py 2>&1 | tail -5 | tee "$OUT/gpu_issue43_tests.txt"
timeout 180 "$PY" benchmarks/optimizer_step_gpu.py --out "$OUT/optimizer_step_gpu_bucket.json" 2>&1 | tail -4
timeout 60 "$PY" -m torch.distributed.run --standalone --nproc-per-node "${GPUS:-1}" examples/fsdp_galore.py --device cuda --steps 20 \
    2>&1 | grep -v "^W[0-9]" | tail -6 | tee "$OUT/fsdp_galore_cuda.txt"
ROUNDS=6; [ "${FULL:-0}" = 1 ] && ROUNDS=12
timeout 210 "$PY" benchmarks/time_to_accuracy.py --device cuda --rounds "$ROUNDS" --out "$OUT/time_to_accuracy_gpu.json" 2>&1 | tail -8
