"""Tiny random-init MoE configs for demos, tests and CPU benches (no downloads)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["tiny_qwen3_moe", "tiny_deepseek_v3", "tiny_olmoe", "build_model", "progress_bars_on_terminal_only"]


def progress_bars_on_terminal_only() -> bool:
    """Turn transformers' own progress bars ("Loading weights", "Writing model shards") off when
    stderr is not a terminal, as r3rdma's bars are: in a log file they are noise. Called where
    r3rdma loads or saves a model (not at import: importing r3rdma changes no library state).
    Returns whether transformers' bars are on afterwards."""
    from transformers.utils import logging as hf_logging

    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    return hf_logging.is_progress_bar_enabled()


def tiny_qwen3_moe(**overrides):
    """A 4-layer Qwen3-MoE config (16 experts, top-4, layer 1 dense, vocab 512), ``overrides`` applied."""
    from transformers import Qwen3MoeConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=16,
        num_experts_per_tok=4,
        mlp_only_layers=[1],
        max_position_embeddings=512,
        norm_topk_prob=True,
    )
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)


def tiny_deepseek_v3(**overrides):
    """A 4-layer DeepSeek-V3 config (16 routed experts in 4 groups, top-4, layer 0 dense, MLA), ``overrides`` applied."""
    from transformers import DeepseekV3Config

    kwargs: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=512,
    )
    kwargs.update(overrides)
    return DeepseekV3Config(**kwargs)


def tiny_olmoe(**overrides):
    """A 3-layer OLMoE config (8 experts, top-2, every layer MoE, vocab 512), ``overrides`` applied."""
    from transformers import OlmoeConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
    )
    kwargs.update(overrides)
    return OlmoeConfig(**kwargs)


def build_model(config, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A causal LM with random weights from ``config``, seeded, in eval mode, sdpa attention."""
    from transformers import AutoModelForCausalLM

    progress_bars_on_terminal_only()
    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Random init gives routers of all-zero weights in some families (weight = zeros in
    # __init__); draw them so routing is non-trivial.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    return model.eval()
