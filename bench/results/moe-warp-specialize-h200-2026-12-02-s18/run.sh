set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
PYTHONPATH=. timeout 120 python3 bench/results/moe-warp-specialize-h200-2026-12-02-s18/ws_probe.py > $OUT/ws_probe.out.txt 2>&1
tail -20 $OUT/ws_probe.out.txt
PYTHONPATH=. timeout 100 python3 bench/op_digests.py --out $OUT/digests.json > $OUT/digests.log 2>&1
python3 bench/op_digests.py --compare bench/results/digests-h200-2026-12-02-s17-device-guard.json $OUT/digests.json >> $OUT/digests.log 2>&1
tail -3 $OUT/digests.log
PYTHONPATH=. timeout 400 python3 bench/moe_sweep.py --out $OUT/ws-sweep.jsonl --only WARP_SPECIALIZE --decode-tokens 0 --budget-s 340 --shapes qwen3-30b-a3b,deepseek-v3,olmoe-1b-7b,mixtral-8x7b > $OUT/ws-sweep.out 2>&1
grep -v '"kind": "configs"' $OUT/ws-sweep.jsonl | cut -c1-330 | tail -80
