# call D (session 14): the three Gluon attention kernels' variant sweeps (outputs compared with the default / tl kernel in each)
source tools/gpu/preamble.sh
nvidia-smi --query-gpu=name --format=csv > $R/gpu.txt
export TRITON_INTERPRET=0
step sweep_sparse 115 python -m deepinfer_cuda.bench.sparse_attention_sweep --sweep sparse_gluon_bf16 --json $R/sweep_sparse.json
step sweep_mla 115 python -m deepinfer_cuda.bench.gemm --sweep mla_gluon_bf16 --json $R/sweep_mla.json
step sweep_prefill 110 python -m deepinfer_cuda.bench.attention_prefill --sweep prefill_gluon --only persistent --json $R/sweep_prefill.json
tar -czf $OUT/all.tgz -C $R .
for f in sweep_sparse sweep_mla sweep_prefill; do echo "## $f"; tail -25 $R/$f.txt | cut -c1-170; done
