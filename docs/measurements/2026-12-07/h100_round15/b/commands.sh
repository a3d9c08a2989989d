# session 15 call b: the persistent prefill's GPU tests, conformance and bench ops with it as the default (this copy only); e2e
source tools/gpu/preamble.sh
export TRITON_INTERPRET=0
step prefill_test 200 python -m pytest -q -x tests/cuda/test_prefill_gluon.py
sed -i 's/    persistent: bool = False/    persistent: bool = True/' backends/cuda/kernels/prefill_gluon.py
grep -n "persistent: bool" backends/cuda/kernels/prefill_gluon.py > $R/persistent.txt
step conf_prefill_persistent 120 deepinfer conformance --backend cuda --op prefill --json $R/conf_prefill_persistent.json
step ops_prefill_persistent 90 deepinfer bench ops --backend cuda --op prefill --json $R/ops_prefill_persistent.json
step e2e 150 python -m pytest -q tests/cuda/test_end_to_end.py
tar -czf $OUT/all.tgz -C $R .
for f in prefill_test conf_prefill_persistent e2e; do echo "## $f"; tail -3 $R/$f.txt; done; grep -v "^\[" $R/ops_prefill_persistent.txt | cut -c1-150 | tail -20
