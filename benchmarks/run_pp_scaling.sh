#!/usr/bin/env bash
# Issue 12's pipeline-scaling rows: PP=2 (1 thread per stage) over PP=1 (1 thread) on three
# workload mixes and on one request alone, each pair run side by side (the CPU is shared,
# so compare ratios, not absolute speeds). Dense float32 (--quantization none) keeps the
# figures independent of the quantized kernels. Extra arguments go to every run
# (e.g. --pp-partition uniform to compare against the default partition).
#   NUM=<requests> scales the three mixes (default: 256, the reference workload's count; with 64
#   a PP = 2 micro-batch holds 32 decodes, where the stages' 8-bit GEMMs ran 26-29 % slower than
#   PP = 1's on all 64 at once: benchmarks/README.md, thirty-third session); ROUNDS=<n> repeats
#   each pair.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-benchmarks/results/pp_scaling}
NUM=${NUM:-256}
ROUNDS=${ROUNDS:-1}
mkdir -p "$RESULTS"
COMMON=(--model smollm2-135m-instruct --quantization none --dataset random --seed 0
        --threads-per-stage 1 --no-progress --num-warmup 2 --rendezvous-timeout 600)
declare -A MIX=(
  # input 128-512, output 64-256: the reference mix
  [reference]="--num-prompts $NUM --input-len 320 --output-len 160 --range-ratio 0.6"
  # long prompts, short answers (input 128-512, output 6-26)
  [prefill-heavy]="--num-prompts $((NUM * 2)) --input-len 320 --output-len 16 --range-ratio 0.6"
  # short prompts, long answers (input 26-102, output 103-410)
  [decode-heavy]="--num-prompts $NUM --input-len 64 --output-len 256 --range-ratio 0.6"
  # one request alone: prompt 128, 192 tokens (time per token)
  [single]="--num-prompts 1 --input-len 128 --output-len 192 --range-ratio 0"
)
for round in $(seq 1 "$ROUNDS"); do
  for mix in reference prefill-heavy decode-heavy single; do
    for pp in 1 2; do
      # shellcheck disable=SC2086
      python -m pipeserve bench throughput "${COMMON[@]}" ${MIX[$mix]} -pp $pp "$@" \
        --label "$mix PP=$pp" --output "$RESULTS/${mix}_pp${pp}_r${round}.json" > "$RESULTS/${mix}_pp${pp}_r${round}.log" 2>&1
    done
    python benchmarks/pp_scaling_table.py "$RESULTS" "$mix" "$round"
  done
done
