#!/usr/bin/env bash
# Stop the store nodes started by start_store_nodes.sh in DIR: SIGTERM (they drain), then wait.
set -euo pipefail
dir="${1:-./r3rdma_nodes}"
for pidfile in "$dir"/node*.pid; do
  [ -e "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  if kill -TERM "$pid" 2>/dev/null; then
    for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { echo "node $pid did not stop in 30 s; killing" >&2; kill -KILL "$pid"; }
  fi
  rm -f "$pidfile"
done
echo "stopped store nodes in $dir"
