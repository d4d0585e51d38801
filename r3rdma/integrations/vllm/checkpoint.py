"""Tiny MoE checkpoints vLLM can load, written locally (no download): for tests, the vLLM
bench and ``r3rdma verify --engine vllm``.

vLLM loads a model directory (``config.json`` + safetensors) and, unless started with
``skip_tokenizer_init=True``, a tokenizer from it. :func:`write_char_tokenizer` writes a
one-character-per-token tokenizer (printable ASCII keeps its code point as its id, so text
and ids map one to one and stop strings can be matched), built with ``tokenizers``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_tiny_checkpoint", "write_char_tokenizer"]

PAD, BOS, EOS = 0, 1, 2


def write_tiny_checkpoint(path: str | Path, *, seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """A random-weight Qwen3-MoE (4 layers, layer 1 dense, 16 experts, top-4, hidden 128) saved
    with ``save_pretrained``; ``overrides`` go to the config. vLLM's CPU attention needs a
    head size of 32 or more, hence ``head_dim=32``."""
    from r3rdma.integrations.hf_models import build_model, tiny_qwen3_moe

    path = Path(path)
    config = tiny_qwen3_moe(**{"vocab_size": 256, "hidden_size": 128, "head_dim": 32, "bos_token_id": BOS,
                               "eos_token_id": EOS, "pad_token_id": PAD, **overrides})
    build_model(config, seed=seed).save_pretrained(path)
    if tokenizer:
        write_char_tokenizer(path)
    return path


def write_char_tokenizer(path: str | Path) -> None:
    """Save a character-level fast tokenizer (ids 32-126 and 10 are their characters; 0/1/2
    pad/bos/eos) with a plain chat template into ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "\n": 10}
    vocab.update({chr(i): i for i in range(32, 127)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<pad>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    fast.save_pretrained(str(path))
