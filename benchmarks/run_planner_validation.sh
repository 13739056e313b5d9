#!/usr/bin/env bash
# Measure the planner's validation runs (issue 18): SmolLM2-135M on this 2-core machine, each
# a `pipeserve bench throughput` JSON. Five calibration runs go to benchmarks/results/calibration/
# (measured with today's engine: a 4-request run, whose steps are mostly per-step serial work,
# PP = 2 and 3 at a few dozen requests, kept-quantized weights), the held-out runs to
# benchmarks/results/heldout/ ($CAL_DIR / $OUT_DIR override them). Then:
#   python -m pipeserve.plan.validate --heldout
# About 7 minutes on an IDLE 2-core machine (the planner's own estimate: ~3.3 min of timed
# runs + ~15-20 s of start-up for each of the 13). Figures from a loaded machine validate nothing: check
# `uptime` first (load average well below 1).
# Usage: benchmarks/run_planner_validation.sh [NAME ...]   (no name: every run)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CAL_DIR=${CAL_DIR:-benchmarks/results/calibration}
OUT_DIR=${OUT_DIR:-benchmarks/results/heldout}
mkdir -p "$CAL_DIR" "$OUT_DIR"

# set | name | engine and workload flags (bfloat16 weights unless --quantization auto: the
# built-in GGUF's Q4_1 blocks kept)
RUNS=(
  "cal|cal_pp2_n4_128x128|-pp 2 --num-prompts 4 --input-len 128 --output-len 128"
  "cal|cal_pp2_n48_mix|-pp 2 --num-prompts 48 --input-len 256 --output-len 96 --range-ratio 0.5"
  "cal|cal_pp3_n32_mix|-pp 3 --num-prompts 32 --input-len 192 --output-len 96 --range-ratio 0.5"
  "cal|cal_pp1_q41_n48_mix|-pp 1 --quantization auto --num-prompts 48 --input-len 192 --output-len 96 --range-ratio 0.5"
  "val|pp1_t1_n32_mix|-pp 1 --threads-per-stage 1 --num-prompts 32 --input-len 128 --output-len 64 --range-ratio 0.5"
  "val|pp1_n32_mix|-pp 1 --num-prompts 32 --input-len 256 --output-len 128 --range-ratio 0.5"
  "val|pp2_n48_ref|-pp 2 --num-prompts 48 --input-len 320 --output-len 160 --range-ratio 0.6"
  "val|pp2_n256_short|-pp 2 --num-prompts 256 --input-len 64 --output-len 24 --range-ratio 0.5"
  "val|pp2_t2_n48_mix|-pp 2 --threads-per-stage 2 --num-prompts 48 --input-len 192 --output-len 96 --range-ratio 0.3"
  "val|pp2_gpipe_n48|-pp 2 --pp-schedule gpipe --num-prompts 48 --input-len 128 --output-len 64"
  "val|pp3_n48_mix|-pp 3 --num-prompts 48 --input-len 256 --output-len 96 --range-ratio 0.5"
  "val|tp2_n48_128x64|-tp 2 --num-prompts 48 --input-len 128 --output-len 64 --range-ratio 0.5"
  "val|pp2_q41_n48_mix|-pp 2 --quantization auto --num-prompts 48 --input-len 192 --output-len 96 --range-ratio 0.5"
)

want=" $* "
begin=$(date +%s)
for entry in "${RUNS[@]}"; do
  set_name=${entry%%|*}
  rest=${entry#*|}
  name=${rest%%|*}
  flags=${rest#*|}
  [[ $# -gt 0 && "$want" != *" $name "* ]] && continue
  dir=$OUT_DIR
  [[ $set_name == cal ]] && dir=$CAL_DIR
  case "$flags" in *--quantization*) quant=() ;; *) quant=(--quantization none) ;; esac
  start=$(date +%s)
  # shellcheck disable=SC2086
  python -m pipeserve bench throughput --dtype bfloat16 "${quant[@]}" --dataset random --seed 0 \
      $flags --label "$name" --no-progress --output "$dir/$name.json" > "$dir/$name.log" 2>&1 \
    || { echo "$name FAILED (see $dir/$name.log)"; exit 1; }
  echo "$name: $(( $(date +%s) - start )) s (load average $(cut -d' ' -f1 /proc/loadavg))"
done
echo "total: $(( $(date +%s) - begin )) s; next: python -m pipeserve.plan.validate --heldout"
