#!/usr/bin/env bash
# The drafter loop on the lent GPU machine (benchmarks/gpu_loop.py, profile h200). One command per device
# call, the same each time: it resumes from /tmp/gpu_loop (kept while the machine stays warm: issue the
# next call at once) and ends before DEADLINE_S (575 s), so a call ends inside its 600 s limit.
# Exit 0: done; 75: not finished, call again; 1: a stage failed (see gpu_loop.log / gpu_loop_logs.tar.gz).
# vLLM 0.25.1 comes from the bundle (../shared/gpu.md); the target stage needs no vLLM, so the first call
# can run it while part00 of the bundle arrives:
#   call 1 (carry .gpubundle/part00): mkdir -p $HOME/vllm-bundle && mv .gpubundle/part00 $HOME/vllm-bundle/ &&
#                                     bash scripts/gpu_loop.sh --stages target
#   call 2 (carry part01, SHA256SUMS, install-on-device.sh): mv .gpubundle/part01 .gpubundle/SHA256SUMS
#                                     $HOME/vllm-bundle/ && bash .gpubundle/install-on-device.sh && bash scripts/gpu_loop.sh
#   calls 3..: bash scripts/gpu_loop.sh          (until it exits 0)
# Better, when the calls can follow each other within the machine's idle release: scripts/gpu_loop_bg.sh runs
# this once, uninterrupted, in a process session of its own (no stage restarted at a call's limit).
# Results in $OUT (or ./gpu-results): gpu_loop.json, gpu_loop.md, gpu_loop.png, gpu_loop.log, gpu_loop_logs.tar.gz.
# Settings: PROFILE (h200), WORK (/tmp/gpu_loop), DEADLINE_S (575; none: no deadline); extra arguments go to the script.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
[ -f "$HOME/vllm-site/env.sh" ] && source "$HOME/vllm-site/env.sh"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 LAYERTAP_CACHE=${LAYERTAP_CACHE:-/tmp/layertap-cache}
export VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1
# The online runs' shm pool (2 GiB) needs room in /dev/shm; containers often mount a small one.
shm_gb=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)
[ "${shm_gb:-0}" -lt 8 ] && mount -o remount,size=32G /dev/shm 2>/dev/null
{ date -u; nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader; df -h /dev/shm /tmp | tail -2; } 2>&1
deadline=(--deadline-s "${DEADLINE_S:-575}")
[ "${DEADLINE_S:-}" = none ] && deadline=()  # one uninterrupted run (scripts/gpu_loop_bg.sh)
exec python3 benchmarks/gpu_loop.py --profile "${PROFILE:-h200}" --work "${WORK:-/tmp/gpu_loop}" --out "$OUT" \
  "${deadline[@]}" "$@"
