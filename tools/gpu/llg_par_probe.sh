source tools/gpu/preamble.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/structured/*.whl
nproc; python -c "import os; print(len(os.sched_getaffinity(0)))"
for b in 16 64 256; do timeout 100 python tools/gpu/llg_par_probe.py $b; done
