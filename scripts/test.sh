#!/usr/bin/env bash
# The test command: set up .venv if needed, then run every test that needs no GPU.
# Extra args go to pytest (e.g. scripts/test.sh -m slow, or -k capture).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec "$R3_ROOT/.venv/bin/python" -m pytest -m "not gpu and not multigpu" "$@"
