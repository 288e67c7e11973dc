# The third device call: the MoE determinism tests on this tree (mok/kernels unchanged since the sixteenth session),
# then the warp-specialisation probe, each variant in its own process under a time limit.
set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
timeout 300 python3 -m pytest -q -m gpu tests/mok/test_moe_gpu.py -k "batch_invariance or rerun" --durations=10 \
    -p no:cacheprovider > $OUT/gpu-tests-moe-bitwise.txt 2>&1
tail -n 15 $OUT/gpu-tests-moe-bitwise.txt
PYTHONPATH=. timeout 270 python3 bench/results/moe-warp-specialize-h200-2026-12-02-s18/ws_hang_probe.py \
    --out $OUT/probe --limit-s 45 > $OUT/ws_hang_probe.out.txt 2>&1
rm -f $OUT/probe/today.pt
cat $OUT/ws_hang_probe.out.txt | cut -c1-400
