#!/usr/bin/env bash
# The GPU run behind bench/results/*-latest.json, on the H200 machine (torch and Triton preinstalled there):
#   OUT=out/gpu bench/run_gpu.sh
# GPU tests of the attention, dense ops and the trainer, then the attention and trainer-step benchmarks;
# then CUDA-graph capture / torch.compile / no-sync tests (tests/mok/test_capture.py) and the MoE benchmark
# with decode in a CUDA graph (-> $OUT/moe-latest.json, for bench/results/moe-latest.json).
# PARTS=capture runs only those last two (one device call of under 10 minutes).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
if [ "${PARTS:-all}" = all ]; then
timeout 260 python3 -m pytest -q -m gpu -rA tests/mok/test_attention_gpu.py tests/mok/test_dense_gpu.py \
    tests/rl/test_gpu.py tests/verify/test_fingerprints.py > "$OUT/gpu-tests.txt" 2>&1
echo "tests rc=$?" | tee -a "$OUT/gpu-tests.txt"
timeout 120 python3 -m bench.attention --json "$OUT/attention-latest.json" > "$OUT/attention.jsonl" 2>&1
echo "attention rc=$?"
timeout 170 python3 -m bench.step --json "$OUT/step-latest.json" > "$OUT/step.jsonl" 2>&1
echo "step rc=$?"
for f in gpu-tests.txt attention.jsonl step.jsonl; do tail -n 3 "$OUT/$f"; done
fi
# capture tests without expandable segments (the allocator setting CUDA graphs are documented with)
env -u PYTORCH_CUDA_ALLOC_CONF timeout 330 python3 -m pytest -q -m gpu -rA tests/mok/test_capture.py \
    > "$OUT/capture-gpu-tests.txt" 2>&1
echo "capture tests rc=$?" | tee -a "$OUT/capture-gpu-tests.txt"
timeout 230 python3 -m bench.moe --out "$OUT/moe.jsonl" --json "$OUT/moe-latest.json" --tokens 1,16,128,16384 \
    --impls mok,grouped_mm > "$OUT/moe.log" 2>&1
echo "moe rc=$?"
tail -n 3 "$OUT/capture-gpu-tests.txt" "$OUT/moe.log"
