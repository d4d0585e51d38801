"""verl and slime hand-off (r3rdma.integrations.rl_frameworks).

Requests go through a real LocalRoutingStore + RoutingWriter and come back through a
RoutingReader; the produced tensors are checked against independent constructions of the
layouts the frameworks build themselves. Neither framework imports here (verl 0.9.1 needs
ray/omegaconf/megatron, slime needs megatron), so the references below transcribe their code:

- verl padded batch: verl 0.9.1 ``verl/experimental/agent_loop/agent_loop.py`` lines 785-809
  (``_agent_loop_postprocess``: int16 zeros ``[1, total_length, L, K]``, ``start_pos =
  prompt_width - len(prompt_ids)``, rows at ``start_pos:start_pos + length``), prompt padded
  ``padding_side="left"`` (line 756), response ``"right"`` (line 763); the batch is the
  concatenation of the samples (line 1075). Multi-turn: ``tool_agent_loop.py`` 286-287 keeps the
  last turn's routing, which covers the whole conversation; ``routed_experts[: len(prompt_ids) +
  response_length]`` (tool_agent_loop.py 205-206, single_turn_agent_loop.py 99-101).
- verl unpadded: ``AgentLoopOutput.as_dict``, agent_loop.py lines 129-141.
- slime: ``np.frombuffer(..., dtype=np.int32).reshape(len(sample.tokens) - 1, args.num_layers,
  args.moe_router_topk)`` (THUDM/slime ``slime/rollout/sglang_rollout.py``) and
  ``fill_routing_replay`` (``slime/backends/megatron_utils/actor.py``, commit 028e290), which asserts
  ``rows == len(tokens) - 1`` and reads ``rollout_routed_experts[:, layer_id]`` for MoE layers only.
- slime's replay validator, restated from two pinned commits (see the helpers' docstrings):
  ``validate_rollout_routed_experts_for_replay`` at 8e3769f (every layer's column checked when
  ``moe_layer_freq`` is an int) and ``validate_routed_experts_tensor`` at 6857224.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3rdma import LocalRoutingStore, RoutingReader, RoutingWriter
from r3rdma.errors import MissingRowsError, ShapeMismatchError, UnknownRequestError
from r3rdma.integrations.rl_frameworks import (
    slime_moe_layers,
    slime_rollout_routed_experts,
    verl_routed_experts,
    verl_routed_experts_unpadded,
)
from r3rdma.read.fetching import RowFetcher
from r3rdma.read.reader import PackedRouting
from r3rdma.records import RequestRecord

K = 2
LAYER_MAP = (1, 3, 4)  # MoE decoder layers of a 5-layer model: 0 and 2 are dense
NUM_DECODER_LAYERS = 5


def _ids(rng, rows, num_experts, dtype):
    ids = rng.integers(0, num_experts, size=(rows, len(LAYER_MAP), K))
    ids[:, 0, 0] = num_experts - 1  # the widest id appears in every row: widening must keep it
    return ids.astype(dtype)


def _write(root, records):
    with LocalRoutingStore(root) as store, RoutingWriter(store, flush_interval_s=0) as writer:
        for rec in records:
            writer.submit(rec)
        writer.flush()


# Samples of rollout "step-1": (request id, prompt tokens, response tokens)
PROMPT_LENGTH, RESPONSE_LENGTH = 8, 6
SAMPLES = [
    ("full", 8, 6),  # fills both windows
    ("short-prompt", 3, 6),  # left pad of 5
    ("short-resp", 8, 2),  # right pad of 4
    ("both", 5, 4),
]


@pytest.fixture
def rollout(tmp_path):
    rng = np.random.default_rng(7)
    rows = {rid: _ids(rng, p + r - 1, 64, np.uint8) for rid, p, r in SAMPLES}
    # A decoy request in the same rollout, which no call below asks for.
    rows["decoy"] = _ids(rng, 30, 64, np.uint8)
    _write(tmp_path, [RequestRecord("step-1", rid, a, LAYER_MAP, 64) for rid, a in rows.items()])
    return tmp_path, rows


def verl_reference(samples, rows, prompt_length, response_length):
    """verl 0.9.1 agent_loop.py 785-809 applied per sample, then concatenated (line 1075)."""
    outs = []
    for rid, p, r in samples:
        prompt_ids = list(range(1, p + 1))
        prompt_padded = [0] * (prompt_length - p) + prompt_ids  # tokenizer.pad(padding_side="left")
        response_padded = list(range(1, r + 1)) + [0] * (response_length - r)  # padding_side="right"
        input_ids = prompt_padded + response_padded
        experts = torch.from_numpy(rows[rid].astype(np.int64))[: p + response_length]
        total_length = len(input_ids)
        length, layer_num, topk_num = experts.shape
        experts_tensor = experts.to(torch.int16)
        routed_experts = torch.zeros(1, total_length, layer_num, topk_num, dtype=experts_tensor.dtype)
        start_pos = len(prompt_padded) - len(prompt_ids)
        end_pos = min(start_pos + length, total_length)
        routed_experts[:, start_pos:end_pos] = experts_tensor.unsqueeze(0)
        outs.append(routed_experts)
    return torch.cat(outs, dim=0)


def verl_per_position(samples, rows, prompt_length, response_length):
    """The same layout written position by position (a second, loop-free-of-verl construction)."""
    total = prompt_length + response_length
    out = np.zeros((len(samples), total, len(LAYER_MAP), K), dtype=np.int64)
    for b, (rid, p, r) in enumerate(samples):
        for t in range(total):
            q = t - (prompt_length - p)  # position of the token at t within the sample
            if 0 <= q < p + r - 1:  # a forward input: it has a row; the last token has none
                out[b, t] = rows[rid][q]
    return out


def test_verl_padded_layout(rollout):
    root, rows = rollout
    with RoutingReader(root) as reader:
        got = verl_routed_experts(
            reader,
            "step-1",
            [s[0] for s in SAMPLES],
            prompt_lens=[s[1] for s in SAMPLES],
            response_lens=[s[2] for s in SAMPLES],
            prompt_length=PROMPT_LENGTH,
            response_length=RESPONSE_LENGTH,
            top_k=K,
        )
    assert got.dtype == torch.int16 and got.shape == (4, PROMPT_LENGTH + RESPONSE_LENGTH, len(LAYER_MAP), K)
    assert torch.equal(got, verl_reference(SAMPLES, rows, PROMPT_LENGTH, RESPONSE_LENGTH))
    np.testing.assert_array_equal(got.numpy(), verl_per_position(SAMPLES, rows, PROMPT_LENGTH, RESPONSE_LENGTH))
    # Left pad of "short-prompt" and right pad of "short-resp" are zero; rows start at start_pos.
    assert not got[1, :5].any() and torch.equal(got[1, 5], torch.from_numpy(rows["short-prompt"][0].astype(np.int16)))
    assert not got[2, 8 + 2 - 1 :].any() and got[2, 8].any()


def test_verl_unpadded_layout(rollout):
    root, rows = rollout
    with RoutingReader(root) as reader:
        got = verl_routed_experts_unpadded(
            reader, "step-1", ["short-resp", "short-prompt"], prompt_lens=[8, 3], response_lens=[2, 6], response_length=RESPONSE_LENGTH
        )
    for tensor, (rid, p, r) in zip(got, [("short-resp", 8, 2), ("short-prompt", 3, 6)]):
        # as_dict: aligned = zeros((prompt + response, ...)); aligned[:num_rows] = routed_experts[:num_rows]
        want = torch.zeros((p + r, len(LAYER_MAP), K), dtype=torch.int16)
        num_rows = min(rows[rid].shape[0], p + r)
        want[:num_rows] = torch.from_numpy(rows[rid].astype(np.int16))[:num_rows]
        assert tensor.dtype == torch.int16 and torch.equal(tensor, want) and not tensor[-1].any()


def test_verl_all_decoder_layers(rollout):
    """num_layers=N: the SGLang layout verl also accepts (index by absolute layer)."""
    root, rows = rollout
    with RoutingReader(root) as reader:
        got = verl_routed_experts(
            reader, "step-1", ["both"], prompt_lens=[5], response_lens=[4], prompt_length=PROMPT_LENGTH,
            response_length=RESPONSE_LENGTH, num_layers=NUM_DECODER_LAYERS,
        )
    assert got.shape == (1, PROMPT_LENGTH + RESPONSE_LENGTH, NUM_DECODER_LAYERS, K)
    assert not got[:, :, [0, 2]].any()  # dense layers
    moe_only = verl_reference([("both", 5, 4)], rows, PROMPT_LENGTH, RESPONSE_LENGTH)
    assert torch.equal(got[:, :, list(LAYER_MAP)], moe_only)


def test_verl_multi_turn(tmp_path):
    """A conversation stored as turn segments reads back whole and lands at start_pos like verl's
    last-turn routing (which covers every earlier turn, tool output included)."""
    rng = np.random.default_rng(3)
    p1, g1, tool, g2 = 4, 3, 2, 3  # prompt, turn-1 generation, tool tokens, turn-2 generation
    turn1_rows = p1 + g1 - 1
    total_rows = p1 + g1 + tool + g2 - 1
    whole = _ids(rng, total_rows, 64, np.uint8)
    _write(tmp_path, [RequestRecord("mt", "conv", whole[:turn1_rows], LAYER_MAP, 64)])
    _write(tmp_path, [RequestRecord("mt", "conv", whole[turn1_rows:], LAYER_MAP, 64, start_row=turn1_rows)])
    # A conversation that ends with tool output after its last generation: no rows for those tokens.
    trailing = _ids(rng, p1 + g1 - 1, 64, np.uint8)
    _write(tmp_path, [RequestRecord("mt", "tool-tail", trailing, LAYER_MAP, 64)])
    response = g1 + tool + g2
    with RoutingReader(tmp_path) as reader:
        got = verl_routed_experts(
            reader, "mt", ["conv"], prompt_lens=[p1], response_lens=[response], prompt_length=6, response_length=10
        )
        assert torch.equal(got, verl_reference([("conv", p1, response)], {"conv": whole}, 6, 10))
        with pytest.raises(ShapeMismatchError, match="allow_unrouted_tail=True"):
            verl_routed_experts(reader, "mt", ["tool-tail"], prompt_lens=[p1], response_lens=[g1 + tool], prompt_length=6, response_length=10)
        got = verl_routed_experts(
            reader, "mt", ["tool-tail"], prompt_lens=[p1], response_lens=[g1 + tool], prompt_length=6,
            response_length=10, allow_unrouted_tail=True,
        )
        unpadded = verl_routed_experts_unpadded(
            reader, "mt", ["tool-tail"], prompt_lens=[p1], response_lens=[g1 + tool], response_length=10,
            allow_unrouted_tail=True,
        )[0]
    # The tool tokens (positions n .. want - 1) have no rows. verl 0.9.1 replays every row but the
    # last (no replay mask), so they get the spread fill, never K copies of expert 0.
    n, want, start = p1 + g1 - 1, p1 + g1 + tool - 1, 6 - p1
    spread = (np.arange(n, want)[:, None] * K + np.arange(K)[None, :]) % 64
    extended = np.concatenate([trailing.astype(np.int64), np.repeat(spread[:, None, :], len(LAYER_MAP), axis=1)])
    assert torch.equal(got, verl_reference([("tool-tail", p1, g1 + tool)], {"tool-tail": extended}, 6, 10))
    tail = got[0, start + n : start + want]
    assert tail.shape[0] == tool
    assert all(len(set(row)) == K for row in tail.reshape(-1, K).tolist())  # duplicate-free
    assert not (tail == 0).all(dim=-1).any()  # no token-layer sent wholly to expert 0
    assert not got[0, start + want :].any()  # the last token and the right pad stay 0, as in verl
    assert torch.equal(unpadded[:want], torch.from_numpy(extended).to(torch.int16)) and not unpadded[want:].any()


def test_verl_truncated_response_keeps_verl_slice(tmp_path):
    """The engine generated 9 tokens, verl kept response_length=5: it slices rows to prompt + 5."""
    rng = np.random.default_rng(5)
    ids = _ids(rng, 3 + 9 - 1, 64, np.uint8)
    _write(tmp_path, [RequestRecord("tr", "long", ids, LAYER_MAP, 64)])
    with RoutingReader(tmp_path) as reader:
        got = verl_routed_experts(reader, "tr", ["long"], prompt_lens=[3], response_lens=[5], prompt_length=4, response_length=5)
        assert torch.equal(got, verl_reference([("long", 3, 5)], {"long": ids}, 4, 5))
        assert got[0, -1].any()  # position 8 is an input of the longer generation: it has a row
        with pytest.raises(ShapeMismatchError, match="more than the prompt 3 \\+ response 4"):
            verl_routed_experts(reader, "tr", ["long"], prompt_lens=[3], response_lens=[4], prompt_length=4, response_length=5)


def test_slime_all_layers_with_dense(rollout):
    root, rows = rollout
    with RoutingReader(root) as reader:
        got = slime_rollout_routed_experts(
            reader, "step-1", ["short-prompt", "full"], token_lens=[3 + 6, 8 + 6], num_layers=NUM_DECODER_LAYERS,
            top_k=K, moe_layer_freq=[0, 1, 0, 1, 1],
        )
    for arr, rid, n_tokens in zip(got, ["short-prompt", "full"], [9, 14]):
        assert isinstance(arr, np.ndarray) and arr.dtype == np.int32
        assert arr.shape == (n_tokens - 1, NUM_DECODER_LAYERS, K)  # slime's reshape(len(tokens) - 1, L, K)
        # dense layers (0 and 2): the spread fill (p * K + j) % E, which slime never replays
        spread = (np.arange(n_tokens - 1)[:, None] * K + np.arange(K)[None, :]) % 64
        want = np.repeat(spread[:, None, :], NUM_DECODER_LAYERS, axis=1).astype(np.int32)
        for moe_ordinal, layer in enumerate(LAYER_MAP):
            want[:, layer] = rows[rid][:, moe_ordinal]
        np.testing.assert_array_equal(arr, want)
        # what fill_routing_replay records: rollout_routed_experts[:, layer_id] for MoE layers only
        for moe_ordinal, layer_id in enumerate(slime_moe_layers(NUM_DECODER_LAYERS, [0, 1, 0, 1, 1])):
            np.testing.assert_array_equal(torch.from_numpy(arr)[:, layer_id].numpy(), rows[rid][:, moe_ordinal])


def test_slime_moe_layer_freq_mismatch_and_rows(rollout):
    root, _ = rollout
    with RoutingReader(root) as reader:
        with pytest.raises(ShapeMismatchError, match="makes the trainer replay layers \\[0, 2, 4\\]"):
            slime_rollout_routed_experts(reader, "step-1", ["full"], token_lens=[14], num_layers=5, moe_layer_freq=2)
        with pytest.raises(ShapeMismatchError, match="does not fit a model of 4 decoder layers"):
            slime_rollout_routed_experts(reader, "step-1", ["full"], token_lens=[14], num_layers=4)
        with pytest.raises(ShapeMismatchError, match="slime needs len\\(tokens\\) - 1 = 14"):
            slime_rollout_routed_experts(reader, "step-1", ["full"], token_lens=[15], num_layers=5)
        with pytest.raises(ShapeMismatchError, match="top-4; the rollout stores top-2"):
            slime_rollout_routed_experts(reader, "step-1", ["full"], token_lens=[14], num_layers=5, top_k=4)
        with pytest.raises(ShapeMismatchError, match="token_lens lists 1 lengths for 2 requests"):
            slime_rollout_routed_experts(reader, "step-1", ["full", "both"], token_lens=[14], num_layers=5)


def test_unknown_request_and_missing_prefix(rollout):
    root, _ = rollout
    rng = np.random.default_rng(11)
    # Only a later turn was stored (rows 6..9): the store keeps it pending (or, where a store
    # commits it, it starts at row 6); either way no layout may replay rows 0..5 as zeros.
    _write(root, [RequestRecord("step-1", "late-turn", _ids(rng, 4, 64, np.uint8), LAYER_MAP, 64, start_row=6, total_rows=4)])
    with RoutingReader(root) as reader:
        with pytest.raises(UnknownRequestError, match="nope"):
            verl_routed_experts(reader, "step-1", ["full", "nope"], prompt_lens=[8, 1], response_lens=[6, 1], prompt_length=8, response_length=6)
        with pytest.raises(UnknownRequestError, match="nope"):
            slime_rollout_routed_experts(reader, "step-1", ["nope"], token_lens=[5], num_layers=5)
        with pytest.raises((UnknownRequestError, MissingRowsError)):
            slime_rollout_routed_experts(reader, "step-1", ["late-turn"], token_lens=[11], num_layers=5)
        with pytest.raises((UnknownRequestError, MissingRowsError)):
            verl_routed_experts(reader, "step-1", ["late-turn"], prompt_lens=[6], response_lens=[5], prompt_length=8, response_length=6)
        with pytest.raises(ShapeMismatchError, match="do not fit prompt_length 8"):
            verl_routed_experts(reader, "step-1", ["full"], prompt_lens=[9], response_lens=[4], prompt_length=8, response_length=6)


class _PackedReader:
    """A reader whose answer starts at row 6, as ``PackedRouting.start_rows`` allows (a store
    that committed only later turns): the layouts must refuse it, not pad it with zeros."""

    def __init__(self, ids):
        self.ids = ids

    def get_packed(self, rollout_id, request_ids):
        request_ids = list(request_ids)
        return PackedRouting(
            request_ids=tuple(request_ids),
            ids_TLK=torch.from_numpy(self.ids),
            cu_seqlens=torch.tensor([0, self.ids.shape[0]], dtype=torch.int32),
            start_rows=(6,),
            layer_map=LAYER_MAP,
            num_experts=64,
        )


def test_rows_starting_after_position_zero_are_refused():
    reader = _PackedReader(_ids(np.random.default_rng(2), 4, 64, np.uint8))
    with pytest.raises(MissingRowsError, match="positions 0..5 have no routing rows"):
        slime_rollout_routed_experts(reader, "r", ["late"], token_lens=[11], num_layers=5)
    with pytest.raises(MissingRowsError, match="positions 0..5"):
        verl_routed_experts(reader, "r", ["late"], prompt_lens=[6], response_lens=[5], prompt_length=8, response_length=6)
    with pytest.raises(MissingRowsError, match="positions 0..5"):
        verl_routed_experts_unpadded(reader, "r", ["late"], prompt_lens=[6], response_lens=[5], response_length=6)


def test_reads_only_the_requested_share(rollout, monkeypatch):
    root, _ = rollout
    seen = []
    original = RowFetcher.read

    def spy(self, rollout_id, merged, request_ids, *args, **kwargs):  # every read of rows goes through here
        seen.append(list(request_ids))
        return original(self, rollout_id, merged, request_ids, *args, **kwargs)

    monkeypatch.setattr(RowFetcher, "read", spy)
    with RoutingReader(root) as reader:
        verl_routed_experts(reader, "step-1", ["both"], prompt_lens=[5], response_lens=[4], prompt_length=8, response_length=6)
        slime_rollout_routed_experts(reader, "step-1", ["short-resp"], token_lens=[10], num_layers=5)
        # An empty share reads nothing, and still has the rollout's geometry.
        empty = verl_routed_experts(reader, "step-1", [], prompt_lens=[], response_lens=[], prompt_length=8, response_length=6)
        assert empty.shape == (0, 14, len(LAYER_MAP), K)
    assert seen == [["both"], ["short-resp"]]


@pytest.mark.parametrize(
    "num_experts, stored",
    [(256, np.uint8), (1000, np.uint16), (32768, np.uint16)],
)
def test_widening_keeps_every_id(tmp_path, num_experts, stored):
    """uint8 ids up to 255 and uint16 ids (> 255, up to verl's int16 limit) survive both layouts."""
    rng = np.random.default_rng(num_experts)
    ids = _ids(rng, 9, num_experts, stored)
    rec = RequestRecord("wide", "w", ids, LAYER_MAP, num_experts)
    assert rec.ids_TLK.dtype == stored
    _write(tmp_path, [rec])
    with RoutingReader(tmp_path) as reader:
        verl = verl_routed_experts(reader, "wide", ["w"], prompt_lens=[4], response_lens=[6], prompt_length=4, response_length=6)
        verl_all = verl_routed_experts(
            reader, "wide", ["w"], prompt_lens=[4], response_lens=[6], prompt_length=4, response_length=6, num_layers=5
        )
        (slime,) = slime_rollout_routed_experts(reader, "wide", ["w"], token_lens=[10], num_layers=5)
    assert torch.equal(verl_all[:, :, list(LAYER_MAP)], verl) and not verl_all[:, :, [0, 2]].any()
    assert verl.dtype == torch.int16 and int(verl.max()) == num_experts - 1 and int(verl.min()) >= 0
    np.testing.assert_array_equal(verl[0, :9].numpy().astype(np.int64), ids.astype(np.int64))
    assert slime.dtype == np.int32 and int(slime.max()) == num_experts - 1
    np.testing.assert_array_equal(slime[:, list(LAYER_MAP)].astype(np.int64), ids.astype(np.int64))


def test_verl_refuses_ids_beyond_int16(tmp_path):
    rng = np.random.default_rng(1)
    ids = _ids(rng, 5, 40000, np.uint16)
    _write(tmp_path, [RequestRecord("huge", "h", ids, LAYER_MAP, 40000)])
    with RoutingReader(tmp_path) as reader:
        with pytest.raises(ShapeMismatchError, match="int16"):
            verl_routed_experts(reader, "huge", ["h"], prompt_lens=[3], response_lens=[3], prompt_length=3, response_length=3)
        (slime,) = slime_rollout_routed_experts(reader, "huge", ["h"], token_lens=[6], num_layers=5)
    assert int(slime.max()) == 39999  # slime's int32 holds them


def _slime_validator_8e3769f(routed_experts, num_layers, topk, moe_layer_freq):
    """The rule of slime's ``validate_rollout_routed_experts_for_replay`` at THUDM/slime commit
    8e3769fc45fea5951b4854ad460bcb371ffa7c09 (``slime/observability/rollout_data_utils.py``),
    restated here because slime does not import on CPU (megatron, sglang, ray): shape must be
    ``(rows > 0, num_layers, topk)``; the layers checked are those whose ``moe_layer_freq`` list
    entry is non-zero, or *every* layer when ``moe_layer_freq`` is an int (or None); with
    ``topk > 1`` a checked layer whose column holds only zeros over the whole sample is refused
    ("capture is all zero for MoE layers ...")."""
    if isinstance(moe_layer_freq, (list, tuple)):
        checked = [layer for layer, freq in enumerate(moe_layer_freq[:num_layers]) if int(freq) != 0]
    else:
        checked = list(range(num_layers))
    for experts in routed_experts:
        experts = torch.as_tensor(experts)
        if experts.ndim != 3 or tuple(experts.shape[1:]) != (num_layers, topk) or experts.shape[0] == 0:
            raise ValueError(f"shape {tuple(experts.shape)}")
        if topk > 1:
            zero = [layer for layer in checked if not torch.count_nonzero(experts[:, layer, :])]
            if zero:
                raise ValueError(f"R3 routed-experts capture is all zero for MoE layers {zero}")


def _slime_validator_6857224(experts, num_layers, topk, moe_layer_freq, num_experts):
    """The per-sample rule of slime's ``validate_routed_experts_tensor`` at THUDM/slime commit
    68572249359201b42bd2020a584c370bc8b403e1 (``slime/utils/routed_experts.py``), restated: an int
    ``moe_layer_freq`` checks layers ``layer % freq == 0``; with ``topk > 1`` no checked layer may
    be all zero, no (token, layer) pair may be all zero unless the token's whole row is (holes
    of whole rows are tolerated up to max(64, rows // 100)); checked ids must lie in [0, E)."""
    if isinstance(moe_layer_freq, (list, tuple)):
        checked = [layer for layer, freq in enumerate(moe_layer_freq[:num_layers]) if int(freq) != 0]
    elif isinstance(moe_layer_freq, int) and moe_layer_freq > 0:
        checked = [layer for layer in range(num_layers) if layer % moe_layer_freq == 0]
    else:
        checked = list(range(num_layers))
    experts = torch.as_tensor(experts)
    assert experts.ndim == 3 and tuple(experts.shape[1:]) == (num_layers, topk) and experts.shape[0] > 0
    routes = experts[:, checked, :].to(torch.int64)
    if topk > 1:
        present = (routes != 0).any(dim=-1)  # [rows, checked layers]
        if not present.any(dim=0).all():
            raise ValueError("all zero for MoE layers")
        whole_row_missing = (~present).all(dim=1, keepdim=True)
        if ((~present) & ~whole_row_missing).any():
            raise ValueError("all zero for token/layer pairs")
        if int(whole_row_missing.sum()) > max(64, experts.shape[0] // 100):
            raise ValueError("too many rows without routing")
    if ((routes < 0) | (routes >= num_experts)).any():
        raise ValueError("ids out of range")


def test_slime_layout_passes_slimes_replay_validator(tmp_path):
    """Issue 30: with ``moe_layer_freq`` an int > 1 and top-k > 1, slime's validator (8e3769f)
    checks every layer's column; r3rdma's dense columns used to be all 0 and were refused. The
    default spread fill passes both pinned rules; an explicit ``dense_fill=0`` still fails the
    first, which shows the check bites."""
    layer_map, num_layers, freq, experts = (0, 2, 4), 5, 2, 16
    rng = np.random.default_rng(11)
    token_lens = [9, 30]
    # what a router records: K distinct experts per token and layer (expert 0 included at times)
    rows = {f"s{i}": np.stack([np.stack([rng.permutation(experts)[:K] for _ in layer_map]) for _ in range(n - 1)])
            .astype(np.uint8) for i, n in enumerate(token_lens)}
    _write(tmp_path, [RequestRecord("sl", rid, a, layer_map, experts) for rid, a in rows.items()])
    with RoutingReader(tmp_path) as reader:
        got = slime_rollout_routed_experts(reader, "sl", list(rows), token_lens=token_lens, num_layers=num_layers,
                                           top_k=K, moe_layer_freq=freq)
        zero_filled = slime_rollout_routed_experts(reader, "sl", list(rows), token_lens=token_lens,
                                                   num_layers=num_layers, top_k=K, moe_layer_freq=freq, dense_fill=0)
    _slime_validator_8e3769f(got, num_layers, K, freq)
    for arr in got:
        _slime_validator_6857224(arr, num_layers, K, freq, experts)
    with pytest.raises(ValueError, match=r"all zero for MoE layers \[1, 3\]"):
        _slime_validator_8e3769f(zero_filled, num_layers, K, freq)
    for arr, zeros, (rid, a) in zip(got, zero_filled, rows.items()):
        np.testing.assert_array_equal(arr[:, list(layer_map)], a)  # the replayed layers are the routing
        np.testing.assert_array_equal(zeros[:, list(layer_map)], a)
        assert all(len(set(r)) == K for r in arr[:, [1, 3]].reshape(-1, K).tolist())  # dense: duplicate-free
