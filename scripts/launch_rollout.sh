#!/usr/bin/env bash
# Run `r3rdma rollout` under torchrun: TP ranks capture routing, all-gather it once per step,
# and push it to store nodes.
#
#   scripts/launch_rollout.sh [--nproc-per-node K] [--nnodes N] [--node-rank R] [--master-addr A]
#                             [--master-port P] -- [r3rdma rollout options]
#
# Single machine: scripts/launch_rollout.sh --nproc-per-node 2 -- --requests 16
# Two machines (run on each, node-rank 0 and 1, same master address):
#   scripts/launch_rollout.sh --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 8 -- --tp-size 8
# Store nodes come from --store-urls or $R3_STORE_URLS, the secret from $R3_STORE_TOKEN_FILE
# (see scripts/start_store_nodes.sh, which writes both into DIR/env).
# With --nnodes > 1 and no GLOO_SOCKET_IFNAME set, it is set to this machine's interface towards
# the master address (`ip route get`): gloo otherwise binds the address this machine's hostname
# resolves to, which is 127.0.0.1 / 127.0.1.1 on many hosts and containers, and the ranks of
# other machines then never connect (the job hangs in its first collective).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nproc=1; nnodes=1; node_rank=0; master_addr=127.0.0.1; master_port=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc-per-node) nproc="$2"; shift 2;;
    --nnodes) nnodes="$2"; shift 2;;
    --node-rank) node_rank="$2"; shift 2;;
    --master-addr) master_addr="$2"; shift 2;;
    --master-port) master_port="$2"; shift 2;;
    --) shift; break;;
    *) echo "unknown option $1 (rollout options go after --)" >&2; exit 2;;
  esac
done
if [ -z "$master_port" ]; then
  master_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])')
  [ "$nnodes" -gt 1 ] && { echo "--master-port is required with --nnodes > 1" >&2; exit 2; }
fi
if [ "$nnodes" -gt 1 ] && [ -z "${GLOO_SOCKET_IFNAME:-}" ] && command -v ip > /dev/null; then
  master_ip="$(getent ahostsv4 "$master_addr" 2>/dev/null | awk 'NR == 1 {print $1}')"
  route="$(ip -o route get "${master_ip:-$master_addr}" 2>/dev/null || true)"
  ifname="$(awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}' <<< "$route")"
  if [ "$ifname" = "lo" ]; then   # this machine is the master: the interface holding that address
    ifname="$(ip -o addr show to "${master_ip:-$master_addr}" 2>/dev/null | awk 'NR == 1 {print $2}')"
  fi
  if [ -n "$ifname" ] && [ "$ifname" != "lo" ]; then
    export GLOO_SOCKET_IFNAME="$ifname"
  else
    echo "launch_rollout.sh: no interface towards $master_addr found; set GLOO_SOCKET_IFNAME if gloo hangs" >&2
  fi
fi
torchrun_bin="$root/.venv/bin/torchrun"; [ -x "$torchrun_bin" ] || torchrun_bin="$(command -v torchrun)"
# NVLink multicast stays off on the shared GPU machines (NVLS / symmetric-memory multicast).
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$torchrun_bin" --nnodes "$nnodes" --node-rank "$node_rank" --nproc-per-node "$nproc" \
  --master-addr "$master_addr" --master-port "$master_port" -m r3rdma.cli rollout "$@"
