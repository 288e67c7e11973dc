# Third device call of the twentieth session: CUDA graphs / torch.compile / no host syncs (test_capture.py, without
# expandable segments), expert parallelism on the GPUs present, op digests against the seventeenth session's.
export PYTHONPATH=.
( time python3 -m mok.kernels.native ) > $OUT/native-build.txt 2>&1; echo "native rc=$?"
timeout 260 python3 -m pytest -v -m gpu -rfE tests/mok/test_capture.py -p no:cacheprovider > $OUT/gpu-tests-capture.txt 2>&1
echo "capture rc=$?"; tail -n 2 $OUT/gpu-tests-capture.txt
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 110 python3 -m pytest -v -m "gpu or multigpu" -rfE tests/distributed -p no:cacheprovider > $OUT/gpu-tests-distributed.txt 2>&1
echo "distributed rc=$?"; tail -n 2 $OUT/gpu-tests-distributed.txt
timeout 110 python3 bench/op_digests.py --out $OUT/digests.json > $OUT/digests.log 2>&1; echo "digests rc=$?"
python3 bench/op_digests.py --compare bench/results/digests-h200-2026-12-02-s17.json $OUT/digests.json > $OUT/digests-compare-s17.txt 2>&1
echo "compare rc=$?"; tail -n 15 $OUT/digests-compare-s17.txt
