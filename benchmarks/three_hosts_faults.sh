#!/bin/bash
# Three "hosts" (network namespaces on a bridge) serve SmolLM2 at PP = 3, one stage each, while
# `pipeserve bench serve` sends 48 requests from the first; FAULT happens 10 s into the run on
# the third host:
#   kill   SIGKILL its stage process (its `pipeserve worker` stays)
#   link   its link down for 25 s, then up again
# Prints the bench's table and what the driver and the third host's worker logged about it.
# Needs root and iproute2; tears down what it made. Usage: sudo bash benchmarks/three_hosts_faults.sh kill|link
set -u
FAULT=${1:?usage: three_hosts_faults.sh kill|link}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOGS=${LOGS:-$(mktemp -d)}
mkdir -p "$LOGS"
NS=(psft0 psft1 psft2)
export PIPESERVE_CLUSTER_KEY=$(python -c "import secrets; print(secrets.token_hex(32))")
export PYTHONPATH=$ROOT

cleanup() {
  disown -a 2>/dev/null
  pkill -9 -f "master-port 29611" 2>/dev/null
  for ns in "${NS[@]}"; do ip netns pids "$ns" 2>/dev/null | xargs -r kill -9; ip netns del "$ns" 2>/dev/null; done
  ip link del psftbr 2>/dev/null
}
trap cleanup EXIT
cleanup
ip link add psftbr type bridge && ip link set psftbr up
for i in 0 1 2; do
  ip netns add "${NS[$i]}"
  ip link add "psftv$i" type veth peer name eth0 netns "${NS[$i]}"
  ip link set "psftv$i" master psftbr && ip link set "psftv$i" up
  ip -n "${NS[$i]}" addr add "10.78.0.$((i + 1))/24" dev eth0
  ip -n "${NS[$i]}" link set eth0 up && ip -n "${NS[$i]}" link set lo up
done

ip netns exec psft0 python -m pipeserve serve -pp 3 --nnodes 3 --master-addr 10.78.0.1 --master-port 29611 \
  --host 10.78.0.1 --port 8000 --dtype bfloat16 --cpu-bind none --threads-per-stage 1 --stage-timeout 5 \
  >"$LOGS/driver.log" 2>&1 &
for i in 1 2; do
  ip netns exec "${NS[$i]}" python -m pipeserve worker --nnodes 3 --node-rank "$i" --master-addr 10.78.0.1 \
    --master-port 29611 >"$LOGS/worker$i.log" 2>&1 &
done
for _ in $(seq 1 120); do
  code=$(ip netns exec psft0 curl -s -o /dev/null -w "%{http_code}" http://10.78.0.1:8000/health)
  [ "$code" = 200 ] && break
  sleep 1
done
[ "$code" = 200 ] || { echo "the pipeline did not come up; logs in $LOGS"; exit 1; }

(
  sleep 10
  if [ "$FAULT" = kill ]; then
    # the worker's child is the stage zygote (PIPESERVE_STAGE_ZYGOTE=0: the stage), whose child is the stage
    worker=$(pgrep -f "node-rank 2 --master-addr 10.78.0.1" | head -1)
    child=$(pgrep -P "$worker" | head -1)
    stage=$(pgrep -P "$child" | head -1)
    stage=${stage:-$child}
    kill -9 "$stage" && echo "$(date +%T) SIGKILL stage 2 (pid $stage)"
  else
    ip -n psft2 link set eth0 down && echo "$(date +%T) host 3's link down"
    sleep 25
    ip -n psft2 link set eth0 up && echo "$(date +%T) host 3's link up"
  fi
) &
fault=$!
ip netns exec psft0 timeout 400 python -m pipeserve bench serve --base-url http://10.78.0.1:8000 \
  --model smollm2-135m-instruct --dataset random --num-prompts 48 --input-len 128 --output-len 64 --seed 0 \
  --request-rate inf --no-progress 2>&1 | grep -v " INFO "
wait "$fault"
echo "--- driver"; grep -E "pipeline failed|pipeline restarted" "$LOGS/driver.log" | grep -v "llm_engine: pipeline failed"
echo "--- host 3's worker"; grep -E "starting it again|joining again|connection to rank .* was lost" "$LOGS/worker2.log"
