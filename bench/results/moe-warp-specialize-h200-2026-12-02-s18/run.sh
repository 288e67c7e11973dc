# The second device call: the warp-specialised candidates that compile (ws_compile_check.py) against today's configs.
set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
PYTHONPATH=. timeout 480 python3 bench/moe_sweep.py --out $OUT/ws-sweep-2.jsonl --only WARP_SPECIALIZE \
    --kernels gemm2,bwd_act,bwd_dx --decode-tokens 0 --budget-s 420 \
    --shapes qwen3-30b-a3b,deepseek-v3,olmoe-1b-7b,mixtral-8x7b > $OUT/ws-sweep-2.out 2>&1
grep -v '"kind": "configs"' $OUT/ws-sweep-2.jsonl | grep -v '"move"' | cut -c1-260 | tail -100
