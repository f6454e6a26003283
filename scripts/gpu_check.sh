#!/usr/bin/env bash
# The GPU checks, in one script, for the lent GPU machine (bare: torch 2.11 + transformers, no vLLM, no
# network). vLLM 0.25.1 arrives as a bundle in two device runs (see ../shared/gpu.md and README "GPU").
#   bash scripts/gpu_check.sh startup # run first on a bare machine: Tap, plain LLM, Tap starts under the
#                                      # start-up watchdog (START_TIMEOUT, 240 s), times + hang reports
#   bash scripts/gpu_check.sh tests   # CUDA capture correctness (eager + compiled, bf16 vs HF), stream
#                                      # safety, layer-0 bug detection, tensor parallel 2 if 2 GPUs
#                                      # (GPU_TEST_K="...": a pytest -k expression, spaces and all)
#   bash scripts/gpu_check.sh bench   # capture overhead (hidden 2048, 16 layers, 1..256 in flight; plain,
#                                      # capture and floor engines side by side (floor: the hook engine reading
#                                      # no rows, which splits the gap into engine and record path),
#                                      # BENCH_REPEATS (3) interleaved rounds; BENCH_VARIANTS=... picks others (see
#                                      # the benchmark docstring)); then a torch-profiler trace of every engine
#                                      # at 1 and 4 in flight (PROFILE_INFLIGHT; SKIP_PROFILE=1: none),
#                                      # summarized side by side + trainer MFU (SKIP_TRAIN_BENCH=1: skip)
#   bash scripts/gpu_check.sh bench-tp2   # the overhead ratio with tensor parallel 2 (two GPUs)
#   bash scripts/gpu_check.sh loop    # train a target, EAGLE-3 + DFlash online and offline, serve them with
#                                      # speculative decoding, report (benchmarks/gpu_loop.py; exit 75: call again)
#   bash scripts/gpu_check.sh serve   # layertap serve --capture-all vs vllm serve, all under `vllm bench serve`
#                                      # (512 in / 256 out, concurrency 1,16,64; needs .gpubundle/serve wheels;
#                                      # SERVE_VARIANTS (plain,capture; add floor for the capture engine
#                                      # without records, capture-piecewise for vLLM's PIECEWISE fallback,
#                                      # settled in RESULTS 2026-12-02), side by side,
#                                      # SERVE_ROUNDS (3) interleaved rounds;
#                                      # SERVE_DEADLINE: no round starts that would end past it, s from the
#                                      # benchmark's start; leave ~60 s for the HF check after the rounds)
#   bash scripts/gpu_check.sh models  # build the benchmark models on the GPU (needs no vLLM: run it while the
#                                      # bundle installs): the bench shape and the 8B-shaped one (hidden 4096,
#                                      # 32 layers; MODELS=small: the bench shape only), random bf16 weights, as
#                                      # --gpu-build makes them
#   bash scripts/gpu_check.sh profile     # py-spy over PROFILE_VARIANTS (plain capture) at PROFILE_INFLIGHT (1):
#                                          # where a request's time goes, per process and thread; PROFILE_ARGS
#                                          # override the workload (e.g. "--prompt-len 512 --max-tokens 256":
#                                          # decode-heavy, as in serving) (needs
#                                          # py-spy: on PATH, or its wheel carried as .gpubundle/py_spy-*.whl)
#   bash scripts/gpu_check.sh recordpath  # the worker's record path alone (benchmarks/record_path_cost.py; needs no
#                                          # vLLM): step-thread time per phase at 1 and 8 records per step; BASE_TREE=DIR:
#                                          # paired against another checkout (e.g. carried as .base), RP_ROUNDS (3) rounds;
#                                          # BASE_TREE=. RP_ARGS='--baseline-options {"lean":false}': the lean record path
#                                          # against the torch one in this checkout
# Results and logs go to $OUT (the device tool's return folder) or ./gpu-results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
[ -f "$HOME/vllm-site/env.sh" ] && source "$HOME/vllm-site/env.sh"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 LAYERTAP_CACHE=/tmp/layertap-cache
export VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false
phase=${1:-all}
{
  date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
  df -h /dev/shm | tail -1
} 2>&1 | tee "$OUT/env.txt"
# The shm pools need room in /dev/shm; containers often mount a small one.
shm_gb=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)
[ "${shm_gb:-0}" -lt 40 ] && mount -o remount,size=48G /dev/shm 2>/dev/null; df -h /dev/shm | tail -1
# One 17 MiB slot per record, 2 x the largest in-flight target + 16 slots (the Tap admits a request only while
# the pool has room for it, so a smaller pool would cap capture's in-flight count below plain's).
bench_transport="--transport shm --slot-mb 17"
[ "$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)" -lt 12 ] && bench_transport="--transport file --out /tmp/lt-bench"
rc=0
if [ "$phase" = models ]; then  # no vLLM needed (capture_overhead imports it only to run engines)
  shapes=("--hidden 2048 --num-layers 16" "--hidden 4096 --num-layers 32")
  [ "${MODELS:-}" = small ] && shapes=("${shapes[0]}")  # MODELS=small: the bench shape only
  for shape in "${shapes[@]}"; do
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import capture_overhead as co; \
print(co.build_model(co.parse_args(sys.argv[1:])))" $shape --head-dim 128 --vocab 2048 --dtype bfloat16 --gpu-build
    rc=$(( rc | $? ))
  done
fi
if [ "$phase" = startup ]; then  # first thing on a bare machine: engine starts under the watchdog
  if ! command -v py-spy >/dev/null; then  # the watchdog's report then carries native stacks of plain engines
    pip install --target /tmp/pyspy .gpubundle/py_spy-*.whl -q >/dev/null 2>&1 && export PATH=/tmp/pyspy/bin:$PATH
  fi
  python3 benchmarks/startup_probe.py --start-timeout ${START_TIMEOUT:-240} --starts ${STARTS:-tap,plain,tap,plain} ${PROBE_ARGS:-} --json "$OUT/startup_probe.json" 2>&1 \
    | tee "$OUT/startup_probe.log" | grep -v "^(EngineCore\|^(Worker\|^INFO\|^(APIServer" | tail -80
  rc=${PIPESTATUS[0]}
fi
if [ "$phase" = tests ] || [ "$phase" = all ]; then
  python3 -m pytest -q -p no:cacheprovider -s tests/gpu ${GPU_TEST_ARGS:-} ${GPU_TEST_K:+-k "$GPU_TEST_K"} 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^(EngineCore\|^(Worker\|^INFO\|^(APIServer" | tail -60
  rc=${PIPESTATUS[0]}
fi
bench_args="--hidden 2048 --num-layers 16 --head-dim 128 --vocab 2048 --prompts 256 --prompt-len 1024 --dtype bfloat16 $bench_transport"
if [ "$phase" = bench ] || [ "$phase" = all ]; then
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} python3 benchmarks/capture_overhead.py $bench_args \
    --batch-sizes ${BENCH_BATCH_SIZES:-1,4,16,64,256} \
    --variants ${BENCH_VARIANTS:-plain,capture,floor} --repeats ${BENCH_REPEATS:-3} ${BENCH_ARGS:-} \
    $( [ -z "${SKIP_PROFILE:-}" ] && echo "--profile-dir /tmp/lt-profile --profile-inflight ${PROFILE_INFLIGHT:-1,4}" ) \
    --json "$OUT/capture_overhead.json" > "$OUT/capture_overhead.log" 2>&1
  rc=$(( rc | $? ))
  # the results tables, without vLLM's logs and the profiler's own op tables
  sed -n '/^capture overhead on/,$p' "$OUT/capture_overhead.log" | grep -v "^(EngineCore\|^(Worker\|^INFO\|WARNING" | head -80
  mkdir -p "$OUT/profile" && cp /tmp/lt-profile/*/*.summary.json "$OUT/profile/" 2>/dev/null
  pin=${PROFILE_INFLIGHT:-1,4}
  for t in /tmp/lt-profile/{plain,floor,capture}/*inflight${pin%%,*}*.json.gz; do  # traces to open in Perfetto, if small
    [ -f "$t" ] && [ "$(stat -c %s "$t")" -lt ${TRACE_MAX_BYTES:-15000000} ] && cp "$t" "$OUT/profile/"
  done
  if [ -f benchmarks/train_throughput.py ] && [ -z "${SKIP_TRAIN_BENCH:-}" ]; then
    python3 benchmarks/train_throughput.py 2>&1 | tee "$OUT/train_throughput.log" | tail -8
    rc=$(( rc | PIPESTATUS[0] ))
  fi
fi
if [ "$phase" = bench-tp2 ] || { [ "$phase" = all ] && [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; }; then
  python3 benchmarks/capture_overhead.py $bench_args --batch-sizes 1,16,64 --tp 2 --no-hf \
    --variants ${BENCH_TP2_VARIANTS:-plain,capture} --repeats ${BENCH_REPEATS:-3} \
    --json "$OUT/capture_overhead_tp2.json" 2>&1 | tee "$OUT/capture_overhead_tp2.log" | grep -v "^(EngineCore\|^(Worker\|^INFO\|WARNING" | tail -16
  rc=$(( rc | PIPESTATUS[0] ))
fi
if [ "$phase" = serve ]; then  # layertap serve --capture-all vs vllm serve under `vllm bench serve`
  # vLLM's API server and load generator need packages the lean bundle leaves out: carry their wheels in
  # .gpubundle/serve (scripts/build-serve-wheels.sh) and install what the imports miss.
  python3 scripts/gpu_extra_deps.py .gpubundle/serve vllm.entrypoints.openai.api_server vllm.benchmarks.serve \
    'vllm.entrypoints.serve.*' 'vllm.entrypoints.openai.*' 'vllm.benchmarks.lib.*' 2>&1 \
    | tee "$OUT/serve_deps.log" | tail -4
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 0 ]; then
    python3 benchmarks/serve_overhead.py --hidden 2048 --num-layers 16 --head-dim 128 --vocab 2048 --dtype bfloat16 \
      --input-len 512 --output-len 256 --concurrency ${SERVE_CONCURRENCY:-1,16,64} --rounds ${SERVE_ROUNDS:-3} \
      --variants ${SERVE_VARIANTS:-plain,capture} --log-dir "$OUT/serve-logs" \
      $( [ -n "${SERVE_DEADLINE:-}" ] && echo "--deadline-s $SERVE_DEADLINE" ) ${SERVE_ARGS:-} \
      --json "$OUT/serve_overhead.json" > "$OUT/serve_overhead.log" 2>&1
    rc=$?
    grep -v "^(EngineCore\|^(Worker\|^INFO\|WARNING\|^(APIServer\|Loading weights\|verify:" "$OUT/serve_overhead.log" | tail -24
  fi
fi
if [ "$phase" = recordpath ]; then
  python3 benchmarks/record_path_cost.py --records ${RP_RECORDS:-1,8} --busy-ms ${RP_BUSY:-0,5} --iters ${RP_ITERS:-150} \
    $( [ -n "${BASE_TREE:-}" ] && echo "--baseline-tree $BASE_TREE --rounds ${RP_ROUNDS:-3}" ) ${RP_ARGS:-} \
    --json "$OUT/record_path_cost.json" 2>&1 | tee "$OUT/record_path_cost.log" | tail -20
  rc=${PIPESTATUS[0]}
fi
if [ "$phase" = loop ]; then  # the whole drafter loop (benchmarks/gpu_loop.py); resumable: call again on exit 75
  python3 benchmarks/gpu_loop.py --profile ${LOOP_PROFILE:-h200} --work ${LOOP_WORK:-/tmp/gpu_loop} --out "$OUT" \
    --deadline-s ${LOOP_DEADLINE:-540} ${LOOP_ARGS:-} 2>&1 | grep -v "^(EngineCore\|^(Worker\|^INFO\|^(APIServer" | tail -40
  rc=${PIPESTATUS[0]}
fi
if [ "$phase" = profile ]; then
  if ! command -v py-spy >/dev/null; then
    pip install --target /tmp/pyspy .gpubundle/py_spy-*.whl -q >/dev/null 2>&1 && export PATH=/tmp/pyspy/bin:$PATH
  fi
  for v in ${PROFILE_VARIANTS:-plain capture}; do
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} python3 benchmarks/profile_capture.py --variant $v \
      --inflight ${PROFILE_INFLIGHT:-1} --out "$OUT/profile" $bench_args ${PROFILE_ARGS:-} 2>&1 | head -40
    rc=$(( rc | PIPESTATUS[0] ))
  done
fi
exit $rc
