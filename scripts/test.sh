#!/usr/bin/env bash
# The test command: set up .venv if needed, run the library's static checks (scripts/lint.sh:
# ruff lint and format, mypy), then every test that needs no GPU, on parallel workers
# (pytest-xdist, -n auto: a worker per core, at most one per 4 GiB of memory; tests/conftest.py
# says which tests share a worker, the vLLM engines among them).
# Extra args go to pytest (e.g. scripts/test.sh -m slow, -k capture, or -n 0 for one process).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
VPY="$R3_ROOT/.venv/bin/python" "$R3_ROOT/scripts/lint.sh"
exec "$R3_ROOT/.venv/bin/python" -m pytest -n auto -m "not gpu and not multigpu" "$@"
