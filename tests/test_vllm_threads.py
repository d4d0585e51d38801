"""The vLLM plug-in's threads start beside a model pinned to its cores (vLLM's CPU backend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from r3rdma.integrations.vllm.threads import spare_cpus


def test_spare_cpus_are_the_parents_less_the_models():
    assert spare_cpus({0}, {0, 1, 2, 3}) == {1, 2, 3}
    assert spare_cpus({2, 3}, {0, 1, 2, 3}) == {0, 1}
    assert spare_cpus({0, 1}, {0, 1}) is None  # not pinned to fewer cores than the parent has: leave it
    assert spare_cpus({0, 1, 2}, {0, 1}) is None  # not a subset: a mask someone else set, leave it


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and 2 cores")
def test_threads_started_inside_run_beside_the_pinned_model_and_the_caller_keeps_its_mask():
    # A child process pins its main thread to one core, as vLLM's CPU worker does, then starts
    # a thread inside the block: the thread gets the parent's (this process's) other cores.
    cores = sorted(os.sched_getaffinity(0))
    child = textwrap.dedent(f"""
        import json, os, threading
        from r3rdma.integrations.vllm.threads import threads_beside_the_model
        os.sched_setaffinity(0, {{{cores[0]}}})
        seen = []
        with threads_beside_the_model():
            t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
            t.start(); t.join()
        print(json.dumps({{"thread": seen[0], "caller": sorted(os.sched_getaffinity(0))}}))
    """)
    out = json.loads(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout)
    assert out == {"thread": cores[1:], "caller": cores[:1]}
