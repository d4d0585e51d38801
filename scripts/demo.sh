#!/usr/bin/env bash
# The main job: set up .venv if needed, then generate with a tiny MoE model, capture its
# routing, store it as Zarr, read it back and check it bit-exactly. Extra args go to `r3rdma demo`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec "$R3_ROOT/.venv/bin/r3rdma" demo "$@"
