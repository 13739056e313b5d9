#!/usr/bin/env bash
# Every measured row of benchmarks/README.md: one command each, writing its JSON
# (and plots) into benchmarks/results/, then the table is re-rendered.
#
#   bash benchmarks/run_all.sh              # everything (hours on 2 cores)
#   ONLY="pp1 pp2" bash benchmarks/run_all.sh   # just some rows, by name
#   SKIP_SERVE=1 bash benchmarks/run_all.sh     # offline rows only
#   DRY_RUN=1 bash benchmarks/run_all.sh        # print the commands, run nothing
#
# The reference workload (issue 5): 256 random requests, input 128-512,
# output 64-256 tokens, seed 0, SmolLM2-135M-Instruct in bfloat16.
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v pipeserve >/dev/null 2>&1; then PIPESERVE=(pipeserve); else PIPESERVE=(python -m pipeserve.entrypoints.cli); fi
RESULTS=benchmarks/results
mkdir -p "$RESULTS/plots"
MODEL=(--model smollm2-135m-instruct --dtype bfloat16)
RANDOM_256=(--dataset random --num-prompts 256 --input-len 320 --output-len 160 --range-ratio 0.6 --seed 0)
# 32 conversations x 4 turns over 4 shared 1024-token prefixes; each turn resends the history.
# 2 GiB of KV cache holds a whole turn's history, so the on/off rows differ by caching, not eviction.
PREFIX=(--dataset prefix --num-prompts 128 --prefix-len 1024 --num-prefixes 4 --num-turns 4
        --question-len 64 --output-len 32 --seed 0 --kv-cache-memory 2GiB)

# run CMD...: print it, then run it unless DRY_RUN is set.
run() { echo "+ $*"; [[ -n "${DRY_RUN:-}" ]] || "$@"; }

wanted() { [[ -z "${ONLY:-}" ]] || [[ " $ONLY " == *" $1 "* ]]; }

# row NAME LABEL ARGS...: one `bench throughput` run -> $RESULTS/NAME.json, plots in $RESULTS/plots/NAME/
row() {
  local name=$1 label=$2; shift 2
  wanted "$name" || return 0
  echo "== $name: $label"
  run "${PIPESERVE[@]}" bench throughput "${MODEL[@]}" "$@" --label "$label" \
    --output "$RESULTS/$name.json" --plot "$RESULTS/plots/$name"
}

# Pipeline depth (async schedule, uniform partition)
row pp1 "PP=1" "${RANDOM_256[@]}" -pp 1
row pp2 "PP=2, async, uniform" "${RANDOM_256[@]}" -pp 2 --pp-schedule async --pp-partition uniform
row pp3 "PP=3, async, uniform" "${RANDOM_256[@]}" -pp 3 --pp-schedule async --pp-partition uniform
# The three schedules at PP=2
row pp2_gpipe "PP=2, gpipe, uniform" "${RANDOM_256[@]}" -pp 2 --pp-schedule gpipe --pp-partition uniform
row pp2_interleaved "PP=2, interleaved (V=2), uniform" "${RANDOM_256[@]}" -pp 2 --pp-schedule interleaved \
  --pp-virtual-stages 2 --pp-partition uniform
# Uniform vs auto partition
row pp2_auto "PP=2, async, auto partition" "${RANDOM_256[@]}" -pp 2 --pp-schedule async --pp-partition auto
row pp3_auto "PP=3, async, auto partition" "${RANDOM_256[@]}" -pp 3 --pp-schedule async --pp-partition auto
# Prefix caching on the multi-turn prefix workload
row prefix_cache_on "prefix workload, prefix caching on" "${PREFIX[@]}" -pp 1 --enable-prefix-caching
row prefix_cache_off "prefix workload, prefix caching off" "${PREFIX[@]}" -pp 1 --no-enable-prefix-caching

# The transformers baseline in the same run as pipeserve's best configuration so far.
if wanted vs_transformers; then
  if [[ -n "${DRY_RUN:-}" ]]; then BEST=("<pipeline flags of the fastest random-workload row>")
  else read -r -a BEST <<< "$(python -m pipeserve.bench.report "$RESULTS" --best-engine-flags)"; fi
  row vs_transformers "best pipeserve configuration vs transformers" "${RANDOM_256[@]}" "${BEST[@]}" \
    --backend both --hf-batch-size 64,128
fi

# Online: a rate sweep against a pipeserve server (PP=2), TTFT/TPOT SLO.
if [[ -z "${SKIP_SERVE:-}" ]] && wanted serve_pp2 && [[ -n "${DRY_RUN:-}" ]]; then
  echo "+ ${PIPESERVE[*]} serve ${MODEL[*]} -pp 2 --port 8765 &   (then bench serve --sweep-rates ... against it)"
elif [[ -z "${SKIP_SERVE:-}" ]] && wanted serve_pp2; then
  PORT=${PORT:-8765}
  "${PIPESERVE[@]}" serve "${MODEL[@]}" -pp 2 --port "$PORT" &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break; sleep 1; done
  echo "== serve_pp2: online sweep"
  "${PIPESERVE[@]}" bench serve --base-url "http://127.0.0.1:$PORT" --model smollm2-135m-instruct \
    --dataset random --num-prompts 64 --input-len 320 --output-len 160 --range-ratio 0.6 --seed 0 \
    --prompt-format ids --sweep-rates 0.25,0.5,1,2,inf --slo ttft=5000,tpot=200 \
    --label "pipeserve serve PP=2, rate sweep" \
    --output "$RESULTS/serve_pp2.json" --plot "$RESULTS/plots/serve_pp2"
  kill "$SERVER"; wait "$SERVER" 2>/dev/null || true
  trap - EXIT
fi

run python -m pipeserve.bench.report "$RESULTS"
[[ -n "${DRY_RUN:-}" ]] || echo "results table updated in benchmarks/README.md"
