#!/usr/bin/env bash
# What the lost lease had left: the HF check of records served by the 8B shape (one round, concurrency 1).
set -u
for i in $(seq 200); do [ -f "$HOME/serve-wheels/.done" ] && break; sleep 2; done
ln -sfn "$HOME/serve-wheels" .gpubundle/serve
SERVE_ROUNDS=1 SERVE_CONCURRENCY=1 SERVE_VARIANTS=plain,capture \
  SERVE_ARGS="--hidden 4096 --num-layers 32 --gpu-build --verify 8" bash scripts/gpu_check.sh serve
