# call A (13th round): prefill rows after the host cuts; cublas blockwise probe + fp8_path=cublas; the Gluon prefill branch
source tools/gpu/preamble.sh
nvidia-smi --query-gpu=name --format=csv > $R/gpu.txt
E="deepinfer bench e2e --backend cuda --model-shape v4-flash --no-hf"
P="$E --layers 8 --no-decode"
step prefill 200 $P --profile --profile-rows 30 --json $R/prefill.json
step probe 120 python .whl/scaled_probe.py
step cublas_test 120 env TRITON_INTERPRET=0 python -m pytest -q tests/cuda/test_gemm_fp8_cublas.py
grep -q " passed" $R/cublas_test.txt && step prefill_cublas 200 $P --backend-option fp8_path=cublas --profile --profile-rows 30 --json $R/prefill_cublas.json
tar -czf $OUT/all.tgz -C $R .
cat $R/gpu.txt
for f in $R/prefill.txt $R/prefill_cublas.txt; do echo "## $f"; grep -v "^deepinfer:" $f | grep -E "x [0-9]+ +[0-9]|chunks of|^ +[0-9]+ +[0-9]+ +[0-9.]+ |idle|rror" | tail -5; done
tail -26 $R/probe.txt; tail -2 $R/cublas_test.txt; tail -3 $R/pg1.txt; tail -3 $R/pgall.txt 2>/dev/null; grep -i "gluon\|sdpa" $R/ops_prefill.txt 2>/dev/null | head -20
