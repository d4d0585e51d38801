#!/usr/bin/env bash
# The main job: set up .venv if needed, then run the whole system on this machine:
#   1. start 2 store nodes on loopback (UCX ingest, Zarr on disk, HTTP reads);
#   2. a torchrun rollout with 2 ranks (gloo on CPU, NCCL when 2+ GPUs are present): a tiny
#      Qwen3-MoE generates for mixed-length prompts, each step's routing is all-gathered across
#      the TP ranks once, finished requests are pushed over UCX to their store node;
#   3. a trainer process reads every request remotely over HTTP and checks it bit-exactly
#      against the shadow record the rollout kept independently of the capturer. It reads with
#      the HTTP read token the nodes derive from the push secret ($R3_STORE_READ_TOKEN_FILE,
#      from the nodes' env file); the secret itself never goes over HTTP.
# The last line is JSON ({"requests", "tokens", "stored_bytes", "roundtrip_exact", "store_nodes"});
# the exit status is 1 if any request differs. The data lives in a new $TMPDIR/r3rdma-demo-*
# directory, removed at exit (the nodes stopped first); set R3_DEMO_DIR to keep it there instead.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
if [ -n "${R3_DEMO_DIR:-}" ]; then
  work="$R3_DEMO_DIR"; made=""
else
  work="$(mktemp -d -t r3rdma-demo-XXXXXX)"; made="$work"
fi
mkdir -p "$work"
export R3_STORE_BIN="$R3_ROOT/.venv/bin/r3rdma-store"
cleanup() {
  "$R3_ROOT/scripts/stop_store_nodes.sh" "$work/nodes" > /dev/null 2>&1 || true
  if [ -n "$made" ]; then rm -rf "$made"; fi
}
trap cleanup EXIT
echo "data: $work ($([ -n "$made" ] && echo "temporary, removed at exit; set R3_DEMO_DIR to keep it" || echo kept))"
"$R3_ROOT/scripts/start_store_nodes.sh" 2 --dir "$work/nodes"
source "$work/nodes/env"
ranks=2
gpus=$("$R3_ROOT/.venv/bin/python" -c 'import torch; print(torch.cuda.device_count())')
echo "rollout: torchrun, $ranks ranks ($([ "$gpus" -ge $ranks ] && echo NCCL || echo gloo)), pushing to $R3_STORE_URLS"
"$R3_ROOT/scripts/launch_rollout.sh" --nproc-per-node "$ranks" -- \
  --rollout-id demo-rollout-0 --requests 12 --batch-size 4 --shadow-dir "$work/shadow" "$@"
echo "trainer: reading from $R3_STORE_HTTP_URLS"
"$R3_ROOT/.venv/bin/r3rdma" check --rollout-id demo-rollout-0 --shadow-dir "$work/shadow"
