"""`r3rdma train-tiny --quick` (CPU) and `r3rdma verify --model` on its checkpoint.

One module-scoped training run (~1 minute on 2 cores) feeds every test: the model must learn
(held-out loss below the byte-unigram cross entropy of the same text, not only below the
untrained 5.56 nats), its routers must route non-uniformly and differently from the untrained
ones, and replaying the stored routing must leave exactly 0 differing decisions.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from r3rdma.cli import main as cli_main
from r3rdma.cli import train_tiny
from r3rdma.cli.verify import run_verify

pytestmark = pytest.mark.long_module  # the training run (tests/conftest.py)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # One torch thread in this module: with two on a 2-core runner, any other busy process makes
    # OpenMP spin (measured ~10x slower training); restored for the modules after this one.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def quick_model(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("train-tiny") / "ckpt"
    rc = cli_main(["train-tiny", "--quick", "--out", str(out), "--threads", "1"])
    meta = json.loads((out / "train_tiny.json").read_text())
    return rc, out, meta


def test_quick_training_lowers_heldout_loss_below_unigram(quick_model):
    rc, out, meta = quick_model
    assert rc == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert meta["tokenizer"]["kind"] == "bytes" and meta["tokenizer"]["vocab_size"] == 259
    assert 0 < meta["data"]["heldout_files"] < meta["data"]["train_files"]
    before, after = meta["heldout_loss_before"], meta["heldout_loss_after"]
    assert before == pytest.approx(math.log(259), abs=0.1)  # untrained: ~uniform over the vocabulary
    # A model that only learned byte frequencies would sit at the unigram cross entropy of the
    # held-out text (~3.1 nats); the trained one uses context.
    s = train_tiny.QUICK
    train_ids, heldout, _ = train_tiny.load_corpus(train_bytes=s.train_bytes, heldout_bytes=s.heldout_bytes)
    p = np.bincount(train_ids, minlength=259) / train_ids.size
    q = np.bincount(heldout, minlength=259)
    unigram = float(-(q * np.log(np.maximum(p, 1e-9))).sum() / q.sum())
    assert after < unigram - 0.3, (after, unigram)


def test_trained_expert_load_is_not_uniform_and_moved(quick_model):
    _, _, meta = quick_model
    load = meta["expert_load_after"]
    # chi-square / df against a uniform load: <= ~1 (sd ~0.4 at 15 df) when routing ignores the
    # input; each layer of the trained model is far above that.
    assert min(load["chi2_over_df"]) > 20, load
    # Training moved every layer's load away from the untrained routers' on the same windows.
    assert min(meta["load_tv_distance_vs_untrained"]) > 0.03, meta["load_tv_distance_vs_untrained"]
    assert len(load["chi2_over_df"]) == train_tiny.QUICK.layers


def test_verify_model_replay_leaves_zero_differences(quick_model, tmp_path):
    from r3rdma.cli.inspect import inspect_rollout

    _, out, meta = quick_model
    root = tmp_path / "root"
    s = run_verify(model_path=str(out), num_requests=8, max_prompt=32, min_new=8, max_new=16, root=str(root),
                   device="cpu").summary
    assert s["init"] == "trained checkpoint" and s["moe_layers"] == train_tiny.QUICK.layers
    assert s["router_decisions_differ_replay"] == 0 and s["tokens_any_layer_differ_replay"] == 0
    assert s["mean_layers_differ_per_token_replay"] == 0
    assert s["heldout_loss_after_training"] == meta["heldout_loss_after"]
    for mode in ("no_replay", "replay"):
        hist = s[f"abs_log_ratio_hist_{mode}"]
        assert sum(hist.values()) == s["generated_tokens"]
        extreme = sum(v for k, v in hist.items() if k.startswith(("[log2", "[1,", "[2,")))
        assert extreme == s[f"extreme_tokens_{mode}"]
    # The stored rollout of real prompts routes non-uniformly too (what `r3rdma inspect` shows).
    summary, load = inspect_rollout(str(root), "verify-rollout-0")
    assert summary.tokens == s["routing_rows"] and load.shape == (train_tiny.QUICK.layers, train_tiny.QUICK.experts)
    assert np.median(train_tiny.load_stats(load)["chi2_over_df"]) > 5


def test_prompts_are_heldout_text_and_seeded():
    a = train_tiny.heldout_prompts(4, seed=3, min_prompt=16, max_prompt=32, min_new=4, max_new=8, heldout_bytes=100_000)
    b = train_tiny.heldout_prompts(4, seed=3, min_prompt=16, max_prompt=32, min_new=4, max_new=8, heldout_bytes=100_000)
    assert a == b and all(16 <= len(r.prompt) <= 32 and max(r.prompt) < 256 for r in a)
    assert any(bytes(r.prompt).decode("utf-8", "replace").strip() for r in a)


def test_training_is_seeded_and_reproducible(tmp_path):
    # Two short CPU runs with one seed give bit-identical weights; another seed does not.
    s = dataclasses.replace(train_tiny.QUICK, steps=3, warmup_steps=1, seq_len=64, batch_size=4, train_bytes=100_000,
                            heldout_bytes=20_000, eval_windows=2)
    metas = [train_tiny.train(s, str(tmp_path / name), seed=seed, threads=1, log=lambda m: None)
             for name, seed in (("a", 0), ("b", 0), ("c", 1))]
    blobs = [(tmp_path / n / "model.safetensors").read_bytes() for n in "abc"]
    assert blobs[0] == blobs[1] and blobs[0] != blobs[2]
    assert metas[0]["heldout_loss_after"] == metas[1]["heldout_loss_after"]
    assert metas[0]["data"]["files_sha256"] == metas[2]["data"]["files_sha256"]


def test_checkpoint_tokenizer_maps_text_to_the_ids_it_was_trained_on(quick_model):
    """The checkpoint carries a tokenizer (vLLM and ``AutoTokenizer`` take text): a training
    file's text becomes exactly the ids of the training stream, any text round-trips, and every
    id is one the model has."""
    from transformers import AutoTokenizer

    _, out, meta = quick_model
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (train_tiny.BOS, train_tiny.EOS, train_tiny.PAD)
    assert meta["tokenizer"]["bos"] == train_tiny.BOS and len(tok) == train_tiny.VOCAB_SIZE
    s = train_tiny.QUICK
    train_ids, _, _ = train_tiny.load_corpus(train_bytes=s.train_bytes, heldout_bytes=0)
    _, files = train_tiny.stdlib_files()
    training = [full for rel, full in files if not train_tiny.is_heldout(rel)]
    with open(training[0], "rb") as f:  # the stream starts with the first training file's bytes
        first = f.read()
    assert tok(first.decode())["input_ids"] == train_ids[: len(first)].tolist()
    for full in training:  # a file with non-ASCII text: its UTF-8 bytes, one id each
        with open(full, "rb") as f:
            data = f.read()
        if len(data) < 20_000 and max(data, default=0) > 127:
            try:
                text = data.decode()
            except UnicodeDecodeError:
                continue
            break
    else:
        pytest.skip("no small non-ASCII UTF-8 file in this standard library")
    ids = tok(text)["input_ids"]
    assert ids == list(data) and tok.decode(ids) == text
    odd = "x\t= 'wörld 日本'\r\n</s><s>\x00\x7f"
    assert tok(odd)["input_ids"] == list(odd.encode())  # special tokens written in text stay bytes
    assert tok.decode(tok(odd)["input_ids"]) == odd
    assert tok.decode([72, 105, train_tiny.EOS], skip_special_tokens=True) == "Hi"
