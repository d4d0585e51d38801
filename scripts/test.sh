#!/usr/bin/env bash
# The test command: set up .venv if needed, run the library's static checks (scripts/lint.sh:
# ruff lint and format first, then mypy beside the tests), and every test that needs no GPU, on
# parallel workers (pytest-xdist, -n auto: a worker per core, at most one per 4 GiB of memory;
# tests/conftest.py says which tests share a worker, the vLLM engines among them). It fails if
# either the tests or a check failed; mypy's findings are printed after the tests'.
# Extra args go to pytest (e.g. scripts/test.sh -m slow, -k capture, or -n 0 for one process).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
export VPY="$R3_ROOT/.venv/bin/python"
"$R3_ROOT/scripts/lint.sh" ruff
# mypy takes a core for about a minute; beside the tests it fills a core they leave idle (the
# parallel run ends with one worker still busy), before them it added that minute to every run.
# At the lowest priority it takes only what the tests leave: their collection (both workers
# importing torch, vLLM, transformers) does not wait for it, and workers waiting on their
# subprocesses and sockets leave about a sixth of the cores idle.
mypy_log="$(mktemp)"
nice -n 19 "$R3_ROOT/scripts/lint.sh" mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
trap 'kill "$mypy_pid" 2>/dev/null || true; rm -f "$mypy_log"' EXIT
tests=0
"$VPY" -m pytest -n auto -m "not gpu and not multigpu" "$@" || tests=$?
checks=0
wait "$mypy_pid" || checks=$?
if [ "$checks" -ne 0 ]; then
  echo "scripts/lint.sh mypy failed:" >&2
  cat "$mypy_log" >&2
else
  tail -1 "$mypy_log"
fi
exit $((tests != 0 ? tests : checks))
