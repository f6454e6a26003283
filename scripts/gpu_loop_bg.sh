#!/usr/bin/env bash
# The drafter loop (benchmarks/gpu_loop.py) as ONE uninterrupted run on the lent GPU machine, outliving the
# device calls that watch it: scripts/gpu_bg.sh with the loop as its job. A device call may last 600 s and
# kills what it leaves running, except a new process session (setsid), which runs on while the machine stays
# warm (the next call comes within its 30 s idle release). So no stage is stopped at a call's deadline and
# started again: the drafter stages keep their engines, and their rates, idle fraction and MFU cover the run.
#   call 1 (carry .gpubundle/p00_00): mkdir -p $HOME/vllm-bundle && mv .gpubundle/p00_00 $HOME/vllm-bundle/ &&
#          bash scripts/gpu_loop_bg.sh start [gpu_loop.py arguments] && bash scripts/gpu_loop_bg.sh wait 5
#          (the target stage needs no vLLM: it trains while the rest of the bundle arrives)
#   call 2 (carry .gpubundle/p00_01 part01 SHA256SUMS install-on-device.sh):
#          cd $HOME/vllm-bundle && cat p00_00 $OLDPWD/.gpubundle/p00_01 > part00 && cd - && mv .gpubundle/part01
#          .gpubundle/SHA256SUMS $HOME/vllm-bundle/ && bash .gpubundle/install-on-device.sh &&
#          bash scripts/gpu_loop_bg.sh wait 480
#   calls 3..: bash scripts/gpu_loop_bg.sh wait 560     (exit 75: still running, call again at once)
# `wait N` prints the loop's log as it grows, for at most N s, and copies the results so far into $OUT
# (gpu_loop.{json,md,png,log}, the stage logs as a tarball, this driver's log). Exit: the loop's own status
# once it has ended (0 done, 1 a stage failed), 75 while it runs, 3 when no run was started.
# The arguments may name the run's stages (--stages); when the target stage is among them (or none are named)
# it runs first on its own (--stages target after the arguments), before vLLM is installed. The other stages
# wait for the bundle's install only where a bundle is being delivered ($HOME/vllm-bundle exists); elsewhere
# they use the vLLM that python3 imports.
# Settings: PROFILE (at start: gpu_loop.py's profile, h200 or h200-eagle3), BG_DIR (/tmp/gpu_loop_bg: work,
# results, logs), INSTALL_WAIT_S (900: how long the loop waits for the bundle's install after the target
# stage before it gives up by name), AFTER (at start: a command run in the same
# session once the loop ended with status 0, before `wait` reports the end; OUT is then $BG/out/after,
# copied into $OUT/after, and the loop's work folder is $BG/work).
set -uo pipefail
cd "$(dirname "$0")/.."
export BG_DIR=${BG_DIR:-/tmp/gpu_loop_bg}
BG=$BG_DIR
OUT=${OUT:-$PWD/gpu-results}
cmd=${1:-}; shift || true
if [ "$cmd" = start ]; then
  # The run's stages (the last --stages wins, as in gpu_loop.py; none given: all). The target stage needs no
  # vLLM, so when it is among them it runs first (gpu_bg's PRE), while the bundle is installed.
  stages=all; prev=
  for a in "$@"; do
    [ "$prev" = --stages ] && stages=$a
    case $a in --stages=*) stages=${a#--stages=} ;; esac
    prev=$a
  done
  args=; [ $# -gt 0 ] && args=$(printf '%q ' "$@")  # (printf of no arguments would pass one empty argument)
  env="WORK=$(printf %q "$BG/work") DEADLINE_S=none"
  pre=
  case ",$stages," in *,all,*|*,target,*) pre="$env bash scripts/gpu_loop.sh $args--stages target" ;; esac
  after=$(printf %q "${AFTER:-}")
  job="$env bash scripts/gpu_loop.sh $args; rc=\$?
if [ \$rc = 0 ] && [ -n $after ]; then
  mkdir -p \"\$OUT/after\"; echo \"gpu_loop_bg: after the loop: \"$after
  OUT=\"\$OUT/after\" WORK=$(printf %q "$BG/work") bash -c $after
  echo \"gpu_loop_bg: the after-commands ended with status \$?\"
fi
exit \$rc"
  PRE="$pre" exec bash scripts/gpu_bg.sh start "$job"
fi
if [ "$cmd" = wait ]; then
  COPY="gpu_loop.json gpu_loop.md gpu_loop.png gpu_loop.log gpu_loop_logs.tar.gz after" LOG_NAME=gpu_loop_bg.log \
    bash scripts/gpu_bg.sh wait "${1:-560}"
  rc=$?
  [ "$rc" = 3 ] && exit 3
  [ -f "$BG/out/gpu_loop_logs.tar.gz" ] || tar -czf "$OUT/gpu_loop_logs.tar.gz" -C "$BG/work" logs 2>/dev/null
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null
  [ "$rc" = 75 ] || echo "gpu_loop_bg: the loop ended with status $rc"
  exit "$rc"
fi
echo "usage: bash scripts/gpu_loop_bg.sh start [gpu_loop.py args] | wait SECONDS"; exit 2
