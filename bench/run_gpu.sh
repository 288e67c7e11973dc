#!/usr/bin/env bash
# The GPU run behind bench/results/*-latest.json (docs/performance.md), on the H200 machine (torch and Triton
# preinstalled there), in parts of under 10 minutes each (one device call per part; docs/development.md):
#   OUT=out/gpu PARTS=tests-dense bench/run_gpu.sh    # attention, dense ops, fused backwards, rl, fingerprints
#   OUT=out/gpu PARTS=tests-moe bench/run_gpu.sh      # the MoE layer, expert parallelism (NCCL, the GPUs present)
#   OUT=out/gpu PARTS=tests-capture bench/run_gpu.sh  # CUDA graphs, torch.compile, no host syncs
#   OUT=out/gpu PARTS=bench bench/run_gpu.sh          # step, dense, MoE benchmarks (-> *-latest.json), op digests
#   OUT=out/gpu PARTS=mla bench/run_gpu.sh            # MLA kernels' and DeepSeek-V3's GPU tests, bench/mla.py
#   OUT=out/gpu PARTS=mla-sweep bench/run_gpu.sh      # MLA's wide-head attention configs (bits checked)
#   OUT=out/gpu PARTS=sampler bench/run_gpu.sh        # the sampler's decode batches (1-256 rows): linear tiles
#                                                      # against cuBLAS, MoE decode configs against vLLM's fused_moe,
#                                                      # paged decode attention configs against FA3 (vLLM's own
#                                                      # kernels where the vLLM bundle is on PYTHONPATH)
#   OUT=out/gpu PARTS=trace bench/run_gpu.sh          # the capture tap's GPU tests, then bench/trace_cost.py
#                                                      # (the trainer step traced and not, eager and compiled)
#   OUT=out/gpu PARTS=profile bench/run_gpu.sh        # host vs GPU time per call (dense ops, MoE eager decode),
#                                                      # the sampler's decode linears in CUDA graphs vs cuBLAS,
#                                                      # the small dense ops with Triton's own launch (ablation)
# Each part writes its logs under $OUT and prints their last lines.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
# The native eager path (mok/kernels/native) is built before anything is timed (its first build takes 35-48 s).
python3 -m mok.kernels.native > "$OUT/native-build.txt" 2>&1 || echo "native eager path not built: $(tail -n 1 "$OUT/native-build.txt")"

gpu_tests() {  # name, limit in seconds, pytest arguments...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 -m pytest -q -m "gpu or multigpu" -rfE --durations=10 "$@" > "$OUT/gpu-tests-$name.txt" 2>&1
    echo "tests $name rc=$?" | tee -a "$OUT/gpu-tests-$name.txt"
    tail -n 4 "$OUT/gpu-tests-$name.txt"
}

case "${PARTS:-tests-dense}" in
tests-dense)
    gpu_tests dense 560 tests/mok/test_attention_gpu.py tests/mok/test_dense_gpu.py tests/mok/test_dense_gpu_native.py \
        tests/mok/test_fused_backward_gpu.py tests/rl/test_gpu.py tests/verify/test_fingerprints.py ;;
tests-moe)
    gpu_tests moe 560 tests/mok/test_moe_gpu.py tests/mok/test_moe_gpu_paths.py tests/distributed ;;
tests-capture)
    # without expandable segments (the allocator setting CUDA graphs are documented with)
    env -u PYTORCH_CUDA_ALLOC_CONF timeout 560 python3 -m pytest -q -m gpu -rfE tests/mok/test_capture_gpu.py \
        > "$OUT/gpu-tests-capture.txt" 2>&1
    echo "tests capture rc=$?" | tee -a "$OUT/gpu-tests-capture.txt"
    tail -n 4 "$OUT/gpu-tests-capture.txt" ;;
bench)
    timeout 180 python3 -m bench.step --json "$OUT/step-latest.json" --iters 2 > "$OUT/step.jsonl" 2>&1
    echo "step rc=$?"
    timeout 90 python3 bench/dense.py --tokens 4096 16384 65536 --json "$OUT/dense-latest.json" --out "$OUT/dense.jsonl" \
        > "$OUT/dense.log" 2>&1
    echo "dense rc=$?"
    timeout 150 python3 -m bench.moe --out "$OUT/moe.jsonl" --json "$OUT/moe-latest.json" --tokens 1,16384 \
        --impls mok,grouped_mm > "$OUT/moe.log" 2>&1
    echo "moe rc=$?"
    timeout 110 python3 bench/op_digests.py --out "$OUT/digests.json" > "$OUT/digests.log" 2>&1
    python3 bench/op_digests.py --compare bench/results/digests-latest.json "$OUT/digests.json"
    echo "digests rc=$?"
    tail -n 3 "$OUT/step.jsonl" ;;
mla)
    # Multi-head Latent Attention: its kernels' bits and rl's DeepSeek-V3 on CUDA, then its speed (bench/mla.py)
    gpu_tests mla 360 tests/mok/test_attention_mla_gpu.py tests/rl/test_gpu.py -k "mla or deepseek"
    timeout 200 python3 -m bench.mla --json "$OUT/mla-latest.json" --seq-lens 4096,16384 > "$OUT/mla.jsonl" 2>&1
    echo "mla bench rc=$?"
    tail -n 6 "$OUT/mla.jsonl" ;;
mla-sweep)
    timeout 540 python3 bench/attention_sweep.py --heads mla --lengths 8x4096 --out "$OUT/mla-sweep.jsonl" \
        > "$OUT/mla-sweep.log" 2>&1
    echo "mla sweep rc=$?"
    grep '"best"' "$OUT/mla-sweep.jsonl" ;;
sampler)
    timeout 160 python3 bench/linear_sweep.py --decode --out "$OUT/linear-decode-sweep.jsonl" > "$OUT/linear-decode.log" 2>&1
    echo "linear decode rc=$?"
    grep '"best"' "$OUT/linear-decode-sweep.jsonl" | cut -c1-200
    timeout 200 python3 bench/moe_sweep.py --out "$OUT/moe-decode-sweep.jsonl" --tokens 0 --decode-tokens 1,64,256 \
        --shapes qwen3-30b-a3b,olmoe-1b-7b,mixtral-8x7b --budget-s 190 > "$OUT/moe-decode.log" 2>&1
    echo "moe decode rc=$?"
    grep -E 'best_decode|vllm fused' "$OUT/moe-decode-sweep.jsonl" | cut -c1-200
    timeout 140 python3 bench/attention_sweep.py --decode 1x544,64x544,256x544 --out "$OUT/attention-decode-sweep.jsonl" \
        > "$OUT/attention-decode.log" 2>&1
    echo "attention decode rc=$?"
    grep -v '"impl": "mok"' "$OUT/attention-decode-sweep.jsonl" | cut -c1-200 ;;
trace)
    gpu_tests trace 150 tests/verify/test_capture_gpu.py tests/verify/test_fingerprints.py
    timeout 400 python3 -m bench.trace_cost --json "$OUT/trace-cost-latest.json" > "$OUT/trace-cost.jsonl" 2>&1
    echo "trace cost rc=$?"
    grep '"workload"' "$OUT/trace-cost.jsonl" | cut -c1-400 ;;
profile)
    timeout 300 python3 bench/kernel_profile.py --out "$OUT/profile-host.jsonl" --targets dense,moe_eager \
        --shapes qwen3-30b-a3b,olmoe-1b-7b --tokens 1 --dense-tokens 4096,16384 > "$OUT/profile.log" 2>&1
    echo "profile rc=$?"
    grep -E "^(dense|moe_eager)" "$OUT/profile.log"
    timeout 150 python3 bench/linear_sweep.py --decode --out "$OUT/linear-decode-sweep.jsonl" > "$OUT/linear-decode.log" 2>&1
    echo "linear decode rc=$?"
    timeout 60 python3 bench/dense.py --tokens 4096 16384 --ops rms_norm,rms_norm_residual,rotary,linear_qkv \
        --triton-launch --out "$OUT/dense-triton-launch.jsonl" > "$OUT/dense-triton-launch.log" 2>&1
    echo "dense with Triton's launch rc=$?" ;;
*)
    echo "PARTS: tests-dense, tests-moe, tests-capture, bench, mla, mla-sweep, sampler, trace or profile" >&2
    exit 2 ;;
esac
