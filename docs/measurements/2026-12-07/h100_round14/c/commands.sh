# call C (session 14): the new defaults (Gluon sparse bf16 / mla bf16 / prefill under auto) through the whole golden set and the GPU end-to-end tests; the attention op families timed; fp8 Gluon sweep again
source tools/gpu/preamble.sh
nvidia-smi --query-gpu=name --format=csv > $R/gpu.txt
unset TRITON_INTERPRET
step conf_all 330 deepinfer conformance --backend cuda --quiet --json $R/conf_all.json & CONF=$!
step e2e_tests 330 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider tests/cuda/test_end_to_end.py
wait $CONF
step ops_mla 110 deepinfer bench ops --backend cuda --op mla_decode --json $R/ops_mla.json
step ops_sparse 110 deepinfer bench ops --backend cuda --op sparse_attention --json $R/ops_sparse.json
step ops_prefill 90 deepinfer bench ops --backend cuda --op prefill --json $R/ops_prefill.json
step fp8g_sweep 80 python -m deepinfer_cuda.bench.gemm --sweep fp8_gluon_large
tar -czf $OUT/all.tgz -C $R .
for f in conf_all e2e_tests; do echo "## $f"; tail -4 $R/$f.txt; done
grep -h "H128\|gluon\|H64_D512_bf16 \|sdpa\|SDPA" $R/ops_mla.txt $R/ops_sparse.txt $R/ops_prefill.txt | cut -c1-150 | head -40
grep "contiguous" $R/fp8g_sweep.txt | cut -c60-250
