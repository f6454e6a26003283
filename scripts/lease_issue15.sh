#!/usr/bin/env bash
# The next GPU lease for issue 15, as one script (scripts/gpu_bg.sh start 'bash scripts/lease_issue15.sh'; see
# benchmarks/RESULTS.md for the call chain that brings vLLM and the serve wheels). LEASE_STEPS picks and orders
# the steps; each writes under $OUT before the next starts, so a lease cut short still answers the first. The
# default (small) is what is most open after the leases of 2026-12-06 (RESULTS.md): the 8B shape met the prefill
# goal at every size (0.99, every round >= 0.98); the small model did not at 1-16 in flight (0.88-0.95 on two
# hosts), where capture's requests reach the engine core's queue later at 4 in flight (2-15 ms from add_request
# against plain's 0.8-14 ms) and the driver is later to the engine's outputs (`late` 0.5-0.9 ms against 0.15-0.27).
# Two ways of taking records in the Tap (records_early, and one record at a time while requests run) changed
# nothing measurable. (pinned: the H100 hosts seen so far have one NUMA node, so it shows nothing there.)
# Ninth session (2026-12-06): the record process cut the record path on the engine thread from ~557 to ~263 us a
# request; steps with no forward skip the connector round (quiet_empty_steps; variant capture-loud turns it off);
# small model 0.97 / 0.99 at 1 / 4 in flight (four rounds, one at 0.90). Next lease: the small model at 16-256 in
# flight with this code, and more rounds at 1-4: LEASE_STEPS=small SMALL_VARIANTS=plain,plain-spawn,floor,capture
# SMALL_BATCH_SIZES=1,4,16,64,256 (plain-spawn: the A/A control that says how far a round moves on its own).
# Tenth session (2026-12-06, a faster, quiet H100 host; A/A 0.96-1.06): capture 0.94 / 0.85 / 0.96 / 0.97 / 0.97 at
# 1 / 4 / 16 / 64 / 256 in flight, floor 0.98 / 0.94 / 0.99 / 0.99 / 0.99. At 4 in flight capture's requests spend
# 2.7 ms longer in the engine core (`run` 16.7 against the floor's 14.2 ms; 2 finished per output against 3 for
# plain), and the driver picks up outputs 0.25 ms later. The Tap then checked every input before the first
# admission (13 ms a 256-prompt call, fixed since). Earlier leases already split the 4-in-flight gap: capture-raw
# (no Tap) was as short as capture, floor-gather (rows gathered, then dropped) as good as the floor, so it sits in
# the engine's record path after the gather. Next lease: LEASE_STEPS=small SMALL_VARIANTS=plain,floor,capture
# SMALL_BATCH_SIZES=1,4,16,64,256 SMALL_SKIP_PROFILE= PROFILE_INFLIGHT=4 (a torch-profiler trace of each engine at
# 4 in flight after the rounds: is the engine's step longer on the GPU, or does the GPU wait for its thread?), and
# a variant that runs the record process without its host copies (to build: it isolates the copies' effect).
# Eleventh session (2026-12-06, H200, one round only: capture-after's pool was too small at 16 in flight, fixed): at
# 4 in flight every Tap-driven engine's outputs waited 0.7-0.9 ms in the driver (`late`) against 0.18-0.24 for
# plain, the floor and capture-after (the capture engine driven without the Tap's loop): the Tap's driving holds
# the engine's next output. Its second lease (H100, noisy, 4 in flight only): handing records out while the
# engine computes (capture-wait, removed since) cut `late` only from 0.82 to 0.68 ms (plain 0.19), so most of it is
# the Tap loop's other work between step calls. Next lease: first LEASE_STEPS=stepprof STEPPROF_INFLIGHT=4
# STEPPROF_VARIANTS=plain-spawn,capture-raw,capture (the driver's functions, per request); then LEASE_STEPS=small
# SMALL_BATCH_SIZES=1,4 SMALL_VARIANTS=plain,plain-spawn,floor,capture,capture-prebuild,capture-chunked,capture-after
# (SMALL_ARGS="--prompts 128" where device time is short): capture-after is the bound; capture-prebuild (requests
# built ahead); capture-chunked (record copies in 1 MiB pieces).
# Twelfth session (2026-12-07): no machine (13 starts refused, 7 calls not tried, 02:25-04:05 UTC). A re-read of the fifth session's
# traces at 4 in flight (benchmarks/results/2026-12-06-s42-h100/profile) shows plain vLLM's GPU busy only 45% of the
# time there, its engine-core thread busy ~85%: at 1-4 in flight the small model is host-bound, so every microsecond
# capture adds on the engine thread or in the driver's way costs throughput nearly one for one. New measuring aids:
# --stats now splits `late` by what the driving thread was doing when each output arrived ("late by" lines);
# trace summaries count steps by how full they were (step_sizes); d2h_bandwidth measures a small copy and a matmul
# beside another process's record copies, whole and in 1 MiB pieces. Next lease (each is cheap; in this order):
#   PRE='MODELS=small bash scripts/gpu_check.sh models && timeout 150 python3 benchmarks/d2h_bandwidth.py --mb 16
#     --copies 16 > $OUT/d2h.txt 2>&1'   (does the record process's copy hold the engine's own small copies?)
#   TRACE_MAX_BYTES=4000000 SMALL_VARIANTS=plain,floor,capture,capture-chunked,capture-prebuild,capture-after,
#     plain-sync,capture-sync SMALL_BATCH_SIZES=1,4 SMALL_REPEATS=4 SMALL_ARGS="--prompts 128" SMALL_SKIP_PROFILE=
#     PROFILE_INFLIGHT=4 LEASE_STEPS=small   (~10 min on a fast host; trace summaries at 4 in flight). The -sync pair
#     asks whether vLLM's one-step-ahead scheduling sets capture into alternating half batches (step_sizes).
# Thirteenth session (2026-12-07): the Tap now keeps successors waiting in the engine (Tap(max_inflight=N) starts the
# engine at max_num_seqs N and admits up to 2N: Tap.lookahead), so the driver's round trip is off the engine's path.
# Step `queue` measures that regime (capture_overhead.py --queue: in flight = max_num_seqs). One short H100 lease
# (plain, capture at 4, three rounds): records complete; capture's `late` 0.04 ms (driver-bounded: 0.3-0.9); ratio
# 1.19 with rounds 0.77-1.32, moved by each engine's own pace. Next lease (~8-10 min), in this order:
#   LEASE_STEPS="queue small" QUEUE_VARIANTS=plain,plain-ahead,capture QUEUE_BATCH_SIZES=1,4,16 QUEUE_REPEATS=6
#     SMALL_VARIANTS=plain,capture SMALL_BATCH_SIZES=1,4 SMALL_REPEATS=4 SMALL_ARGS="--prompts 128"
#   (plain-ahead: plain with the Tap's depth, 2 x the target in the engine; `small`: the driver-bounded regime on the
#   same host, for the two side by side). Only the PRE models step is needed (d2h is optional).
# Fourteenth session (2026-12-07, H100): queued engines (max_num_seqs = the target, the rest of the call waiting in
# them) ran slower than driver-fed ones of 4 seats, plain vLLM's included (plain 66k / 135k against 84k / 161k tok/s
# at 1 / 4 in flight; two steps of one lease, not one paired run). So Tap(max_inflight=N) keeps vLLM's max_num_seqs
# again. Next lease, FIRST, the two regimes in one paired run (~12 min; keep 15 min of device time for it):
#   LEASE_STEPS=queue QUEUE_VARIANTS=plain,plain-wide,capture,capture-wide QUEUE_BATCH_SIZES=1,4,16 QUEUE_REPEATS=4
#     QUEUE_ARGS="--prompts 128 --wide-seqs 64"
#   (plain / plain-wide: does a queued engine of target seats run slower than a wide one fed the target?
#   capture-wide / plain-wide: the ratio users of Tap(max_inflight=N) now get). To change a running job use
#   `bash scripts/gpu_bg.sh stop`, never `pkill -f` in a device call (it matched the call itself, 2026-12-07).
# Fifteenth session (2026-12-07, H100, driver-fed as the issue's benchmark, six rounds; RESULTS.md): capture 0.98 /
# 0.90 / 0.96 at 1 / 4 / 16 in flight. At 4 the floor (no rows read) already costs 0.05 and the record path 0.05
# (gather 0.02 at most, hand-over + record process 0.01, host copies 0.02); capture-after = capture, so not the
# driver. Copies in 1 MiB pieces do not let the engine's small copy pass (d2h.txt: 264 against 234 us): dropped.
# Next lease: the floor's own cost at 4 in flight, function by function: LEASE_STEPS=stepprof STEPPROF_INFLIGHT=4
# STEPPROF_VARIANTS=plain-spawn,floor,capture; then cutting what it names on the engine thread.
# Sixteenth session (2026-12-07, two H100 hosts; RESULTS.md): the head cut holds on the GPU (0.49-0.61 ms a call at
# every size). A slow host (plain 52.7k tok/s at 1 in flight) gave capture 0.95 / 0.94 / 0.95 / 0.95 / 0.96 at 1-256;
# a fast one 0.98 at 64 (floor 0.99), where the trace shows +1.3% kernel time (gather, the capture layer's cache
# write) and the record path's host work inside the step thread's slack. Step profile at 4 in flight: the floor's
# ~0.5 ms a request is spread over the capture layer in the forward, vLLM's connector calls in the scheduler and
# add_requests (no one function > ~0.5% of a step); capture's extra step time is mostly not in record functions
# (forward, add_requests, prepare_inputs 7-15% longer; 1.09 steps a request against 0.93). Next lease, on a host
# whose plain runs >= 100k tok/s at 1 in flight (check env.txt and the first round before spending more):
#   PRE='MODELS=small bash scripts/gpu_check.sh models && timeout 240 python3 benchmarks/record_path_cost.py
#     --records 2,8 --busy-ms 0,5 --iters 150 --json $OUT/record_path_cost.json > $OUT/record_path_cost.txt 2>&1'
#     (no vLLM needed: runs while the bundle installs. The record process path's step-thread cost split into
#     staging / index / gather / copies / send: the step profile put _gather_group_offload at ~0.53 ms a step
#     with only ~0.27 of it in the index upload, the IPC event and the hand-over; where does the rest go?)
#   LEASE_STEPS=small SMALL_VARIANTS=plain,plain-spawn,capture SMALL_BATCH_SIZES=1,4,16 SMALL_REPEATS=8
#     SMALL_ARGS="--prompts 128"   (eight rounds with the A/A control: how much of the 1-16 gap is the host)
# Seventeenth session (2026-12-07 evening): no machine (eight starts refused from 19:40, then loans paused at 20:32;
# 886 s of the budget spent on refusals). Built instead, for the hand-over's unexplained ~0.24 ms a step (torch calls
# that only queue the gather: index upload, ring slice and view, index_select(out=)): connector option
# offload_gather="batch" queues the gather as ONE cudaMemcpyBatchAsync of the records' cache blocks into the ring
# (gpu_gather.BatchCopies / block_copies; on a side stream fenced by raw events, the forward stream waiting on the
# IPC event behind it), no torch call; off by default until the GPU says. Next lease, in this order:
#   PRE='MODELS=small bash scripts/gpu_check.sh models && LEASE_STEPS=gathercost bash scripts/lease_issue15.sh' (gathercost: removed since)
#     (no vLLM: gather_launch_cost.py, the three ways of queuing a step's gather, host us each, checked against
#     the view; record_path_cost.py batch against torch, per phase, interleaved; handover_cost.py, the hand-over's
#     pickle against the whole send: on the 2-core CPU machine the pickle is 0.44-0.86 of it, ~25 us a 1k-id record)
#   LEASE_STEPS="leantests batchsmall" SMALL_BATCH_SIZES=1,4,16 SMALL_REPEATS=5 SMALL_ARGS="--prompts 128"
#     (the CUDA record path's tests, the batched gather among them; then plain, capture, capture-batch at 1-16 in
#     flight, capture-batch dropped if a test failed). If batch wins on the step thread and the rounds, make it the
#     default (tests/gpu/test_lean_path.py already runs every test with it).
# Eighteenth session (2026-12-07 late, one slow H100 host: plain 53-56k tok/s at 1 in flight; RESULTS.md): the batched
# gather LOST and is removed: cudaMemcpyBatchAsync (CUDA 13.0 runtime) costs the host ~5-7 us a copy, so a step's
# 64-512 block copies took 449-2,702 us against torch's 146-236 us (index upload + index_select), and the whole
# record path 2-5x its torch time (record_path_cost pair). The CUDA record path's tests passed with it (33), so it
# was slow, not wrong. Rounds at 1 / 4 / 16 in flight: capture 0.91 / 0.88 / 0.95, capture-batch 0.94 / 0.89 / 0.84;
# a second run with the A/A control: plain-spawn 1.07 / 1.05, capture 0.98 / 0.87 (four rounds each). The hand-over
# on that host: pickling the descriptor is 0.89-0.92 of the send, ~30 us a 1k-id record (238 us for 8 records).
# Next lease: LEASE_STEPS="hostcost small stepprof" (hostcost: record_path_cost and handover_cost, no vLLM, in PRE).
# The step profile's per-call times moved 40% between runs of one variant on that slow host (forward 12.8-18.5 ms a
# call for capture, 13.4-18.7 for plain-spawn) and throughput followed them: compare variants per call, by round.
# Since the seventh session of 2026-12-06 the step profile (stepprof) says where the engine thread's time goes,
# function by function: ~0.35 ms a request for the floor, ~0.73 for capture, on ~10 ms steps (RESULTS.md). Measure
# a change to that thread with LEASE_STEPS="leantests small stepprof": its counters hold across hosts where the
# throughput ratios at 1-4 in flight move with the host.
#   PRE (no vLLM; in the start call): the models, and d2h_bandwidth --mb 32: the registered pool's bandwidth
#      and whether an 8-byte copy on another stream (vLLM's sampled ids) waits behind a 32 MiB record copy
#      (2026-12-05: 54.3 GB/s; yes, 642 us behind one).
#   pinned: small, with the driver and every engine on one NUMA node's CPUs (PIN_CPUS, node:0): whether the
#      A/A control's drift (plain-spawn / plain, 0.89-1.23 unpinned on 2026-12-05) is the CPUs' placement.
#   small: the 2048 x 16 model at 1-256 in flight (SMALL_BATCH_SIZES), six paired rounds (plain, plain-spawn,
#      floor, capture; --stats); 64 and 256 cost little (one piece per round there).
#      Both small steps now print each variant's time outside its requests per call (2026-12-05: capture's
#      Little's-law shortfall was 3-11%, ~8-33 ms a 32-64-prompt call, where the CPU box spends ~1 ms).
#   big: prefill of the 8B shape at 1-256 in flight (BIG_REPEATS, 3), with the A/A control (BIG_VARIANTS).
#   trace8b: the 8B shape at 1 and 4 in flight, plain, plain-spawn (the A/A control), floor and capture, three
#      rounds, then a torch-profiler trace of each engine at 1 in flight (2026-12-05: 1.01, no extra kernel time).
#   serve: serving the 8B shape (SERVE_ROUNDS, 2) and the HF check of 8 served records on the GPU.
#   profile: py-spy over every process of plain, floor and capture at 4 in flight, and the diffs.
#   leantests: tests/gpu/test_lean_path.py, test_device_commit.py, test_streams.py (the CUDA record path, no engine).
#   offtests: leantests, then the compiled engine against HF with the record process (tests/gpu/test_gpu_capture.py).
#   stepprof: benchmarks/step_profile.py, the small model at 1 and 4 in flight: per function, microseconds per
#      request in every engine process and the driver (plain-spawn, floor, capture side by side; ~5 min).
# About 4 (machine, vLLM) + 8 (small) + 10 (big, three 8B engines) + 7 (pinned) min of device time; trace8b takes 7, serve 7. The call chain (a fresh machine; parts from
# ../shared/gpu/build-vllm-bundle.sh .gpubundle, part00 split: split -b 45M -d -a 2 part00 p00_, so each call
# carries under 64 MiB with the ~10 MB tree; py-spy: pip download py-spy into .gpubundle (the manylinux1
# wheel); serve wheels: bash scripts/build-serve-wheels.sh). Keep the calls back to back: a machine idle for
# 30 s is given back, and with it every result not yet copied out (the 2026-12-05 lease lost steps 2-4 so).
#   1 (carry .gpubundle/p00_00, and the py-spy wheel where LEASE_STEPS has profile): mkdir -p $HOME/vllm-bundle && mv .gpubundle/p00_00
#       $HOME/vllm-bundle/ && PRE='bash scripts/gpu_check.sh models && python3 benchmarks/d2h_bandwidth.py --mb 32
#       --copies 16 | tee $OUT/d2h.txt' bash scripts/gpu_bg.sh start
#       'bash scripts/lease_issue15.sh' && bash scripts/gpu_bg.sh wait 5
#   2 (carry .gpubundle/{p00_01,part01,SHA256SUMS,install-on-device.sh}): cd $HOME/vllm-bundle && cat p00_00
#       $OLDPWD/.gpubundle/p00_01 > part00 && rm p00_00 && cd $OLDPWD && mv .gpubundle/part01 .gpubundle/SHA256SUMS
#       $HOME/vllm-bundle/ && bash .gpubundle/install-on-device.sh && bash scripts/gpu_bg.sh wait 480
#   3 (carry .gpubundle/serve): cp -r .gpubundle/serve $HOME/serve-wheels && touch $HOME/serve-wheels/.done &&
#       bash scripts/gpu_bg.sh wait 560;   4..: bash scripts/gpu_bg.sh wait 560
#   Each wait returns everything written so far as bg_out.tgz (plus the newest top-level files).
set -u
T0=$(date +%s); el() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
# LEASE_STEPS (see above): a lease with less device time left runs fewer
steps=${LEASE_STEPS:-small}
big_env() {
  source "$HOME/vllm-site/env.sh"
  export PYTHONPATH=$PWD:$PYTHONPATH LAYERTAP_CACHE=/tmp/layertap-cache VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
}
BIG="--hidden 4096 --num-layers 32 --head-dim 128 --vocab 2048 --prompts 256 --prompt-len 1024 --dtype bfloat16
  --transport shm --slot-mb 33 --no-hf --gpu-build --stats"
trace8b() {  # the 8B shape at 1 and 4 in flight with the A/A control, and a torch-profiler trace of each engine
  # at 1 in flight (2026-12-05, second lease: capture 0.80 there; third: 1.01, no extra kernel time)
  ( big_env
    # plain-spawn: plain with a spawned engine core (capture's are spawned, plain vLLM forks); floor: the capture
    # engine reading no rows. Four 8B engines at 0.2 of the GPU each (12.4 GB of weights), ~85 s to start each.
    timeout ${TRACE_TIMEOUT:-660} python3 benchmarks/capture_overhead.py $BIG --prompts 128 --batch-sizes 1,4 \
      --variants plain,plain-spawn,floor,capture --gpu-mem 0.2 --repeats 3 \
      --profile-dir /tmp/lt-prof8b --profile-inflight 1 --json "$OUT/trace8b.json" > "$OUT/trace8b.log" 2>&1
    grep "round\|^ *[0-9]\|profiled" "$OUT/trace8b.log" | grep -v "^(Engine" | tail -30
    mkdir -p "$OUT/trace8b" && cp /tmp/lt-prof8b/*/*.summary.json "$OUT/trace8b/"
    for t in /tmp/lt-prof8b/{plain,plain-spawn,floor,capture}/*inflight1*.json.gz; do
      [ -f "$t" ] && [ "$(stat -c %s "$t")" -lt 15000000 ] && cp "$t" "$OUT/trace8b/"
    done )
  el "8B trace at 1 in flight"
}
profile() {
for n in 4; do  # 4 in flight: the H100's worst ratio on 2026-12-05 (0.80)
  PROFILE_INFLIGHT=$n PROFILE_VARIANTS="plain floor capture" PROFILE_ARGS="--gpu-build --seconds 12" \
    bash scripts/gpu_check.sh profile
done
for n in 4; do  # where capture's extra time per request goes, by thread and function
  for pair in "plain floor" "plain capture" "floor capture"; do
    set -- $pair
    python3 benchmarks/profile_capture.py --diff "$OUT/profile/${1}_$n.json" "$OUT/profile/${2}_$n.json"
  done
done 2>&1 | tee "$OUT/pyspy_diffs.txt"
el "py-spy profiles"
}
leantests() {  # the CUDA record path's own tests (no engine): gather order, index ring, device commits, streams
( big_env
  timeout ${LEANTESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_lean_path.py \
    tests/gpu/test_device_commit.py tests/gpu/test_streams.py 2>&1 | tail -15 | tee "$OUT/leantests.txt" )
el "lean path tests"
}
offtests() {  # the record process (engine/record_proc.py): the CUDA record path's tests with it and without, then
  # the compiled engine against HF on the GPU with it (prefix caching, chunked prefill, generate mode)
leantests
( big_env
  timeout ${OFFTESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_gpu_capture.py \
    -k "matches_hf and compiled and not extract and not piecewise" 2>&1 | grep -v "^(EngineCore\|^(Worker\|^INFO" \
    | tail -25 | tee "$OUT/offtests.txt" )
el "record process tests"
}
hostcost() {  # no vLLM (runs in PRE while the bundle installs): the record path's step-thread cost per phase
  # (record_path_cost.py) and the hand-over's pickle against the whole send (handover_cost.py)
timeout 300 python3 benchmarks/record_path_cost.py --records 1,2,8 --busy-ms 0,5 --iters 100 \
  --json "$OUT/record_path_cost.json" > "$OUT/record_path_cost.txt" 2>&1
timeout 120 python3 benchmarks/handover_cost.py --records 1,2,8 --steps 300 > "$OUT/handover_cost.txt" 2>&1
tail -n 20 "$OUT/record_path_cost.txt" "$OUT/handover_cost.txt"
el "host cost"
}
stepprof() {  # deterministic per-function time per request in every engine process (benchmarks/step_profile.py):
  # plain-spawn, floor and capture side by side on the small model at 1 and 4 in flight; where the floor's and
  # the record path's time per request goes on the GPU host, function by function
( big_env
  timeout ${STEPPROF_TIMEOUT:-480} python3 benchmarks/step_profile.py --variants ${STEPPROF_VARIANTS:-plain-spawn,floor,capture} \
    --inflight ${STEPPROF_INFLIGHT:-1,4} --repeats ${STEPPROF_REPEATS:-3} --hidden 2048 --num-layers 16 --head-dim 128 \
    --vocab 2048 --prompts ${STEPPROF_PROMPTS:-128} --prompt-len 1024 --dtype bfloat16 --transport shm --slot-mb 17 \
    --no-hf --gpu-build --json "$OUT/step_profile.json" > "$OUT/step_profile.txt" 2>&1 )
head -120 "$OUT/step_profile.txt"
el "step profile"
}
small_bench() {  # the 2048 x 16 model, six paired rounds, into $OUT/$1; $2: more flags. SMALL_SKIP_PROFILE=
# (set, empty): a torch-profiler trace of every engine after the rounds, at PROFILE_INFLIGHT (gpu_check.sh)
SKIP_TRAIN_BENCH=1 SKIP_PROFILE=${SMALL_SKIP_PROFILE-1} BENCH_REPEATS=${SMALL_REPEATS:-6} \
  BENCH_BATCH_SIZES=${SMALL_BATCH_SIZES:-1,4,16,64,256} BENCH_VARIANTS=${SMALL_VARIANTS:-plain,plain-spawn,floor,capture} BENCH_ARGS="--no-hf --gpu-build --chunk 32 --stats $2" \
  bash scripts/gpu_check.sh bench
mkdir -p "$OUT/$1" && mv "$OUT"/capture_overhead.* "$OUT/$1/"
}
pinned() {  # the small model with the driver and every engine on one NUMA node's CPUs (--cpus): does the A/A
  # control (plain-spawn / plain) stop drifting? 2026-12-05 unpinned: 0.89-1.23 across rounds at 1-4 in flight.
  # On a host of one NUMA node node:0 is every CPU (the run's host line says so): set PIN_CPUS to a list then.
SMALL_BATCH_SIZES=${PIN_BATCH_SIZES:-1,4,16} small_bench pinned "--cpus ${PIN_CPUS:-node:0}"
el "small prefill, pinned"
}
queue() {  # the small model with in flight = the engine's max_num_seqs (capture_overhead.py --queue): every prompt of a
  # call submitted at once, as LLM.generate and the Tap (no max_inflight) do, so finished requests are replaced from
  # the engine's own queue, not after a round trip through the driver; engines of their own for each size
SMALL_BATCH_SIZES=${QUEUE_BATCH_SIZES:-1,4,16} SMALL_VARIANTS=${QUEUE_VARIANTS:-plain,floor,capture} \
  SMALL_REPEATS=${QUEUE_REPEATS:-4} SMALL_SKIP_PROFILE=1 small_bench queue "--queue ${QUEUE_ARGS:---prompts 128}"
el "small prefill, engine-bound (--queue)"
}
small() {  # SMALL_ARGS: more flags (e.g. --prompts 128 for a short lease)
small_bench small "${SMALL_ARGS:-}"
el "small prefill"
}
serve() {
for i in $(seq 300); do [ -f "$HOME/serve-wheels/.done" ] && break; sleep 2; done
ln -sfn "$HOME/serve-wheels" .gpubundle/serve
SERVE_ROUNDS=${SERVE_ROUNDS:-2} SERVE_DEADLINE=${SERVE_DEADLINE:-400} SERVE_VARIANTS=plain,capture \
  SERVE_ARGS="--hidden 4096 --num-layers 32 --gpu-build --verify 8" bash scripts/gpu_check.sh serve
el "serve"
}
big() {
( big_env  # in a subshell, as in trace8b: the steps after it keep their own environment
  timeout ${BIG_TIMEOUT:-620} python3 benchmarks/capture_overhead.py $BIG --batch-sizes 1,4,16,64,256 \
    --variants ${BIG_VARIANTS:-plain,plain-spawn,capture} --repeats ${BIG_REPEATS:-3} --json "$OUT/capture_overhead_8b.json" \
    > "$OUT/capture_overhead_8b.log" 2>&1 )
grep "round\|^ *[0-9]" "$OUT/capture_overhead_8b.log" | grep -v "^(Engine" | tail -40
el "8B prefill"
}
for s in $steps; do $s; done
