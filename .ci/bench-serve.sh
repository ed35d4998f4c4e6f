#!/usr/bin/env bash
# `make bench-serve`: two cloudd servers on loopback (policies fleet and fcfs), fleet-256 replayed
# against both at twice its arrival rate by `cloudd bench --serve`, then both servers stopped with
# SIGTERM, also when the bench fails. Usage: .ci/bench-serve.sh [VENV] [extra bench flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
shift || true
cloudd="$venv/bin/cloudd"
logs=$(mktemp -d -t cloudd-bench-serve.XXXXXX)

serve() {  # POLICY ZMQ_PORT HTTP_PORT: start one server in the background, output to its log
    "$cloudd" serve --config configs/cloudd.toml --policy "$1" --zmq-port "$2" --http-port "$3" \
        --max-num-seqs 256 --max-batched-tokens 2048 >"$logs/$1.log" 2>&1 &
}

wait_ready() {  # POLICY PID: until the server prints its ready line; fail if it exits or takes 5 min
    for _ in $(seq 600); do
        grep -q '^cloudd ready:' "$logs/$1.log" && return 0
        if ! kill -0 "$2" 2>/dev/null; then
            cat "$logs/$1.log" >&2
            echo "bench-serve: cloudd serve --policy $1 exited before it was ready" >&2
            return 1
        fi
        sleep 0.5
    done
    echo "bench-serve: cloudd serve --policy $1 not ready after 300 s (log: $logs/$1.log)" >&2
    return 1
}

serve fleet 5601 8601
fleet_pid=$!
serve fcfs 5602 8602
fcfs_pid=$!
trap 'kill -TERM $fleet_pid $fcfs_pid 2>/dev/null || true; wait $fleet_pid $fcfs_pid || true;
      echo "bench-serve: server logs in $logs" >&2' EXIT

wait_ready fleet $fleet_pid
wait_ready fcfs $fcfs_pid
"$cloudd" bench --serve tcp://127.0.0.1:5601,tcp://127.0.0.1:5602 \
    --trace ../shared/workloads/fleet-256.jsonl --rate-scale 2 "$@"
