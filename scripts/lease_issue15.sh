#!/usr/bin/env bash
# The next H200 lease for issue 15, as one script (scripts/gpu_bg.sh start 'bash scripts/lease_issue15.sh'; see
# benchmarks/RESULTS.md for the call chain that brings vLLM and the serve wheels). In order of what it must
# settle, each step writing under $OUT before the next starts, so a lease cut short still answers the first:
#   0. (PRE, while the bundle arrives; needs no vLLM) the record path on the engine's step thread, this tree
#      against the one before the 2026-12-05 cuts (a record's manifest encoded from a template, struct token
#      conversion): PRE='bash scripts/gpu_check.sh models && BASE_TREE=.base bash scripts/gpu_check.sh
#      recordpath', with .base carried (git archive 77fa22a layertap benchmarks/record_path_cost.py | tar -x -C .base).
#   1. Small model, 1-16 in flight, where capture is short (0.83-0.93): is the driver late to the engine's
#      output (capture_overhead --stats: out = send + late + proc), and does handling records only while no
#      output waits (capture, the default since 2026-12-05) beat handling them at once (capture-eager)?
#      Six rounds of short pieces: the 'in' phase is bimodal on that host, so ranges need many rounds.
#      Then a torch-profiler trace of each engine at 16 in flight (PROFILE_INFLIGHT): is the GPU idle longer
#      per request with capture (its step thread on the critical path), or equally busy (the gap elsewhere)?
#   2. Serving the 8B shape, 2 rounds and the HF check of served records on the GPU.
#   3. Prefill of the 8B shape at every batch size (1 in flight was 0.93).
# About 3 (machine, vLLM) + 5 + 8 + 6 min of device time. The call chain (a fresh machine; parts from
# ../shared/gpu/build-vllm-bundle.sh .gpubundle, part00 split: split -b 45M -d -a 2 part00 p00_, so each call
# carries under 64 MiB with the ~10 MB tree; serve wheels: bash scripts/build-serve-wheels.sh):
#   1 (carry .gpubundle/p00_00 .base): mkdir -p $HOME/vllm-bundle && mv .gpubundle/p00_00 $HOME/vllm-bundle/ &&
#       PRE='bash scripts/gpu_check.sh models && BASE_TREE=.base bash scripts/gpu_check.sh recordpath'
#       bash scripts/gpu_bg.sh start 'bash scripts/lease_issue15.sh' && bash scripts/gpu_bg.sh wait 5
#   2 (carry .gpubundle/{p00_01,part01,SHA256SUMS,install-on-device.sh}): cd $HOME/vllm-bundle && cat p00_00
#       $OLDPWD/.gpubundle/p00_01 > part00 && rm p00_00 && cd $OLDPWD && mv .gpubundle/part01 .gpubundle/SHA256SUMS
#       $HOME/vllm-bundle/ && bash .gpubundle/install-on-device.sh && bash scripts/gpu_bg.sh wait 480
#   3 (carry .gpubundle/serve): cp -r .gpubundle/serve $HOME/serve-wheels && touch $HOME/serve-wheels/.done &&
#       bash scripts/gpu_bg.sh wait 560;   4..: bash scripts/gpu_bg.sh wait 560 (back to back: 30 s idle ends it)
set -u
T0=$(date +%s); el() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
SKIP_TRAIN_BENCH=1 PROFILE_INFLIGHT=16 BENCH_REPEATS=6 BENCH_BATCH_SIZES=1,4,16 \
  BENCH_VARIANTS=plain,floor,capture,capture-eager,capture-raw BENCH_ARGS="--no-hf --gpu-build --chunk 32 --stats" \
  bash scripts/gpu_check.sh bench
mkdir -p "$OUT/small" && mv "$OUT"/capture_overhead.* "$OUT/small/"
el "small prefill"
for i in $(seq 300); do [ -f "$HOME/serve-wheels/.done" ] && break; sleep 2; done
ln -sfn "$HOME/serve-wheels" .gpubundle/serve
SERVE_ROUNDS=2 SERVE_DEADLINE=400 SERVE_VARIANTS=plain,capture \
  SERVE_ARGS="--hidden 4096 --num-layers 32 --gpu-build --verify 8" bash scripts/gpu_check.sh serve
el "serve"
source "$HOME/vllm-site/env.sh"
export PYTHONPATH=$PWD LAYERTAP_CACHE=/tmp/layertap-cache VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
timeout 420 python3 benchmarks/capture_overhead.py --hidden 4096 --num-layers 32 --head-dim 128 --vocab 2048 \
  --prompts 256 --prompt-len 1024 --dtype bfloat16 --transport shm --slot-mb 33 --batch-sizes 1,4,16,64,256 \
  --variants plain,capture --repeats 3 --no-hf --gpu-build --stats --json "$OUT/capture_overhead_8b.json" \
  > "$OUT/capture_overhead_8b.log" 2>&1
grep "round\|^ *[0-9]" "$OUT/capture_overhead_8b.log" | grep -v "^(Engine" | tail -40
el "8B prefill"
