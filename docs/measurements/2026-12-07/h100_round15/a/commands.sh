# session 15 call a: the spill-free seesaw mla schedule on the GPU (sweep, GPU tests, conformance and bench ops with it in the table)
source tools/gpu/preamble.sh
nvidia-smi --query-gpu=name --format=csv > $R/gpu.txt
export TRITON_INTERPRET=0
step sweep_mla 120 python -m deepinfer_cuda.bench.gemm --sweep mla_gluon_bf16 --json $R/sweep_mla.json
step mla_test 170 python -m pytest -q tests/cuda/test_mla_decode_gluon.py tests/cuda/test_mla_decode_gluon_seesaw.py -k "not test_the_sweep_loop_runs_each_switch"
sed -i 's/"gluon_bf16": {"schedule": "split_keys"/"gluon_bf16": {"schedule": "seesaw_early_release"/' backends/cuda/tuning/default.py
grep -n '"gluon_bf16"' backends/cuda/tuning/default.py > $R/table.txt
step conf_mla 120 deepinfer conformance --backend cuda --op mla_decode --json $R/conf_mla.json
step ops_mla 110 deepinfer bench ops --backend cuda --op mla_decode --json $R/ops_mla.json
tar -czf $OUT/all.tgz -C $R .
for f in mla_test conf_mla; do echo "## $f"; tail -3 $R/$f.txt; done; grep "B128_ctx4096" $R/sweep_mla.txt | tail -8; grep -i "h128\|H=128\|heads 128" $R/ops_mla.txt | cut -c1-170 | head -20
