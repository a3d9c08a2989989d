# call A (session 14): GPU conformance with the Gluon options chosen, and the cuBLAS default
source tools/gpu/preamble.sh
nvidia-smi --query-gpu=name --format=csv > $R/gpu.txt
export TRITON_INTERPRET=0
step conf_sparse 200 deepinfer conformance --backend cuda --op sparse_attention --backend-option sparse_attention_path=gluon --json $R/conf_sparse.json
step conf_prefill 120 deepinfer conformance --backend cuda --op prefill --backend-option prefill_path=gluon --json $R/conf_prefill.json
step conf_gemm 130 deepinfer conformance --backend cuda --op linear --op grouped_gemm --json $R/conf_gemm.json
step conf_mla 100 deepinfer conformance --backend cuda --op mla_decode --backend-option mla_decode_path=gluon --json $R/conf_mla.json
step reach 60 python .whl/reach.py
for f in conf_sparse conf_prefill conf_gemm conf_mla reach; do echo "## $f"; tail -3 $R/$f.txt; done
