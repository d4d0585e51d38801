#!/usr/bin/env bash
# The library's static checks (scripts/lint.sh [ruff|mypy]; both without an argument): ruff (lint
# and format, settings in pyproject.toml, seconds) and mypy (about a minute) on the library; the
# tests are held to what they prove, not to a style. scripts/test.sh runs ruff before the tests
# and mypy beside them.
# mypy resolves modules by folder, and the installed package maps transport/, store/ and kernels/
# to r3rdma.transport, r3rdma.store and r3rdma.kernels (pyproject's package-dir), which no folder
# on disk mirrors; a tree of links in build/typecheck/ lays the package out as it is installed,
# so mypy checks the modules under the names that import them.
set -euo pipefail
R3_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$R3_ROOT"
# Absolute (the type check runs from build/typecheck); -s keeps the venv's python link unresolved.
VPY="$(realpath -s "${VPY:-$R3_ROOT/.venv/bin/python}")"
what="${1:-all}"
case "$what" in all|ruff|mypy) ;; *) echo "usage: scripts/lint.sh [ruff|mypy]" >&2; exit 2;; esac
if [ "$what" != mypy ]; then
  "$VPY" -m ruff check --quiet r3rdma transport kernels store
  "$VPY" -m ruff format --quiet --check r3rdma transport kernels store
fi
[ "$what" != ruff ] || exit 0
tree="$R3_ROOT/build/typecheck"
rm -rf "$tree" && mkdir -p "$tree/r3rdma"
for entry in r3rdma/*; do ln -s "$R3_ROOT/$entry" "$tree/r3rdma/"; done
for pkg in transport store kernels; do ln -s "$R3_ROOT/$pkg" "$tree/r3rdma/$pkg"; done
cd "$tree" && "$VPY" -m mypy --config-file "$R3_ROOT/pyproject.toml" --cache-dir "$R3_ROOT/build/mypy_cache" r3rdma
