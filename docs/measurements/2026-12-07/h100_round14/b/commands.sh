# call B (session 14): the fp8 Gluon schedule options' GPU test and sweep
source tools/gpu/preamble.sh
nvidia-smi --query-gpu=name --format=csv > $R/gpu.txt
export TRITON_INTERPRET=0
step fp8g_test 150 python -m pytest -q tests/cuda/test_gemm_fp8_gluon.py
step fp8g_sweep 240 python -m deepinfer_cuda.bench.gemm --sweep fp8_gluon_large
for f in fp8g_test; do echo "## $f"; tail -3 $R/$f.txt; done
tail -30 $R/fp8g_sweep.txt
