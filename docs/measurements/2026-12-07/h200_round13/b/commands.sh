# call B (13th round): the Gluon prefill, bf16 sparse_attention and bf16 mla_decode kernels (branches merged in gpu13)
source tools/gpu/preamble.sh
nvidia-smi --query-gpu=name --format=csv > $R/gpu.txt
export TRITON_INTERPRET=0
step sg_test 200 python -m pytest -x -q tests/cuda/test_sparse_attention_gluon.py tests/cuda/test_sparse_attention_path.py
step mg_test 150 python -m pytest -x -q tests/cuda/test_mla_decode_gluon.py tests/cuda/test_mla_decode_fp8_gluon.py
step pg1 100 python -m pytest -x -q tests/cuda/test_prefill_gluon.py -k "q_lens0-prefixes0-16-192"
grep -q "passed" $R/pg1.txt && step pgall 120 python -m pytest -x -q tests/cuda/test_prefill_gluon.py
grep -q " passed" $R/sg_test.txt && step ops_sparse 120 deepinfer bench ops --backend cuda --op sparse_attention --json $R/ops_sparse.json
grep -q " passed" $R/mg_test.txt && step ops_mla 120 deepinfer bench ops --backend cuda --op mla_decode --json $R/ops_mla.json
grep -q " passed" $R/pgall.txt && step ops_prefill 120 deepinfer bench ops --backend cuda --op prefill --json $R/ops_prefill.json
tar -czf $OUT/all.tgz -C $R .
cat $R/gpu.txt; for f in sg_test mg_test pg1 pgall; do echo "## $f"; tail -3 $R/$f.txt 2>/dev/null; done
grep -i "gluon\|_bf16 \|H128" $R/ops_sparse.txt $R/ops_mla.txt 2>/dev/null | cut -c1-200 | head -30; grep -i "gluon\|sdpa" $R/ops_prefill.txt 2>/dev/null | cut -c1-200 | head -12
