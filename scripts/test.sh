#!/usr/bin/env bash
# The test command: set up .venv if needed, run the library's static checks (scripts/lint.sh:
# ruff lint and format, mypy), then every test that needs no GPU.
# Extra args go to pytest (e.g. scripts/test.sh -m slow, or -k capture).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
VPY="$R3_ROOT/.venv/bin/python" "$R3_ROOT/scripts/lint.sh"
exec "$R3_ROOT/.venv/bin/python" -m pytest -m "not gpu and not multigpu" "$@"
