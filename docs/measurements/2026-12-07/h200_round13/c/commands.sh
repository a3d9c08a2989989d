# call C (13th round): the build with the new defaults (cublas fp8 prefill, bf16 Gluon mla_decode / sparse_attention, Gluon prefill)
source tools/gpu/preamble.sh
nvidia-smi --query-gpu=name --format=csv > $R/gpu.txt
export TRITON_INTERPRET=0
E="deepinfer bench e2e --backend cuda --model-shape v4-flash --no-hf"
step conf 170 deepinfer conformance --backend cuda --op linear --op grouped_gemm --op mla_decode --op sparse_attention --op prefill --json $R/conf.json --quiet
step pytest 150 python -m pytest -q tests/cuda/test_gemm_fp8_cublas.py tests/cuda/test_gemm_fp8_gluon.py tests/cuda/test_prefill_gluon.py
step prefill 130 $E --layers 8 --no-decode --profile --profile-rows 12 --json $R/prefill.json
step d4k 100 $E --layers 8 --context 4096 --batch 1 --batch 64 --batch 256 --no-prefill --json $R/d4k.json
step d32k 100 $E --layers 7 --context 32768 --batch 1 --batch 64 --batch 256 --no-prefill --json $R/d32k.json
#step ops_sparse 60 deepinfer bench ops --backend cuda --op sparse_attention --json $R/ops_sparse.json
#step sweep 90 python -m deepinfer_cuda.bench.gemm --sweep fp8_gluon_large --json $R/sweep.json
tar -czf $OUT/all.tgz -C $R .
cat $R/gpu.txt; tail -2 $R/conf.txt; tail -2 $R/pytest.txt
for f in prefill d4k d32k; do echo "## $f"; grep -v "^deepinfer:" $R/$f.txt | grep -E "x [0-9]+ +[0-9]|^ +[0-9]+ +[0-9]+ +[0-9.]+ |idle|rror" | tail -5; done
grep -E "fp8kv_gluon|bf16_gluon " $R/ops_sparse.txt | grep -v "^\[" | cut -c1-120; grep -iE "TFLOP|tl |overlap|256" $R/sweep.txt | tail -24 | cut -c1-160
