"""Tiny MoE checkpoints vLLM can load, written locally (no download): for tests, the vLLM
bench and ``r3rdma verify --engine vllm``, and the tokenizers that let vLLM take text prompts.

vLLM loads a model directory (``config.json`` + safetensors) and, unless started with
``skip_tokenizer_init=True``, a tokenizer from it; without one, text prompts cannot be
tokenized (``The decoder prompt cannot be empty``). Two tokenizers, built with ``tokenizers``
and saved as ``tokenizer.json`` (``AutoTokenizer.from_pretrained`` loads them):

- :func:`write_char_tokenizer`: one character per token, printable ASCII keeps its code point
  as its id (text and ids map one to one, so stop strings can be matched); for random-weight
  models (:func:`write_tiny_checkpoint`).
- :func:`write_byte_tokenizer`: byte-level, a text's UTF-8 bytes are its ids 0-255; for models
  trained on bytes (``r3rdma train-tiny``), so text reaches the model as it saw its training text.
"""

from __future__ import annotations

from pathlib import Path

from r3rdma.errors import ConfigError

__all__ = ["write_tiny_checkpoint", "write_char_tokenizer", "write_byte_tokenizer"]

PAD, BOS, EOS = 0, 1, 2
CHAR_MAX_ID = 126  # the char tokenizer's largest id ("~")

# A plain chat template, so vLLM's chat endpoint formats messages for models that were never
# trained on a chat format.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "


def write_tiny_checkpoint(path: str | Path, *, seed: int = 0, tokenizer: bool = True, weights: bool = True, **overrides) -> Path:
    """A random-weight Qwen3-MoE (4 layers, layer 1 dense, 16 experts, top-4, hidden 128) saved
    with ``save_pretrained``, with :func:`write_char_tokenizer`'s tokenizer unless
    ``tokenizer=False``; ``overrides`` go to the config. vLLM's CPU attention needs a head size
    of 32 or more, hence ``head_dim=32``. ``weights=False`` writes the config alone, for
    vLLM's ``load_format="dummy"`` (a full-size shape such as Qwen3-30B-A3B's, never built here)."""
    from r3rdma.integrations.hf_models import build_model, tiny_qwen3_moe

    path = Path(path)
    config = tiny_qwen3_moe(
        **{
            "vocab_size": 256,
            "hidden_size": 128,
            "head_dim": 32,
            "bos_token_id": BOS,
            "eos_token_id": EOS,
            "pad_token_id": PAD,
            **overrides,
        }
    )
    if tokenizer and config.vocab_size <= CHAR_MAX_ID:
        # vLLM would refuse every prompt holding a character whose id the model has no row for.
        raise ConfigError(
            f"the character tokenizer's ids go up to {CHAR_MAX_ID}, so vocab_size must be > "
            f"{CHAR_MAX_ID}; got vocab_size={config.vocab_size} (or pass tokenizer=False)"
        )
    if weights:
        build_model(config, seed=seed).save_pretrained(path)
    else:
        config.architectures = ["Qwen3MoeForCausalLM"]  # set by the model class when weights are saved
        config.save_pretrained(path)
    if tokenizer:
        write_char_tokenizer(path)
    return path


def write_char_tokenizer(path: str | Path) -> None:
    """Save a character-level fast tokenizer (ids 32-126 and 10 are their characters; 0/1/2
    pad/bos/eos; any other character becomes pad) with a plain chat template into ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "\n": 10}
    vocab.update({chr(i): i for i in range(32, CHAR_MAX_ID + 1)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def write_byte_tokenizer(path: str | Path, *, bos: int, eos: int, pad: int, vocab_size: int) -> None:
    """Save a byte-level fast tokenizer into ``path``: a text's UTF-8 bytes are its ids (byte
    ``b`` is id ``b``, any text round-trips), ``bos`` / ``eos`` / ``pad`` name ``<s>`` / ``</s>``
    / ``<pad>``, and a plain chat template. No special token is added on encode, and ``<s>``
    written in a text stays three bytes (``split_special_tokens``): a model trained on raw bytes
    never saw them as one id. Every id is below ``vocab_size``, the model's vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<s>": bos, "</s>": eos, "<pad>": pad}
    if len(set(specials.values())) != 3 or not all(256 <= i < vocab_size for i in specials.values()):
        raise ConfigError(
            f"bos, eos and pad must be distinct ids in 256..{vocab_size - 1} (ids 0-255 are the bytes, "
            f"vocab_size {vocab_size} is the model's); got bos={bos}, eos={eos}, pad={pad}"
        )
    # The ByteLevel pre-tokenizer turns each byte into one printable character (GPT-2's table);
    # giving that character the byte's value as its id, with no merges, makes the ids the bytes.
    vocab = {char: byte for byte, char in _byte_chars().items()}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet()), "GPT-2's byte table changed in tokenizers"
    vocab.update(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", split_special_tokens=True
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> character table, the one ``pre_tokenizers.ByteLevel`` applies: printable
    Latin-1 bytes are their own character, the other 68 map to U+0100 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + n) for n, b in enumerate(moved)})
    return table
