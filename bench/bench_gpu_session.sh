#!/usr/bin/env bash
# One device call: environment probe, knee sweep (MPS, CUDA-graph timing), kernel traces,
# GPU tests; on request: frontend (the server's CPU per answered and per refused request on this host's CPU) and overload (the chaos
# benchmark's overload scenario on the GPU mix: dstack and spatial side by side, the load
# generator on the upper half of the cores; extra flags in OVERLOAD_ARGS, e.g.
# OVERLOAD_ARGS="--capacity-scale 8"; PROFILE=dstack+4fe: a py-spy profile of that server).
# Servers share one MPS daemon. Each step has its own timeout so the script always reaches
# the end; results go to $OUT/results.tgz + logs.
# A bare lent machine first needs `setup`: the wheels carried in .whl/ (made here by
# `bash bench/gpu_wheels.sh`) installed into /tmp/site, the server's imports checked (exit 5,
# naming what is missing) and the Cython modules built in place.
# usage: bash bench/bench_gpu_session.sh [STEPS]   (default: all; e.g. "setup sweep trace")
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs" out/chaos
STEPS=${1:-"probe sweep trace tests"}
case " $STEPS " in *" setup "*)
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH
  fi
  err=$(python3 -c "import server.main, server.frontends, bench.bench_chaos" 2>&1) \
    || { echo "setup: the server cannot import: ${err##*$'\n'}"; exit 5; }
  python3 setup.py -q build_ext --inplace > "$OUT/logs/build.txt" 2>&1 \
    || { tail -20 "$OUT/logs/build.txt"; exit 4; } ;;
esac
SWEEP_S=${SWEEP_S:-300}
MODELS="resnet50 vgg19 mobilenet_v3_large efficientnet_b0 densenet121 vit_b_16"
BS=1,2,4,8,16,32,64
SLUG=$(python3 -c "import re,torch;print(re.sub(r'[^a-z0-9]+','-',torch.cuda.get_device_name(0).lower()).strip('-'))")
P=profiles/$SLUG; mkdir -p "$P" "$OUT/logs"
echo "gpu slug: $SLUG" | tee "$OUT/summary.txt"
step() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }
pack() { tar czf "$OUT/results.tgz" "$P" "$OUT/logs" 2>/dev/null; }
if step probe; then
  { nvidia-smi; which nvidia-cuda-mps-control; python3 -c "import torch;print(torch.__version__, torch.cuda.get_device_properties(0)); print('green_contexts', hasattr(torch.cuda,'green_contexts'))"; } > "$OUT/logs/probe.txt" 2>&1
  tail -3 "$OUT/logs/probe.txt" >> "$OUT/summary.txt"
fi
if step sweep; then
  t0=$(date +%s)
  timeout "$SWEEP_S" python3 -m knee_profiler.cli profile $MODELS --device cuda --batch-sizes $BS \
    --percentages 10,20,...,100 --start-mps --timing graph --repeats 20 --warmup 3 \
    --min-time 0.1 --max-repeats 100 --out "$P" --no-progress > "$OUT/logs/sweep.txt" 2>&1
  echo "sweep rc=$? in $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"; pack
fi
if step sweep16; then
  t0=$(date +%s)
  timeout "${SWEEP16_S:-200}" python3 -m knee_profiler.cli profile $MODELS --device cuda --batch-sizes $BS \
    --percentages 10,20,...,100 --start-mps --timing graph --repeats 20 --warmup 3 --dtype fp16 \
    --min-time 0.1 --max-repeats 100 --out "$P-fp16" --no-progress > "$OUT/logs/sweep16.txt" 2>&1
  echo "sweep fp16 rc=$? in $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
  tar czf "$OUT/results.tgz" "$P" "$P-fp16" "$OUT/logs" 2>/dev/null
fi
if step trace; then
  timeout 90 python3 -m knee_profiler.cli trace $MODELS --batch-sizes $BS --out "$P/traces" \
    > "$OUT/logs/trace.txt" 2>&1; echo "trace rc=$?" >> "$OUT/summary.txt"; pack
fi
if step tests; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/integration/test_runtime_mps_gpu.py \
    tests/integration/test_knee_profile_gpu.py ${TESTS_K:+-k "$TESTS_K"} > "$OUT/logs/tests.txt" 2>&1
  echo "tests rc=$?: $(tail -1 "$OUT/logs/tests.txt")" >> "$OUT/summary.txt"; pack
fi
# One MPS daemon per GPU: the servers of a step attach to it (CUDA_MPS_PIPE_DIRECTORY).
mps_start() { MPS_ENV="CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)"
  env $MPS_ENV nvidia-cuda-mps-control -d; }
mps_stop() { echo quit | env $MPS_ENV nvidia-cuda-mps-control; }
if step frontend; then
  { timeout 90 python3 -m bench.bench_chaos --only accept-cost | grep -i 'accept cost'
    timeout 90 python3 -m bench.bench_chaos --only refusal-cost | grep -i 'refusal cost'; } \
    > "$OUT/logs/frontend.txt" 2>&1
  echo "frontend rc=$?" >> "$OUT/summary.txt"; cat "$OUT/logs/frontend.txt" >> "$OUT/summary.txt"
fi
if step overload; then
  N=$(nproc); mps_start
  t0=$(date +%s)
  # PROFILE=LABEL (e.g. dstack+4fe): py-spy (a carried wheel) samples that server's deciding
  # process for PROFILE_S s from PROFILE_DELAY s after it starts, without pausing it, at
  # PROFILE_RATE a s (100); PROFILE_FORMAT=speedscope keeps every tick in order, idle ones
  # too (open it in speedscope.app).
  PF=${PROFILE_FORMAT:-raw}; PR=${PROFILE_RATE:-100}
  if [ -n "${PROFILE:-}" ]; then
    ( for _ in $(seq 1 300); do
        pid=$(pgrep -f "serve --config .*/overload-${PROFILE//+/\\+}\.yaml" | head -1)
        [ -n "$pid" ] && break; sleep 1; done
      [ -z "${pid:-}" ] && exit 0
      sleep "${PROFILE_DELAY:-20}"
      echo "py-spy from $(date -u +%T) UTC" > "$OUT/logs/profile.txt"
      py-spy record -p "$pid" -d "${PROFILE_S:-60}" -r "$PR" --nonblocking -f "$PF" \
        $([ "$PF" = speedscope ] && echo --idle) -o "$OUT/logs/profile.$PF" \
        >> "$OUT/logs/profile.txt" 2>&1 ) &
  fi
  # shellcheck disable=SC2086
  env $MPS_ENV timeout "${OVERLOAD_S:-480}" python3 -m bench.bench_chaos --only overload \
    --mix h100 --load-cores $(seq -s ' ' $((N / 2)) $((N - 1))) --load-procs "${LOAD_PROCS:-4}" \
    ${OVERLOAD_ARGS:-} > "$OUT/logs/overload.txt" 2>&1
  echo "overload rc=$? in $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
  mps_stop; wait
  cp out/chaos/chaos.json "$OUT/logs/overload.json" 2>/dev/null
  for f in out/chaos/overload-*.log; do  # (no "+" in a name that comes back)
    b=$(basename "$f" .log); tail -c 20000 "$f" > "$OUT/logs/server-${b//+/-}.txt"
  done
  grep -A40 '^scenario' "$OUT/logs/overload.txt" >> "$OUT/summary.txt"
  if [ -s "$OUT/logs/profile.raw" ]; then  # where the profiled process's time went
    awk '{n=$NF; $NF=""; k=split($0,f,";"); s[f[k]]+=n; t+=n} END {for (x in s)
      printf "%5.1f%% self %s\n", 100*s[x]/t, x}' "$OUT/logs/profile.raw" | sort -rn | head -15 \
      >> "$OUT/summary.txt"
  fi
  [ -s "$OUT/logs/profile.speedscope" ] && gzip -f "$OUT/logs/profile.speedscope"
  pack
fi
pack
for f in "$P"/*.json; do python3 -m knee_profiler.cli show "$f" 2>&1 | awk '{print $1, $(NF-3)}' | tr '\n' ' '; echo; done >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
