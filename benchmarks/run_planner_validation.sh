#!/usr/bin/env bash
# Measure the planner's held-out runs (issue 18): SmolLM2-135M on this 2-core machine, every
# run a `pipeserve bench throughput` JSON in benchmarks/results/heldout/ (or $OUT_DIR).
# About 7 minutes on an IDLE 2-core machine; a loaded machine makes the figures useless for
# validation. Then regenerate the table and the error band:
#   python -m pipeserve.plan.validate --heldout
# Usage: benchmarks/run_planner_validation.sh [NAME ...]   (no name: every run)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR=${OUT_DIR:-benchmarks/results/heldout}
mkdir -p "$OUT_DIR"

# name | engine and workload flags (bfloat16 weights unless --quantization auto)
RUNS=(
  "pp1_n32_128x128|-pp 1 --num-prompts 32 --input-len 128 --output-len 128"
  "pp1_t1_n48_mix|-pp 1 --threads-per-stage 1 --num-prompts 48 --input-len 192 --output-len 96 --range-ratio 0.5"
  "pp1_n96_mix|-pp 1 --num-prompts 96 --input-len 256 --output-len 96 --range-ratio 0.5"
  "pp2_n64_ref|-pp 2 --num-prompts 64 --input-len 320 --output-len 160 --range-ratio 0.6"
  "pp2_n256_short|-pp 2 --num-prompts 256 --input-len 64 --output-len 32 --range-ratio 0.5"
  "pp2_t2_n48_mix|-pp 2 --threads-per-stage 2 --num-prompts 48 --input-len 192 --output-len 96 --range-ratio 0.3"
  "pp2_gpipe_n96|-pp 2 --pp-schedule gpipe --num-prompts 96 --input-len 128 --output-len 64"
  "pp3_n64_mix|-pp 3 --num-prompts 64 --input-len 256 --output-len 128 --range-ratio 0.5"
  "tp2_n48_128x64|-tp 2 --num-prompts 48 --input-len 128 --output-len 64 --range-ratio 0.5"
  "pp2_q41_n64_mix|-pp 2 --quantization auto --num-prompts 64 --input-len 192 --output-len 96 --range-ratio 0.5"
)

want=" $* "
for entry in "${RUNS[@]}"; do
  name=${entry%%|*}
  flags=${entry#*|}
  [[ $# -gt 0 && "$want" != *" $name "* ]] && continue
  case "$flags" in *--quantization*) quant=() ;; *) quant=(--quantization none) ;; esac
  start=$(date +%s)
  # shellcheck disable=SC2086
  python -m pipeserve bench throughput --dtype bfloat16 "${quant[@]}" --dataset random --seed 0 \
      $flags --label "$name" --no-progress --output "$OUT_DIR/$name.json" > "$OUT_DIR/$name.log" 2>&1 \
    || { echo "$name FAILED (see $OUT_DIR/$name.log)"; exit 1; }
  echo "$name: $(( $(date +%s) - start )) s"
done
