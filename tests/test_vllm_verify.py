"""`r3rdma verify --engine vllm`: a real vLLM engine (bf16) rolls out with the plug-in
recording, the Hugging Face model (fp32) trains; replay must leave 0 differing decisions."""

from __future__ import annotations

import pytest

from tests.vllm_available import require_vllm

require_vllm()  # vLLM itself is imported where a test needs it

from tests.vllm_in_process import engine_in_this_process  # noqa: E402


def test_verify_engine_vllm_replays_every_decision():
    from r3rdma.cli.verify import run_verify

    # The --engine vllm default preset: a random Qwen3-MoE (fan-in init), head_dim 32 for
    # vLLM's CPU attention, 64 experts top-8 so that bf16 vs fp32 flips enough decisions for
    # the KL drop to stand out from bf16 noise (16 experts, top-4 failed CI on that).
    with engine_in_this_process():  # tests/vllm_in_process.py
        result = run_verify(engine="vllm", num_requests=12, max_prompt=24, max_new=24, seed=1)
    s = result.summary
    assert s["engine"] == "vllm" and s["rollout"].startswith("vLLM") and s["model_config"] == "small-qwen3-moe-vllm"
    assert s["requests"] == 12 and s["routing_rows"] > 0
    assert s["router_decisions_differ"] > 0, "bf16 rollout vs fp32 trainer flipped no decision: the test has no teeth"
    assert s["router_decisions_differ_replay"] == 0.0 and s["tokens_any_layer_differ_replay"] == 0.0
    assert result.ok, s


def test_verify_engine_vllm_refuses_cpu_heads_vllm_cannot_run():
    from r3rdma.cli.verify import run_verify

    with pytest.raises(SystemExit, match="head_dim >= 32, the model has 16"):
        run_verify(model_config="tiny-qwen3-moe", engine="vllm", num_requests=2)
