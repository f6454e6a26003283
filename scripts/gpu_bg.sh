#!/usr/bin/env bash
# Any GPU job (a shell command line) as ONE uninterrupted run on the lent GPU machine, outliving the device
# calls that watch it (the same scheme as scripts/gpu_loop_bg.sh, for benchmarks rather than the loop):
#   call 1 (carry .gpubundle/p00_00): mkdir -p $HOME/vllm-bundle && mv .gpubundle/p00_00 $HOME/vllm-bundle/ &&
#          bash scripts/gpu_bg.sh start 'COMMAND LINE' && bash scripts/gpu_bg.sh wait 5
#   call 2 (carry the rest of the bundle): ... && bash .gpubundle/install-on-device.sh && bash scripts/gpu_bg.sh wait 480
#   calls 3..: bash scripts/gpu_bg.sh wait 560     (exit 75: still running, call again at once)
#   to replace a running job: bash scripts/gpu_bg.sh stop && bash scripts/gpu_bg.sh start '...' (never `pkill -f`
#   a pattern inside a device call: it matches that call's own command line and ends it; 2026-12-07)
# The command runs in its own process session with OUT=$BG/out; before it, PRE (a command line that needs no
# vLLM, e.g. building the benchmark models on the GPU) runs at once, and then, where a bundle is being
# delivered ($HOME/vllm-bundle exists), the job waits for its install (INSTALL_WAIT_S, 900 s) and stops by
# name if it never comes. `wait N` prints the job's new log lines for at most N s and copies $BG/out into
# $OUT. Exit: the job's status once it ended, 75 while it runs, 3 when none was started, 4 when its driver was
# killed from outside (no status; `wait` says so at once). `stop` ends the job's whole process session.
# Settings: BG_DIR (/tmp/gpu_bg), PRE, INSTALL_WAIT_S; for `wait`: COPY (names under $BG/out to copy; default:
# all of it as one archive, bg_out.tgz, and its 6 newest top-level files: a device call brings back 8 files), LOG_NAME (the driver log's name in $OUT,
# gpu_bg.log). scripts/gpu_loop_bg.sh is this, for the drafter loop.
set -uo pipefail
cd "$(dirname "$0")/.."
BG=${BG_DIR:-/tmp/gpu_bg}
OUT=${OUT:-$PWD/gpu-results}
cmd=${1:-}; shift || true
if [ "$cmd" = start ]; then
  [ $# -eq 1 ] || { echo "usage: bash scripts/gpu_bg.sh start 'COMMAND LINE'"; exit 2; }
  mkdir -p "$BG/out"
  if [ -f "$BG/pid" ] && kill -0 "$(cat "$BG/pid")" 2>/dev/null; then echo "already running: pid $(cat "$BG/pid")"; exit 0; fi
  rm -f "$BG/rc" "$BG/pid"
  {
    # The driver names its own pid once it runs in its new session (setsid may fork, and `start` must not
    # report before the session exists: a caller that looks at once would see the old session).
    printf 'echo $$ > %q && mv %q %q\n' "$BG/pid.new" "$BG/pid.new" "$BG/pid"
    printf 'cd %q\n' "$PWD"
    printf 'export OUT=%q\n' "$BG/out"
    printf 'PRE=%q\nJOB=%q\nWAIT_S=%q\n' "${PRE:-}" "$1" "${INSTALL_WAIT_S:-900}"
    cat <<'EOF'
t0=$(date +%s); rc=0
if [ -n "$PRE" ]; then echo "gpu_bg: pre: $PRE"; bash -c "$PRE"; rc=$?; fi
if [ $rc = 0 ] && [ -d "$HOME/vllm-bundle" ]; then  # a bundle being delivered: wait for its install
  while [ ! -f "$HOME/vllm-site/.installed" ] && [ $(( $(date +%s) - t0 )) -lt "$WAIT_S" ]; do sleep 2; done
  [ -f "$HOME/vllm-site/.installed" ] || { echo "gpu_bg: vLLM not installed after $WAIT_S s; stopping"; rc=2; }
fi
if [ $rc = 0 ]; then echo "gpu_bg: job: $JOB"; bash -c "$JOB"; rc=$?; fi
echo "gpu_bg: the job ended with status $rc"
EOF
    printf 'echo $rc > %q\n' "$BG/rc"
  } > "$BG/driver.sh"
  setsid nohup bash "$BG/driver.sh" > "$BG/driver.log" 2>&1 < /dev/null &
  for _ in $(seq 300); do [ -f "$BG/pid" ] && break; sleep 0.1; done
  [ -f "$BG/pid" ] || { echo "gpu_bg: the driver did not start within 30 s (see $BG/driver.log)"; exit 1; }
  echo "gpu_bg: started pid $(cat "$BG/pid"), log $BG/driver.log"
  exit 0
fi
if [ "$cmd" = wait ]; then
  [ -f "$BG/driver.log" ] || { echo "gpu_bg: no job started in $BG"; exit 3; }
  limit=${1:-560}; t0=$(date +%s); shown=0
  show() {  # the log's new lines, without vLLM's own
    local n; n=$(wc -l < "$BG/driver.log")
    [ "$n" -gt "$shown" ] && sed -n "$((shown + 1)),${n}p" "$BG/driver.log" | grep -v "^(EngineCore\|^(Worker\|^INFO\|^(APIServer"
    shown=$n
  }
  gone=0
  while [ ! -f "$BG/rc" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
    show
    # a driver killed from outside writes no status: say so at once rather than wait out the limit
    if [ -f "$BG/pid" ] && ! kill -0 "$(cat "$BG/pid")" 2>/dev/null && [ ! -f "$BG/rc" ]; then gone=1; break; fi
    sleep 3
  done
  show
  mkdir -p "$OUT"
  # A device call brings back at most 8 files (two folders down): everything the job wrote, torch traces
  # aside, travels as one archive (bg_out.tgz), and up to 6 of its top-level files beside it for reading.
  if [ -z "${COPY:-}" ]; then
    tar -czf "$OUT/bg_out.tgz" -C "$BG/out" --exclude='*.pt.trace.json.gz' . 2>/dev/null
    find "$BG/out" -maxdepth 1 -type f ! -name '*.pt.trace.json.gz' -printf '%T@ %p\n' | sort -rn | head -6 \
      | cut -d' ' -f2- | while read -r f; do cp "$f" "$OUT/"; done
  else for f in $COPY; do [ -e "$BG/out/$f" ] && cp -r "$BG/out/$f" "$OUT/"; done; fi
  cp "$BG/driver.log" "$OUT/${LOG_NAME:-gpu_bg.log}"
  if [ -f "$BG/rc" ]; then exit "$(cat "$BG/rc")"; fi
  if [ $gone = 1 ]; then echo "gpu_bg: the driver (pid $(cat "$BG/pid")) is gone and left no status: it was killed"; exit 4; fi
  echo "gpu_bg: still running after ${limit} s of this call (call wait again)"; exit 75
fi
if [ "$cmd" = stop ]; then  # end the job and everything it started (its own process session), then say so
  [ -f "$BG/pid" ] || { echo "gpu_bg: no job started in $BG"; exit 3; }
  pid=$(cat "$BG/pid")
  kill -TERM -- "-$pid" 2>/dev/null
  for _ in $(seq 100); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL -- "-$pid" 2>/dev/null
  for _ in $(seq 50); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.2; done
  if kill -0 -- "-$pid" 2>/dev/null; then echo "gpu_bg: job $pid still has processes after SIGKILL"; exit 1; fi
  [ -f "$BG/rc" ] || echo 143 > "$BG/rc"
  echo "gpu_bg: stopped job $pid (status $(cat "$BG/rc"))"; exit 0
fi
echo "usage: bash scripts/gpu_bg.sh start 'COMMAND LINE' | wait SECONDS | stop"; exit 2
