"""Routing capture under transformers' own continuous batching, on a tiny random Qwen3-MoE (CPU).

Two checks per request. Against a :class:`ShadowRecorder` on the same forwards the capture must
be exact: it is the same computation. Against a plain full-sequence forward of ``prompt +
generated[:-1]`` (row p: the top-k ids the router chose for the token at position p), which is a
different computation (one pass, no cache, other matmul shapes than chunked prefill and paged
decode), scores agree to rounding only: a row must equal the plain forward's top-k (ids and
their order) except where the ranking it differs in is a near tie of the plain forward's scores.

transformers is a test extra: its imports are plain, so a moved import fails here, loudly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from r3rdma.errors import ConfigError
from r3rdma.integrations.hf_capture import capturer_for_model
from r3rdma.integrations.hf_continuous import HFContinuousDriver, run_continuous_batching
from r3rdma.integrations.hf_rollout import RolloutRequest
from r3rdma.integrations.hf_routers import find_moe_routers
from r3rdma.store.local_store import LocalRoutingStore
from r3rdma.integrations.hf_models import build_model, tiny_qwen3_moe
from r3rdma.write.writer import RoutingWriter
from r3rdma.read.reader import RoutingReader
from r3rdma.cli.shadow import ShadowRecorder

pytestmark = pytest.mark.timeout(120)


class ListSink:
    def __init__(self) -> None:
        self.records = {}

    def submit(self, record) -> None:
        assert record.request_id not in self.records
        self.records[record.request_id] = record


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_qwen3_moe(), seed=0)


def _gen(max_new_tokens: int = 10) -> GenerationConfig:
    # eos -1: no EOS, every request runs to its budget (so lengths are predictable)
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def _cb(**kw) -> ContinuousBatchingConfig:
    base = dict(page_size=4, num_blocks=64, max_batch_tokens=16, max_requests_per_batch=8, seed=0)
    base.update(kw)
    return ContinuousBatchingConfig(**base)


def _prompts(lengths, seed, prefix=()):
    rng = np.random.default_rng(seed)
    return {f"req-{i}": list(prefix) + [int(t) for t in rng.integers(8, 512, int(n))] for i, n in enumerate(lengths)}


def _ground_truth(model, tokens) -> tuple[np.ndarray, np.ndarray]:
    """([T, L, K] top-k ids, [T, L, E] router logits) of a plain forward over ``tokens`` (one
    sequence, no cache)."""
    routers = find_moe_routers(model)
    got = {}
    handles = [r.module.register_forward_hook(lambda _m, _a, out, i=r.moe_idx: got.__setitem__(i, (out[0].clone(), out[2].clone())))
               for r in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([list(tokens)]))
    finally:
        for h in handles:
            h.remove()
    ids = torch.stack([got[i][1] for i in range(len(routers))], dim=1).numpy().astype(np.int64)
    logits = torch.stack([got[i][0] for i in range(len(routers))], dim=1).float().numpy()
    return ids, logits


#: Router logits here are O(1) in float32; chunked prefill and paged decode round differently
#: from one full forward by ~1e-6. Two experts closer than this are a tie either may win.
TIE_TOL = 1e-4


def _check_rows(model, outputs, rows_of) -> None:
    for out in outputs:
        expected, logits = _ground_truth(model, list(out.prompt) + list(out.generated[:-1]))
        got = np.asarray(rows_of(out.request_id)).astype(np.int64)
        assert got.shape == expected.shape == (len(out.prompt) + len(out.generated) - 1, 3, 4), out.request_id
        for t, layer in zip(*np.nonzero((got != expected).any(axis=2))):
            # Only a near tie may rank differently: the captured ids must be a top-k ranking of
            # the plain forward's scores to within TIE_TOL (descending, nothing left out higher).
            scores = logits[t, layer]
            chosen = scores[got[t, layer]]
            rest = np.delete(scores, got[t, layer])
            assert (np.diff(chosen) <= TIE_TOL).all() and chosen.min() >= rest.max() - TIE_TOL, (
                f"{out.request_id}: position {t} layer {layer} captured {got[t, layer].tolist()}, a plain forward "
                f"ranks {expected[t, layer].tolist()} (top scores {', '.join(f'{x:.5f}' for x in np.sort(scores)[::-1][:5])})")


def _no_leftover_hooks(model, driver) -> None:
    for r in find_moe_routers(model):
        assert not r.module._forward_hooks, "router hooks left behind"


def test_chunked_prefill_mixed_lengths_exact(model):
    prompts = _prompts([3, 5, 9, 14, 20, 27, 33, 45], seed=0)
    sink = ListSink()
    shadow = ShadowRecorder(model)  # independent record through the step listener
    driver = HFContinuousDriver(
        model, lambda n: capturer_for_model(model, num_slots=n, sink=sink),
        generation_config=_gen(), cb_config=_cb(allow_block_sharing=False, max_batch_tokens=16),
        step_listeners=[shadow.on_step],
    )
    try:
        outputs = driver.run(prompts)
        for o in outputs:
            rows = len(o.prompt) + len(o.generated) - 1
            assert np.array_equal(shadow.rows(o.request_id, rows), sink.records[o.request_id].ids_TLK.astype(np.int64))
    finally:
        shadow.close()
    assert [o.request_id for o in outputs] == list(prompts)
    assert all(len(o.generated) == 10 and list(o.prompt) == prompts[o.request_id] for o in outputs)
    s = driver.stats
    assert s.chunked_prefill_steps > 0, s            # prompts of 20..45 tokens with 16-token batches
    assert s.prefix_hits == 0 and s.dedup_swaps == 0
    assert s.tokens == sum(len(o.prompt) + len(o.generated) - 1 for o in outputs)  # each row computed once
    _check_rows(model, outputs, lambda rid: sink.records[rid].ids_TLK)
    assert driver.capturer.active_requests == 0
    _no_leftover_hooks(model, driver)


def test_shared_prefix_hits_through_store(model, tmp_path):
    shared = [int(t) for t in np.random.default_rng(1).integers(8, 512, 13)]  # 3 full pages + 1 token
    prompts = _prompts([2, 5, 9, 14, 3, 20], seed=2, prefix=shared)
    prompts["req-twin"] = prompts["req-2"][:-1] + [9]  # shares 5 full pages with req-2
    requests = [RolloutRequest(rid, tuple(p), 8) for rid, p in prompts.items()]
    rollout = "cb-prefix-0"
    with LocalRoutingStore(tmp_path) as store, RoutingWriter(store, flush_bytes=1 << 14) as writer:
        driver = HFContinuousDriver(
            model, lambda n: capturer_for_model(model, num_slots=n, sink=writer, rollout_id=rollout),
            generation_config=_gen(), cb_config=_cb(max_batch_tokens=24),
        )
        outputs = driver.run(requests)
        writer.flush()
    s = driver.stats
    assert s.prefix_hits >= 1 and s.prefix_hit_tokens >= 12, s
    assert s.hit_requests, s
    # Rows of hit positions were attached, not computed: fewer computed rows than total rows.
    assert s.tokens < sum(len(o.prompt) + len(o.generated) - 1 for o in outputs)
    reader = RoutingReader(tmp_path)
    stored = reader.get(rollout, [o.request_id for o in outputs])
    assert set(stored) == set(prompts)
    _check_rows(model, outputs, lambda rid: stored[rid].numpy())


def test_cache_pressure_soft_resets_exact(model):
    prompts = _prompts([3, 5, 9, 14, 20, 27, 33, 45], seed=0)
    sink = ListSink()
    driver = HFContinuousDriver(
        model, lambda n: capturer_for_model(model, num_slots=n, sink=sink),
        generation_config=_gen(), cb_config=_cb(num_blocks=16, max_batch_tokens=16),
    )
    outputs = driver.run(prompts)
    s = driver.stats
    assert s.soft_resets >= 1 and s.recomputed_tokens > 0, s
    _check_rows(model, outputs, lambda rid: sink.records[rid].ids_TLK)


def test_prefix_sharing_under_pressure_exact(model):
    # Prefix hits, de-duplication and soft resets in one run (small cache, shared prefix).
    shared = [int(t) for t in np.random.default_rng(1).integers(8, 512, 13)]
    prompts = _prompts([2, 5, 9, 14, 3, 20], seed=2, prefix=shared)
    prompts["req-twin"] = prompts["req-2"][:-1] + [9]
    sink = ListSink()
    driver = HFContinuousDriver(
        model, lambda n: capturer_for_model(model, num_slots=n, sink=sink),
        generation_config=_gen(), cb_config=_cb(num_blocks=16, max_batch_tokens=8),
    )
    outputs = driver.run(prompts)
    s = driver.stats
    # Deterministic for this seed and transformers' FIFO scheduler; if a transformers update
    # reshuffles scheduling, retune num_blocks / max_batch_tokens so all three still happen.
    assert s.prefix_hits >= 1 and s.dedup_swaps >= 1 and s.soft_resets >= 1, s
    assert set(sink.records) == set(prompts)
    _check_rows(model, outputs, lambda rid: sink.records[rid].ids_TLK)


def test_dedup_repointing_is_needed(model, monkeypatch):
    # Without re-pointing de-duplicated blocks, the freed duplicate's slots get reused and the
    # capturer (rightly) refuses the stale rows: the hook on mark_complete_blocks is load-bearing.
    import r3rdma.integrations.hf_continuous as hfc
    from r3rdma.errors import StaleSlotError

    monkeypatch.setattr(hfc._GenerateCall, "_on_dedup", lambda self, rid, idx: None)
    shared = [int(t) for t in np.random.default_rng(1).integers(8, 512, 13)]
    prompts = _prompts([2, 5, 9, 14, 3, 20], seed=2, prefix=shared)
    prompts["req-twin"] = prompts["req-2"][:-1] + [9]
    with pytest.raises(StaleSlotError):
        run_continuous_batching(model, lambda n: capturer_for_model(model, num_slots=n, sink=ListSink()), prompts,
                                generation_config=_gen(), cb_config=_cb(num_blocks=16, max_batch_tokens=8))
    _no_leftover_hooks(model, None)


def test_refuses_what_it_cannot_capture(model):
    with pytest.raises(ConfigError, match="use_cuda_graph"):
        HFContinuousDriver(model, None, generation_config=_gen(), cb_config=_cb(use_cuda_graph=True))
    with pytest.raises(ConfigError, match="cpu_offload_space"):
        HFContinuousDriver(model, None, generation_config=_gen(), cb_config=_cb(cpu_offload_space=1.0))
    gen = _gen()
    gen.num_return_sequences = 2
    with pytest.raises(ConfigError, match="num_return_sequences"):
        HFContinuousDriver(model, None, generation_config=gen, cb_config=_cb())
    small = capturer_for_model(model, num_slots=8)
    with pytest.raises(ConfigError, match="slots"):
        run_continuous_batching(model, small, {"a": [10, 11, 12]}, generation_config=_gen(2), cb_config=_cb())
    _no_leftover_hooks(model, None)
    # The model still runs plain continuous batching afterwards (wrappers were instance-level and removed).
    out = model.generate_batch([[10, 11, 12]], generation_config=_gen(2),
                               continuous_batching_config=_cb(auto_switch_to_flash=False))
    assert len(next(iter(out.values())).generated_tokens) == 2
