# First device call of the twentieth session: the native eager path, bench/moe.py (-> moe-latest.json), then the MoE
# GPU tests the nineteenth session's last call could not reach.
export PYTHONPATH=. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
( time python3 -m mok.kernels.native ) > $OUT/native-build.txt 2>&1; echo "native rc=$?"
timeout 290 python3 bench/moe.py --out $OUT/moe-h200-s20.jsonl --json $OUT/moe-latest.json \
    --tokens 1,16384 --impls mok,grouped_mm > $OUT/moe-bench.log 2>&1
echo "bench rc=$?"; cat $OUT/moe-latest.json
timeout 200 python3 -m pytest -v -m gpu tests/mok/test_moe_gpu.py -p no:cacheprovider --durations=8 \
    -k "native or programmatic or undefined or out_of_range or routing_kernel_bits or routing_inside_gemm1" \
    > $OUT/gpu-tests-a.txt 2>&1
echo "tests A rc=$?"
grep -E "FAILED|ERROR|passed|failed" $OUT/gpu-tests-a.txt | cut -c1-200
