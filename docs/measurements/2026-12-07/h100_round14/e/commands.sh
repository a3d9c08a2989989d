# call E (session 14): the seesaw_early_release schedule of the bf16 mla_decode Gluon kernel as the table's (sed on this copy only): its GPU tests and conformance
source tools/gpu/preamble.sh
nvidia-smi --query-gpu=name --format=csv > $R/gpu.txt
export TRITON_INTERPRET=0
step mla_test 110 python -m pytest -q -x tests/cuda/test_mla_decode_gluon.py tests/cuda/test_mla_decode_gluon_seesaw.py
sed -i 's/"gluon_bf16": {"schedule": "split_keys"/"gluon_bf16": {"schedule": "seesaw_early_release"/' backends/cuda/tuning/default.py
grep -n '"gluon_bf16"' backends/cuda/tuning/default.py > $R/table.txt
step conf_mla_seesaw 90 deepinfer conformance --backend cuda --op mla_decode --json $R/conf_mla_seesaw.json
tar -czf $OUT/all.tgz -C $R .
for f in mla_test conf_mla_seesaw; do echo "## $f"; tail -3 $R/$f.txt; done; cat $R/table.txt
