# The second device call: the routing kernel at 1/2/4 warps and the T = 1 A/B of every shape, then the GPU tests of
# the routing change (each group under its own limit, names printed as they pass).
D=bench/results/moe-decode-route-in-gemm1-2026-12-02-s19
PYTHONPATH=. timeout 170 python3 $D/route_in_gemm1_ab.py routing qwen3-30b-a3b:1 olmoe-1b-7b:1 deepseek-v3:1 \
    mixtral-8x7b:1 > $OUT/route_in_gemm1_ab.jsonl 2> $OUT/route_in_gemm1_ab.err
echo "probe rc=$?"
timeout 190 python3 -m pytest -v -m gpu tests/mok/test_moe_gpu.py -p no:cacheprovider --durations=8 \
    -k "routing_kernel_bits or routing_inside_gemm1 or route_cuda_matches or every_decode_batch" \
    > $OUT/gpu-tests-routing.txt 2>&1
echo "tests A rc=$?"
timeout 165 python3 -m pytest -v -m gpu tests/mok/test_moe_gpu.py -p no:cacheprovider --durations=8 \
    -k "rerun or batch_invariance" > $OUT/gpu-tests-bitwise.txt 2>&1
echo "tests B rc=$?"
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/gpu-tests-routing.txt $OUT/gpu-tests-bitwise.txt | cut -c1-200
cut -c1-260 $OUT/route_in_gemm1_ab.jsonl
