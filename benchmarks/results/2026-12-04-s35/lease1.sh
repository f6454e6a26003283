#!/usr/bin/env bash
# One lease (2026-12-04, session 35): GPU tests of the lean path, the small-model prefill with the block-hash
# and turnaround cuts, serving the 8B shape (plain, capture, floor), the 8B prefill. Untracked; deleted after.
set -u
T0=$(date +%s); el() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
GPU_TEST_K="lean or streams or device_commit or kernel_scatter or (matches_hf and compiled and not extract and not piecewise)" \
  bash scripts/gpu_check.sh tests
el "tests"
SKIP_TRAIN_BENCH=1 SKIP_PROFILE=1 BENCH_REPEATS=4 BENCH_BATCH_SIZES=1,4,16,64,256 \
  BENCH_VARIANTS=plain,floor,floor-hashed,capture BENCH_ARGS="--no-hf --gpu-build --chunk 64 --stats" \
  bash scripts/gpu_check.sh bench
mkdir -p "$OUT/small" && mv "$OUT"/capture_overhead.* "$OUT/small/"
el "small prefill"
for i in $(seq 300); do [ -f "$HOME/serve-wheels/.done" ] && break; sleep 2; done
ln -sfn "$HOME/serve-wheels" .gpubundle/serve
SERVE_ROUNDS=3 SERVE_DEADLINE=470 SERVE_VARIANTS=plain,capture,floor \
  SERVE_ARGS="--hidden 4096 --num-layers 32 --gpu-build" bash scripts/gpu_check.sh serve
el "serve"
source "$HOME/vllm-site/env.sh"
export PYTHONPATH=$PWD LAYERTAP_CACHE=/tmp/layertap-cache VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
timeout 400 python3 benchmarks/capture_overhead.py --hidden 4096 --num-layers 32 --head-dim 128 --vocab 2048 \
  --prompts 256 --prompt-len 1024 --dtype bfloat16 --transport shm --slot-mb 33 --batch-sizes 1,4,16,64,256 \
  --variants plain,capture --repeats 3 --no-hf --gpu-build --stats --json "$OUT/capture_overhead_8b.json" \
  > "$OUT/capture_overhead_8b.log" 2>&1
grep "round\|^ *[0-9]" "$OUT/capture_overhead_8b.log" | grep -v "^(Engine" | tail -40
el "8B prefill"
