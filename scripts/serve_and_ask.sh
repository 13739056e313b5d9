#!/usr/bin/env bash
# The README's main job in one go: start `pipeserve serve -pp 2` (SmolLM2 by default) on a free
# local port, wait for /health, ask one chat question with curl, print the answer, stop the server.
# Leaves nothing running, whatever happens (trap on EXIT).
#
#   scripts/serve_and_ask.sh ["your question"]
#   PP=1 MODEL=/path/to/model scripts/serve_and_ask.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PP="${PP:-2}"
MODEL="${MODEL:-smollm2-135m-instruct}"
QUESTION="${1:-What is the capital of France? Answer in one sentence.}"
MAX_TOKENS="${MAX_TOKENS:-64}"
STARTUP_TIMEOUT_S="${STARTUP_TIMEOUT_S:-300}"

if command -v pipeserve >/dev/null 2>&1; then
  PIPESERVE=(pipeserve)
else
  PIPESERVE=(python -m pipeserve.entrypoints.cli)  # not installed: run from the checkout
fi
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL="http://127.0.0.1:${PORT}"
LOG=$(mktemp -t pipeserve-serve.XXXXXX)

# A session of its own, so that stage processes left by a crash can be found and stopped.
setsid "${PIPESERVE[@]}" serve --model "$MODEL" -pp "$PP" --host 127.0.0.1 --port "$PORT" >"$LOG" 2>&1 &
SERVER=$!

stop_server() {
  if kill -0 "$SERVER" 2>/dev/null; then
    kill -TERM "$SERVER" 2>/dev/null || true          # graceful: the server stops its stages
    for _ in $(seq 1 60); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.5; done
  fi
  kill -KILL -- "-$SERVER" 2>/dev/null || true        # anything of its session still alive
  wait "$SERVER" 2>/dev/null || true
  rm -f "$LOG"
}
trap stop_server EXIT
trap 'exit 130' INT TERM

echo "starting pipeserve (model=$MODEL, pp=$PP) on $URL ..." >&2
deadline=$((SECONDS + STARTUP_TIMEOUT_S))
until curl -sf "$URL/health" >/dev/null 2>&1; do
  if ! kill -0 "$SERVER" 2>/dev/null; then
    echo "the server exited before it was ready:" >&2; cat "$LOG" >&2; exit 1
  fi
  if ((SECONDS > deadline)); then
    echo "the server was not ready after ${STARTUP_TIMEOUT_S}s:" >&2; cat "$LOG" >&2; exit 1
  fi
  sleep 0.5
done

MODEL_ID=$(curl -sf "$URL/v1/models" | python -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
BODY=$(python -c 'import json, sys; print(json.dumps({"model": sys.argv[1], "max_tokens": int(sys.argv[3]),
    "temperature": 0, "messages": [{"role": "user", "content": sys.argv[2]}]}))' "$MODEL_ID" "$QUESTION" "$MAX_TOKENS")

echo "Q: $QUESTION" >&2
curl -sS --fail-with-body -H "Content-Type: application/json" -d "$BODY" "$URL/v1/chat/completions" \
  | python -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])'
