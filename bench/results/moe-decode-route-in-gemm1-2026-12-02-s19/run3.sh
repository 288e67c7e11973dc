# The third device call: the rest of the MoE GPU tests on the final tree, then bench/moe.py at T = 1 and 16384.
timeout 170 python3 -m pytest -v -m gpu tests/mok/test_moe_gpu.py -p no:cacheprovider --durations=8 \
    -k "native or decode_plans or programmatic or undefined or out_of_range or scanned" > $OUT/gpu-tests-rest.txt 2>&1
echo "tests C rc=$?"
grep -E "FAILED|ERROR|passed|failed" $OUT/gpu-tests-rest.txt | cut -c1-200
PYTHONPATH=. timeout 290 python3 bench/moe.py --out $OUT/moe-h200-s19.jsonl --json $OUT/moe-latest.json \
    --tokens 1,16384 --impls mok,grouped_mm > $OUT/moe-bench.log 2>&1
echo "bench rc=$?"; tail -3 $OUT/moe-bench.log; cat $OUT/moe-latest.json
