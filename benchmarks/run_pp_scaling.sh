#!/usr/bin/env bash
# Issue 3's pipeline benchmark: 256 requests, prompt 128, 128 new tokens, ignore_eos,
# bfloat16, one thread per stage: PP=1 vs PP=2 (uniform and auto partition).
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=benchmarks/results
mkdir -p "$RESULTS/plots"
W=(--model smollm2-135m-instruct --dtype bfloat16 --dataset random --num-prompts 256 --input-len 128
   --output-len 128 --range-ratio 0 --seed 0 --threads-per-stage 1 --no-progress)
pipeserve bench throughput "${W[@]}" -pp 1 --label "PP=1, 1 thread" --output $RESULTS/scaling_pp1.json
pipeserve bench throughput "${W[@]}" -pp 2 --pp-partition uniform --label "PP=2, 1 thread/stage, uniform" \
  --output $RESULTS/scaling_pp2_uniform.json --plot $RESULTS/plots/scaling_pp2_uniform
pipeserve bench throughput "${W[@]}" -pp 2 --pp-partition auto --label "PP=2, 1 thread/stage, auto" \
  --output $RESULTS/scaling_pp2_auto.json --plot $RESULTS/plots/scaling_pp2_auto
pipeserve bench throughput "${W[@]}" -pp 2 --pp-partition 17,13 --label "PP=2, 1 thread/stage, manual 17,13" \
  --output $RESULTS/scaling_pp2_manual.json --plot $RESULTS/plots/scaling_pp2_manual
