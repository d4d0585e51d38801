#!/usr/bin/env bash
# Start N r3rdma store nodes on this machine, in the background, and print how to reach them.
#
#   scripts/start_store_nodes.sh N [--dir DIR] [--host HOST] [--advertise-host ADDR] [--ucx-port PORT]
#                                  [--http-port PORT] [--public-read] [--max-inflight-mb MB] [--timeout-s S]
#                                  [--http-workers N|auto] [--no-slice-layout] [--zstd-level N]
#                                  [--layers-per-chunk N]
#
# Environment: R3_STORE_BIN, the r3rdma-store executable to run (default: .venv/bin/r3rdma-store
# of this checkout, else r3rdma-store on PATH); R3_STORE_TOKEN_FILE, the push secret (below).
#
# Node i keeps its Zarr root in DIR/node<i> (default DIR: ./r3rdma_nodes) and listens on
# UCX port PORT+i and HTTP port PORT+i (default 0: free ports picked by the OS). The shared
# secret is DIR/token (created, mode 600, if absent; or set R3_STORE_TOKEN_FILE to use another):
# engines push with it; HTTP never takes it. Each node writes the HTTP read token derived from it
# (docs/PROTOCOL.md, "HTTP tokens") to <secret file>.read (mode 600): give trainers that file.
# One node per machine on a cluster: run `scripts/start_store_nodes.sh 1 --host 0.0.0.0
# --advertise-host <this machine's address> --ucx-port 13337 --http-port 8337` on each, with the
# same token file. --host is what the node binds (HTTP; UCX always listens on every interface);
# --advertise-host is the address written into DIR/env and printed, the one engines and trainers
# on other machines connect to (default: --host; with --host 0.0.0.0, `hostname -f` if it
# resolves to a non-loopback address, else the script refuses and asks for --advertise-host,
# since a URL naming 127.0.0.1, 0.0.0.0 or a name that resolves to loopback reaches no other machine).
# --max-inflight-mb, --timeout-s and --http-workers go to every node's r3rdma-store as they are (memory budget
# of batches in flight; deadline of each network step, which also bounds stalled senders and
# HTTP clients that never finish a request; processes serving the HTTP port), and so do the
# layout options: --no-slice-layout (the whole-request layout, for stores read only by whole
# requests; the slice layout is the default), --zstd-level and --layers-per-chunk: see
# r3rdma-store --help, docs/OPERATIONS.md and docs/FORMAT.md.
# Prints the push addresses (R3_STORE_URLS=host:port,...), the HTTP URLs, and writes DIR/env
# (R3_STORE_URLS, R3_STORE_HTTP_URLS, R3_STORE_TOKEN_FILE: the push secret, and
# R3_STORE_READ_TOKEN_FILE: the read token, which r3rdma check / inspect use by default).
# Stop them with scripts/stop_store_nodes.sh DIR.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
n="${1:?usage: start_store_nodes.sh N [--dir DIR] [--host HOST] [--advertise-host ADDR] [--ucx-port PORT] [--http-port PORT] [--public-read] [--max-inflight-mb MB] [--timeout-s S] [--http-workers N|auto] [--no-slice-layout] [--zstd-level N] [--layers-per-chunk N]}"
shift
dir="./r3rdma_nodes"; host="127.0.0.1"; advertise=""; ucx_base=0; http_base=0; extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir="$2"; shift 2;;
    --host) host="$2"; shift 2;;
    --advertise-host) advertise="$2"; shift 2;;
    --ucx-port) ucx_base="$2"; shift 2;;
    --http-port) http_base="$2"; shift 2;;
    --public-read|--no-slice-layout) extra+=("$1"); shift;;
    --max-inflight-mb|--timeout-s|--http-workers|--zstd-level|--layers-per-chunk)
      [ $# -ge 2 ] || { echo "$1 needs a value" >&2; exit 2; }
      extra+=("$1" "$2"); shift 2;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
case "$n" in ''|*[!0-9]*) echo "N must be a positive integer, got '$n'" >&2; exit 2;; esac
if [ -z "$advertise" ]; then
  advertise="$host"
  if [ "$host" = "0.0.0.0" ] || [ "$host" = "::" ]; then
    # A wildcard bind is no address to connect to: advertise this machine's name, but only if
    # it resolves to an address other machines can reach (Debian maps it to 127.0.1.1, many
    # containers to 127.0.0.1).
    advertise="$(hostname -f 2>/dev/null || hostname)"
    resolved="$(getent ahosts "$advertise" 2>/dev/null | awk 'NR == 1 {print $1}')"
    case "$resolved" in
      ''|127.*|::1|0.0.0.0)
        echo "--host $host: this machine's name '$advertise' resolves to '${resolved:-nothing}', which other machines" \
             "cannot reach; pass --advertise-host ADDR (the address engines and trainers connect to)" >&2
        exit 2;;
    esac
  fi
fi
case "$advertise" in
  0.0.0.0|::) echo "--advertise-host $advertise is a wildcard, not an address to connect to" >&2; exit 2;;
esac
store_bin="${R3_STORE_BIN:-$root/.venv/bin/r3rdma-store}"
[ -x "$store_bin" ] || store_bin="$(command -v r3rdma-store || true)"
[ -n "$store_bin" ] || { echo "r3rdma-store not found: run scripts/demo.sh or pip install r3rdma first" >&2; exit 1; }
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
token_file="${R3_STORE_TOKEN_FILE:-$dir/token}"
read_token_file="$token_file.read"   # each node writes it at start (r3rdma-store --read-token-file)
if [ ! -s "$token_file" ]; then
  (umask 077; python3 -c 'import secrets; print(secrets.token_hex(32))' > "$token_file")
fi
for ((i = 0; i < n; i++)); do
  ucx=$(( ucx_base ? ucx_base + i : 0 )); http=$(( http_base ? http_base + i : 0 ))
  rm -f "$dir/node$i.ready"
  setsid nohup "$store_bin" --root "$dir/node$i" --host "$host" --ucx-port "$ucx" --http-port "$http" \
    --token-file "$token_file" --read-token-file "$read_token_file" --ready-file "$dir/node$i.ready" "${extra[@]}" \
    > "$dir/node$i.log" 2>&1 < /dev/null &
  echo $! > "$dir/node$i.pid"
done
push=(); http=()
for ((i = 0; i < n; i++)); do
  for _ in $(seq 1 600); do   # up to 60 s for each node to report ready
    [ -s "$dir/node$i.ready" ] && break
    kill -0 "$(cat "$dir/node$i.pid")" 2>/dev/null || { echo "node $i exited; log:" >&2; cat "$dir/node$i.log" >&2; exit 1; }
    sleep 0.1
  done
  [ -s "$dir/node$i.ready" ] || { echo "node $i did not become ready; log: $dir/node$i.log" >&2; exit 1; }
  read -r ucx http_port < <(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["ucx_port"], d["http_port"])' "$dir/node$i.ready")
  push+=("$advertise:$ucx"); http+=("http://$advertise:$http_port")
done
urls=$(IFS=,; echo "${push[*]}"); http_urls=$(IFS=,; echo "${http[*]}")
cat > "$dir/env" <<ENV
export R3_STORE_URLS=$urls
export R3_STORE_HTTP_URLS=$http_urls
export R3_STORE_TOKEN_FILE=$token_file
export R3_STORE_READ_TOKEN_FILE=$read_token_file
ENV
echo "started $n store node(s) in $dir (logs: $dir/node*.log)"
echo "R3_STORE_URLS=$urls"
echo "R3_STORE_HTTP_URLS=$http_urls"
echo "push secret: $token_file   read token (for trainers): $read_token_file"
echo "(source $dir/env to use them; stop: scripts/stop_store_nodes.sh $dir)"
