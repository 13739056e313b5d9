#!/usr/bin/env bash
# The planner's held-out validation (issue 18), end to end on this machine: SmolLM2-135M, each
# run a `pipeserve bench throughput` JSON.
#   1. `pipeserve plan --calibrate` (the microbenchmarks) -> $HARDWARE;
#   2. seven calibration runs -> benchmarks/results/calibration/ (a 4-request run, whose steps
#      are mostly per-step serial work, PP = 1 at 1 thread (one process: nothing shares its
#      memory bandwidth) and PP = 2 and 3 at a few dozen requests, kept-quantized
#      weights at PP = 1 with 2 threads and at PP = 2 with 1 thread per stage, which tells
#      their kernels' threading from their cost, and 2 stages x 2 threads, which tells how
#      threads beyond the cores wait at their kernels' barriers), ten held-out runs ->
#      benchmarks/results/heldout/ ($CAL_DIR / $OUT_DIR);
#   3. `python -m pipeserve.plan.validate --heldout`: fit on the calibration runs, predict the
#      held-out ones, write benchmarks/results/cpu-local-fitted.yaml, the tables in
#      benchmarks/results/heldout/VALIDATION.md and in docs/PLANNER.md.
# Each run is measured REPEATS times (default 3), round-robin, and validated at its median:
# on a shared VM one run of a command can be far from the next. About 15 minutes a round on an
# IDLE 2-core AVX2 machine in float32 (16 runs with their start-up), plus calibration and ~2
# min of fitting. Figures from a loaded machine
# validate nothing: check `uptime` first (load average well below 1).
# Activations in $DTYPE (default: what --dtype auto picks on this CPU: bfloat16 where the CPU
# multiplies it natively, else float32), for the microbenchmarks and every run alike.
# Usage: benchmarks/run_planner_validation.sh [NAME ...]   (names: measure only those runs,
# no calibration, no fit)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CAL_DIR=${CAL_DIR:-benchmarks/results/calibration}
OUT_DIR=${OUT_DIR:-benchmarks/results/heldout}
HARDWARE=${HARDWARE:-benchmarks/results/cpu-local.yaml}
DTYPE=${DTYPE:-$(python -c 'from pipeserve.config import auto_dtype; print(auto_dtype("cpu"))')}
REPEATS=${REPEATS:-3}
mkdir -p "$CAL_DIR" "$OUT_DIR"
echo "load average $(cut -d' ' -f1-3 /proc/loadavg); dtype $DTYPE"

if [[ $# -eq 0 ]]; then
  start=$(date +%s)
  python -m pipeserve.plan --calibrate --dtype "$DTYPE" --output "$HARDWARE" > "$OUT_DIR/calibrate.log" 2>&1 \
    || { echo "calibration FAILED (see $OUT_DIR/calibrate.log)"; exit 1; }
  echo "calibrate -> $HARDWARE: $(( $(date +%s) - start )) s"
fi

# set | name | engine and workload flags (dense $DTYPE weights unless --quantization auto: the
# built-in GGUF's Q4_1 blocks kept)
RUNS=(
  "cal|cal_pp2_n4_128x128|-pp 2 --num-prompts 4 --input-len 128 --output-len 128"
  "cal|cal_pp2_n48_mix|-pp 2 --num-prompts 48 --input-len 256 --output-len 96 --range-ratio 0.5"
  "cal|cal_pp3_n32_mix|-pp 3 --num-prompts 32 --input-len 192 --output-len 96 --range-ratio 0.5"
  "cal|cal_pp1_q41_n48_mix|-pp 1 --quantization auto --num-prompts 48 --input-len 192 --output-len 96 --range-ratio 0.5"
  "cal|cal_pp2_q41_n24_256x128|-pp 2 --quantization auto --num-prompts 24 --input-len 256 --output-len 128 --range-ratio 0.5"
  "cal|cal_pp1_t1_n24_192x96|-pp 1 --threads-per-stage 1 --num-prompts 24 --input-len 192 --output-len 96 --range-ratio 0.5"
  "cal|cal_pp2_t2_n24_128x128|-pp 2 --threads-per-stage 2 --num-prompts 24 --input-len 128 --output-len 128 --range-ratio 0.5"
  "val|pp1_t1_n32_mix|-pp 1 --threads-per-stage 1 --num-prompts 32 --input-len 128 --output-len 64 --range-ratio 0.5"
  "val|pp1_n32_mix|-pp 1 --num-prompts 32 --input-len 256 --output-len 128 --range-ratio 0.5"
  "val|pp2_n48_ref|-pp 2 --num-prompts 48 --input-len 320 --output-len 160 --range-ratio 0.6"
  "val|pp2_n256_short|-pp 2 --num-prompts 256 --input-len 64 --output-len 24 --range-ratio 0.5"
  "val|pp2_t2_n48_mix|-pp 2 --threads-per-stage 2 --num-prompts 48 --input-len 192 --output-len 96 --range-ratio 0.3"
  "val|pp2_t2_n64_256x64|-pp 2 --threads-per-stage 2 --num-prompts 64 --input-len 256 --output-len 64 --range-ratio 0.5"
  "val|pp2_gpipe_n48|-pp 2 --pp-schedule gpipe --num-prompts 48 --input-len 128 --output-len 64"
  "val|pp3_n48_mix|-pp 3 --num-prompts 48 --input-len 256 --output-len 96 --range-ratio 0.5"
  "val|tp2_n48_128x64|-tp 2 --num-prompts 48 --input-len 128 --output-len 64 --range-ratio 0.5"
  "val|pp2_q41_n48_mix|-pp 2 --quantization auto --num-prompts 48 --input-len 192 --output-len 96 --range-ratio 0.5"
)

want=" $* "
begin=$(date +%s)
# REPEATS rounds, round-robin, so that a slow spell of the host falls on different runs in
# each round; round r > 1 writes NAME.rR.json, and validate measures each run at its median.
for round in $(seq 1 "$REPEATS"); do
  suffix=""
  [[ $round -gt 1 ]] && suffix=".r$round"
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
    python -m pipeserve bench throughput --dtype "$DTYPE" "${quant[@]}" --dataset random --seed 0 \
        $flags --label "$name" --no-progress --output "$dir/$name$suffix.json" > "$dir/$name$suffix.log" 2>&1 \
      || { echo "$name$suffix FAILED (see $dir/$name$suffix.log)"; exit 1; }
    echo "$name$suffix: $(( $(date +%s) - start )) s (load average $(cut -d' ' -f1 /proc/loadavg))"
  done
done
echo "runs: $(( $(date +%s) - begin )) s"
[[ $# -gt 0 ]] && exit 0
python -m pipeserve.plan.validate --heldout --hardware "$HARDWARE" --calibration-runs "$CAL_DIR" \
    --heldout-runs "$OUT_DIR" --update-doc docs/PLANNER.md
