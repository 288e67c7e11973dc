#!/usr/bin/env bash
# The GPU run behind bench/results/*-latest.json, on the H200 machine (torch and Triton preinstalled there):
#   OUT=out/gpu bench/run_gpu.sh
# GPU tests of the attention, dense ops and the trainer, then the attention and trainer-step benchmarks.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
timeout 260 python3 -m pytest -q -m gpu -rA tests/mok/test_attention_gpu.py tests/mok/test_dense_gpu.py \
    tests/rl/test_gpu.py tests/verify/test_fingerprints.py > "$OUT/gpu-tests.txt" 2>&1
echo "tests rc=$?" | tee -a "$OUT/gpu-tests.txt"
timeout 120 python3 -m bench.attention --json "$OUT/attention-latest.json" > "$OUT/attention.jsonl" 2>&1
echo "attention rc=$?"
timeout 170 python3 -m bench.step --json "$OUT/step-latest.json" > "$OUT/step.jsonl" 2>&1
echo "step rc=$?"
for f in gpu-tests.txt attention.jsonl step.jsonl; do tail -n 3 "$OUT/$f"; done
