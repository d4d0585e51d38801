"""`r3rdma verify`: rollout (bf16, KV cache) -> store -> reader -> training forward with/without replay."""

from __future__ import annotations

import json

import pytest

from r3rdma.cli import main as cli_main
from r3rdma.cli.verify import resolve_config, run_verify

SMALL = dict(num_requests=8, max_prompt=24, max_new=16)
KEYS = {
    "router_decisions_differ", "tokens_any_layer_differ", "kl_k3_no_replay", "kl_k3_replay",
    "extreme_ratio_tokens_no_replay", "extreme_ratio_tokens_replay",
    "router_decisions_differ_replay", "tokens_any_layer_differ_replay",
}


def test_cli_verify_cpu_run(capsys):
    rc = cli_main(["verify", "--requests", "8", "--max-prompt", "24", "--max-new", "16", "--device", "cpu"])
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert rc == 0, out
    assert KEYS <= summary.keys()
    assert summary["router_decisions_differ"] > 0 and summary["tokens_any_layer_differ"] > 0
    assert summary["router_decisions_differ_replay"] == 0 and summary["tokens_any_layer_differ_replay"] == 0
    assert summary["kl_k3_replay"] < summary["kl_k3_no_replay"]
    assert "no replay" in out and "paper" in out


def test_same_numeric_setting_measures_no_mismatch():
    # fp32 rollout with a KV cache vs fp32 full-sequence training, right-padded: the measurement
    # itself (token alignment, sampled-token log-probs, row mapping) must read ~0. Not exactly 0
    # without replay: decode with a cache and one full forward round differently, so a near tie
    # between two experts may go either way (a misaligned row mapping would differ on most).
    s = run_verify(rollout_dtype="float32", layout="padded", model_config="tiny-qwen3-moe", **SMALL).summary
    assert s["router_decisions_differ"] < 1e-2 and s["router_decisions_differ_replay"] == 0
    assert s["kl_k3_no_replay"] < 1e-9 and s["mean_abs_logp_diff_no_replay"] < 1e-5


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_deepseek_v3_end_to_end_replay_is_exact(layout):
    s = run_verify(model_config="tiny-deepseek-v3", layout=layout, **SMALL).summary
    assert s["moe_layers"] == 3  # first_k_dense_replace=1 of 4 layers
    assert s["router_decisions_differ_replay"] == 0 and s["tokens_any_layer_differ_replay"] == 0


def test_model_config_json_file(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({
        "model_type": "olmoe", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_experts": 8, "num_experts_per_tok": 2, "architectures": ["OlmoeForCausalLM"],
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }))
    config = resolve_config(str(path))
    assert config.model_type == "olmoe" and config.num_experts == 8
    s = run_verify(model_config=str(path), num_requests=4, max_prompt=12, min_new=2, max_new=6).summary
    assert s["num_experts"] == 8 and s["router_decisions_differ_replay"] == 0


def test_presets_for_gpu_runs_have_the_required_geometry():
    c = resolve_config("qwen3-moe-16x64")
    assert c.num_hidden_layers >= 16 and c.num_experts >= 64 and not c.mlp_only_layers
    with pytest.raises(SystemExit):
        resolve_config("no-such-preset")


def test_cli_verify_trainer_megatron_refuses_cpu(capsys):
    # --trainer megatron rolls out with a megatron-core GPTModel on a GPU: on CPU it exits 2
    # with a clear message, before importing megatron or building anything.
    from r3rdma.cli import build_parser

    argv = ["verify", "--trainer", "megatron", "--device", "cpu"]
    assert build_parser(argv).parse_args(argv).trainer == "megatron"
    assert build_parser(["verify"]).parse_args(["verify"]).trainer == "hf"
    rc = cli_main(["verify", "--trainer", "megatron", "--device", "cpu", "--requests", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "needs a CUDA GPU" in err and "--trainer hf" in err
    with pytest.raises(SystemExit):
        cli_main(["verify", "--trainer", "deepspeed"])
