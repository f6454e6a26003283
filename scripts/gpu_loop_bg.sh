#!/usr/bin/env bash
# The drafter loop (benchmarks/gpu_loop.py) as ONE uninterrupted run on the lent GPU machine, outliving the
# device calls that watch it. A device call may last 600 s and kills what it leaves running, except a new
# process session (setsid), which runs on while the machine stays warm (the next call comes within its 30 s
# idle release). So no stage is stopped at a call's deadline and started again: the drafter stages keep
# their engines, and their rates, idle fraction and MFU cover the whole run.
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
BG=${BG_DIR:-/tmp/gpu_loop_bg}
OUT=${OUT:-$PWD/gpu-results}
cmd=${1:-}; shift || true
if [ "$cmd" = start ]; then
  mkdir -p "$BG/out"
  if [ -f "$BG/pid" ] && kill -0 "$(cat "$BG/pid")" 2>/dev/null; then echo "already running: pid $(cat "$BG/pid")"; exit 0; fi
  rm -f "$BG/rc"
  # The run's stages (the last --stages wins, as in gpu_loop.py; none given: all). The target stage needs no
  # vLLM, so when it is among them it runs first, while the bundle is installed.
  stages=all; prev=
  for a in "$@"; do
    [ "$prev" = --stages ] && stages=$a
    case $a in --stages=*) stages=${a#--stages=} ;; esac
    prev=$a
  done
  first_target=0
  case ",$stages," in *,all,*|*,target,*) first_target=1 ;; esac
  args=; [ $# -gt 0 ] && args=$(printf '%q ' "$@")  # (printf of no arguments would pass one empty argument)
  cat > "$BG/driver.sh" <<EOF
#!/usr/bin/env bash
cd "$PWD"
export WORK="$BG/work" OUT="$BG/out" DEADLINE_S=none
t0=\$(date +%s)
rc=0
if [ "$first_target" = 1 ]; then bash scripts/gpu_loop.sh $args--stages target; rc=\$?; fi
# A bundle being delivered (\$HOME/vllm-bundle, the lent machine): wait for its install. Without one, vLLM is
# whatever this machine's python3 imports.
if [ \$rc = 0 ] && [ -d \$HOME/vllm-bundle ]; then
  while [ ! -f \$HOME/vllm-site/.installed ] && [ \$(( \$(date +%s) - t0 )) -lt ${INSTALL_WAIT_S:-900} ]; do sleep 2; done
  if [ ! -f \$HOME/vllm-site/.installed ]; then
    echo "gpu_loop_bg: vLLM not installed after ${INSTALL_WAIT_S:-900} s (install-on-device.sh in call 2); stopping"; rc=2
  fi
fi
if [ \$rc = 0 ]; then
  bash scripts/gpu_loop.sh $args; rc=\$?
fi
if [ \$rc = 0 ] && [ -n "\$AFTER" ]; then
  mkdir -p "$BG/out/after"
  echo "gpu_loop_bg: after the loop: \$AFTER"
  OUT="$BG/out/after" bash -c "\$AFTER"
  echo "gpu_loop_bg: the after-commands ended with status \$?"
fi
echo \$rc > "$BG/rc"
EOF
  printf 'AFTER=%q\n' "${AFTER:-}" | cat - "$BG/driver.sh" > "$BG/driver.tmp" && mv "$BG/driver.tmp" "$BG/driver.sh"
  setsid nohup bash "$BG/driver.sh" > "$BG/driver.log" 2>&1 < /dev/null &
  echo $! > "$BG/pid"
  echo "gpu_loop_bg: started pid $(cat "$BG/pid"), log $BG/driver.log"
  exit 0
fi
if [ "$cmd" = wait ]; then
  [ -f "$BG/driver.log" ] || { echo "gpu_loop_bg: no run started in $BG"; exit 3; }
  limit=${1:-560}; t0=$(date +%s)
  shown=0
  show() {  # the log's new lines, without vLLM's own
    local n; n=$(wc -l < "$BG/driver.log")
    [ "$n" -gt "$shown" ] && sed -n "$((shown + 1)),${n}p" "$BG/driver.log" | grep -v "^(EngineCore\|^(Worker\|^INFO\|^(APIServer"
    shown=$n
  }
  while [ ! -f "$BG/rc" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do show; sleep 3; done
  show
  mkdir -p "$OUT"
  for f in gpu_loop.json gpu_loop.md gpu_loop.png gpu_loop.log gpu_loop_logs.tar.gz; do
    [ -f "$BG/out/$f" ] && cp "$BG/out/$f" "$OUT/"
  done
  [ -f "$BG/out/gpu_loop_logs.tar.gz" ] || tar -czf "$OUT/gpu_loop_logs.tar.gz" -C "$BG/work" logs 2>/dev/null
  [ -d "$BG/out/after" ] && cp -r "$BG/out/after" "$OUT/"
  cp "$BG/driver.log" "$OUT/gpu_loop_bg.log"
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null
  if [ -f "$BG/rc" ]; then echo "gpu_loop_bg: the loop ended with status $(cat "$BG/rc")"; exit "$(cat "$BG/rc")"; fi
  echo "gpu_loop_bg: still running after ${limit} s of this call (call wait again)"; exit 75
fi
echo "usage: bash scripts/gpu_loop_bg.sh start [gpu_loop.py args] | wait SECONDS"; exit 2
