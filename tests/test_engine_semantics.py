"""Engine semantics: prefix caching, chunked prefill, speculative decoding, preemption, aborts,
n > 1, multi-turn, overlap scheduling, P/D disaggregation, EPLB.

A property test drives the capturer with the scheduler simulator of ``engine_sim`` and checks
every stored request bit-exactly against the fake router's ground truth; targeted unit tests
pin each rule down.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_sim import SimConfig, run_sim  # noqa: E402  (test helper next to this file)
from r3rdma import LocalRoutingStore, RoutingCapturer, RoutingReader
from r3rdma.records import RequestRecord
from tests.sinks import ListSink
from r3rdma.errors import (
    CaptureStateError,
    DuplicateRequestError,
    MissingRowsError,
    SegmentGapError,
    SegmentOverlapError,
    ShapeMismatchError,
    StaleSlotError,
    UnknownRequestError,
)

LAYERS = (0, 2, 5)
K = 2
E = 16


def make(num_slots=64, **kw):
    sink = ListSink()
    cap = RoutingCapturer(layer_map=LAYERS, top_k=K, num_experts=kw.pop("num_experts", E), num_slots=num_slots,
                          sink=sink, rollout_id="r", **kw)
    return cap, sink


def row_of(rid: str, pos: int) -> np.ndarray:
    """Deterministic distinct-expert row of (request, position)."""
    rng = np.random.default_rng(abs(hash((rid, pos))) % 2**32)
    return np.stack([rng.choice(E, size=K, replace=False) for _ in LAYERS])


def step(cap, rids, starts, counts, slots, *, accepted=None, content=None):
    """One step; ``content[i]`` names whose rows token i carries (default: its request)."""
    cap.begin_step(rids, starts, counts, slots)
    rows = []
    for rid, s, n in zip(rids, starts, counts):
        for p in range(s, s + n):
            rows.append(row_of(content.get((rid, p), rid) if content else rid, p))
    ids = torch.as_tensor(np.stack(rows)) if rows else torch.zeros((0, len(LAYERS), K), dtype=torch.int64)
    for l, layer in enumerate(LAYERS):
        cap.record(layer, ids[:, l])
    cap.end_step(accepted)


def truth(rid, start, end, owner=None):
    return np.stack([row_of(owner or rid, p) for p in range(start, end)]).astype(np.uint8)


# -- ground truth over many schedules -------------------------------------------------------------

sim_configs = st.builds(
    SimConfig,
    seed=st.integers(0, 2**31 - 1),
    num_prompts=st.integers(1, 7),
    n_samples=st.integers(1, 3),
    fork=st.booleans(),
    max_turns=st.integers(1, 3),
    only_last_turn=st.booleans(),
    block_size=st.sampled_from([1, 2, 4, 8]),
    token_budget=st.integers(2, 24),
    max_running=st.integers(1, 6),
    prefix_caching=st.booleans(),
    release_on_evict=st.booleans(),
    spec_k=st.integers(0, 3),
    spec_accept=st.floats(0.0, 1.0),
    preempt_prob=st.sampled_from([0.0, 0.05, 0.2]),
    abort_prob=st.sampled_from([0.0, 0.03, 0.1]),
    overlap=st.booleans(),
    pd_fraction=st.sampled_from([0.0, 0.5, 1.0]),
    eplb=st.booleans(),
    chunked_moe=st.booleans(),
    padded_router=st.booleans(),
    draft_capture=st.booleans(),
    num_experts=st.sampled_from([16, 300]),
)


def _with_blocks(cfg: SimConfig, factor: int) -> SimConfig:
    # Enough KV for the longest conversation on its own, times a pressure factor.
    cfg.num_blocks = -(-120 // cfg.block_size) * factor + 2
    return cfg


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=sim_configs, factor=st.integers(1, 3))
def test_simulated_engine_matches_ground_truth(cfg, factor):
    with tempfile.TemporaryDirectory() as root:
        run_sim(_with_blocks(cfg, factor), root)


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~275 s on a loaded 2-core machine: the default 300 s left no margin
def test_soak_many_seeds():
    rng = np.random.default_rng(20240601)
    totals: dict[str, int] = {}
    for seed in range(1500):
        cfg = SimConfig(
            seed=seed, num_prompts=int(rng.integers(4, 12)), n_samples=int(rng.integers(1, 4)), fork=bool(rng.integers(2)),
            max_turns=int(rng.integers(1, 4)), only_last_turn=bool(rng.integers(2)),
            block_size=int(rng.choice([1, 2, 4, 8, 16])), token_budget=int(rng.integers(2, 40)),
            max_running=int(rng.integers(1, 8)), prefix_caching=bool(rng.integers(2)),
            release_on_evict=bool(rng.integers(2)), spec_k=int(rng.integers(0, 5)), spec_accept=float(rng.random()),
            preempt_prob=float(rng.choice([0, 0.05, 0.2])), abort_prob=float(rng.choice([0, 0.03, 0.1])),
            overlap=bool(rng.integers(2)), pd_fraction=float(rng.choice([0, 0.3, 1])), eplb=bool(rng.integers(2)),
            chunked_moe=bool(rng.integers(2)), padded_router=bool(rng.integers(2)), draft_capture=bool(rng.integers(2)),
            num_experts=int(rng.choice([16, 64, 300])), max_new=int(rng.integers(1, 24)),
        )
        cfg = _with_blocks(cfg, int(rng.integers(1, 4)))
        with tempfile.TemporaryDirectory() as root:
            try:
                stats = run_sim(cfg, root)
            except Exception as e:
                raise AssertionError(f"soak failed for {cfg}") from e
        for key, value in stats.items():
            totals[key] = totals.get(key, 0) + value
    print("soak totals:", totals)
    for key in ("prefix_hits", "preempted", "aborted", "drafts_accepted", "drafts_rejected", "forks", "pending"):
        assert totals[key] > 0, f"the soak never exercised {key}"


# -- the last row ---------------------------------------------------------------------------------


@pytest.mark.parametrize("reason", ["eos", "length"])
def test_last_sampled_token_has_no_row_whatever_the_finish_reason(reason):
    cap, sink = make()
    step(cap, ["a"], [0], [3], [0, 1, 2])  # prompt of 3 -> token 3
    step(cap, ["a"], [3], [1], [3])  # token 3 in -> token 4 (EOS or budget)
    rec = cap.finish_request("a", prompt_len=3, generated_len=2)
    assert rec.num_rows == 4
    np.testing.assert_array_equal(rec.ids_TLK, truth("a", 0, 4))


def test_overlap_rider_row_is_never_stored():
    """Overlap: the request finished at step N rides along in step N+1; that row is dropped."""
    cap, sink = make()
    step(cap, ["a"], [0], [3], [0, 1, 2])  # samples token 3 = EOS
    cap.begin_step(["a", "b"], [3, 0], [1, 2], [3, 10, 11])  # N+1 launched before N processed
    ids = torch.as_tensor(np.stack([row_of("a", 3), row_of("b", 0), row_of("b", 1)]))
    for l, layer in enumerate(LAYERS):
        cap.record(layer, ids[:, l])
    rec = cap.finish_request("a", prompt_len=3, generated_len=1)  # between launch and end of N+1
    cap.end_step()
    assert rec.num_rows == 3 and cap.active_requests == 1  # only b: a's rider left no state
    np.testing.assert_array_equal(rec.ids_TLK, truth("a", 0, 3))
    cap.abort_request("b")
    assert cap.active_requests == 0 and cap.tracked_positions == 0


def test_abort_during_open_step_leaks_nothing():
    cap, sink = make()
    cap.begin_step(["a"], [0], [2], [0, 1])
    for layer in LAYERS:
        cap.record(layer, torch.zeros((2, K), dtype=torch.int64))
    cap.abort_request("a")
    cap.end_step()
    assert cap.active_requests == 0 and sink.records == [] and cap.requests_aborted == 0  # had no state yet


# -- chunked prefill and chunked MoE --------------------------------------------------------------


def test_chunked_prefill_rows_land_at_their_positions():
    cap, _ = make()
    step(cap, ["a", "b"], [0, 0], [3, 2], [0, 1, 2, 20, 21])
    step(cap, ["b", "a"], [2, 3], [1, 4], [22, 3, 4, 5, 6])  # a's second chunk, b decodes
    step(cap, ["a"], [7], [2], [7, 8])  # a's last chunk
    rec = cap.finish_request("a", prompt_len=9, generated_len=1)
    np.testing.assert_array_equal(rec.ids_TLK, truth("a", 0, 9))


def test_chunked_moe_records_each_chunk_at_its_offset():
    cap, _ = make()
    ids = torch.as_tensor(truth("a", 0, 5).astype(np.int64))
    cap.begin_step(["a"], [0], [5], [0, 1, 2, 3, 4])
    for l, layer in enumerate(LAYERS):
        cap.record(layer, ids[:2, l], token_offset=0)
        cap.record(layer, ids[2:, l], token_offset=2)
    cap.end_step()
    np.testing.assert_array_equal(cap.finish_request("a", prompt_len=5, generated_len=1).ids_TLK, truth("a", 0, 5))


def test_chunked_moe_misuse_is_refused():
    cap, _ = make()
    cap.begin_step(["a"], [0], [4], [0, 1, 2, 3])
    with pytest.raises(CaptureStateError, match="in order"):
        cap.record(0, torch.zeros((2, K), dtype=torch.int64), token_offset=2)  # first chunk must be at 0
    cap.record(0, torch.zeros((2, K), dtype=torch.int64), token_offset=0)
    with pytest.raises(CaptureStateError, match="recorded twice"):
        cap.record(0, torch.zeros((4, K), dtype=torch.int64))
    for layer in LAYERS[1:]:
        cap.record(layer, torch.zeros((4, K), dtype=torch.int64))
    with pytest.raises(CaptureStateError, match=r"MoE layers \[0\]"):
        cap.end_step()  # layer 0 covered 2 of 4 tokens


# -- speculative decoding and draft models --------------------------------------------------------


def test_spec_decode_keeps_only_accepted_rows_with_eos_inside_accepted_drafts():
    cap, _ = make()
    step(cap, ["a"], [0], [3], [0, 1, 2])  # prompt 3 -> token 3
    # Verify step: token 3 plus drafts at 4, 5, 6; drafts 4 and 5 accepted, 6 rejected (its row
    # comes from wrong content); the target's token 5 is EOS, so the sequence is 0..5.
    step(cap, ["a"], [3], [4], [3, 4, 5, 6], accepted=[True, True, True, False], content={("a", 6): "wrong"})
    rec = cap.finish_request("a", prompt_len=3, generated_len=3)  # tokens 3, 4, 5=EOS
    np.testing.assert_array_equal(rec.ids_TLK, truth("a", 0, 5))  # row 5 (EOS as input) not stored


def test_rejected_draft_row_is_never_read():
    cap, _ = make()
    step(cap, ["a"], [0], [2], [0, 1])
    step(cap, ["a"], [1], [3], [1, 2, 3], accepted=[True, False, False], content={("a", 2): "x", ("a", 3): "x"})
    step(cap, ["a"], [2], [1], [2])  # the real token at 2
    rec = cap.finish_request("a", prompt_len=2, generated_len=2)
    np.testing.assert_array_equal(rec.ids_TLK, truth("a", 0, 3))


def test_draft_model_layers_never_reach_the_target():
    target, tsink = make()
    draft = RoutingCapturer(layer_map=(0,), top_k=K, num_experts=E, num_slots=64, rollout_id="r-draft")
    junk = torch.full((2, K), 15, dtype=torch.int64)
    target.begin_step(["a"], [0], [2], [0, 1])
    ids = torch.as_tensor(truth("a", 0, 2).astype(np.int64))
    for l, layer in enumerate(LAYERS):
        target.record(layer, ids[:, l])
        with target.suspended():  # a draft forward through hooks shared with the target
            target.record(layer, junk)
    with pytest.raises(CaptureStateError, match="recorded twice"):
        target.record(0, junk)  # unsuspended draft record of a colliding layer index: refused
    with pytest.raises(ShapeMismatchError, match="not a captured MoE layer"):
        target.record(61, junk)  # an MTP layer the target does not have
    target.end_step()
    draft.begin_step(["a"], [0], [2], [0, 1])
    draft.record(0, junk)
    draft.end_step()
    np.testing.assert_array_equal(target.finish_request("a", prompt_len=2, generated_len=1).ids_TLK, truth("a", 0, 2))
    assert draft.finish_request("a", prompt_len=2, generated_len=1).ids_TLK.max() == 15
    assert target.records_suppressed == len(LAYERS)


# -- preemption, abort ----------------------------------------------------------------------------


def test_preempted_request_recomputed_in_other_slots():
    cap, _ = make()
    step(cap, ["a"], [0], [3], [0, 1, 2])
    step(cap, ["a"], [3], [1], [3])
    cap.preempt_request("a")  # KV freed; slots go to b
    assert cap.active_requests == 0 and cap.requests_preempted == 1
    step(cap, ["b"], [0], [4], [0, 1, 2, 3])
    step(cap, ["a"], [0], [5], [8, 9, 10, 11, 12])  # recompute prompt + generated
    np.testing.assert_array_equal(cap.finish_request("a", prompt_len=3, generated_len=3).ids_TLK, truth("a", 0, 5))
    np.testing.assert_array_equal(cap.finish_request("b", prompt_len=4, generated_len=1).ids_TLK, truth("b", 0, 4))


def test_preempted_request_keeps_the_rows_it_first_computed():
    """A recompute that routes differently (low precision, another batch) does not replace the
    rows of the forwards that sampled the request's tokens; rows past them are the recompute's.
    Preempted twice: the first computation of each position wins. Aborted: nothing is kept."""
    cap, _ = make()
    step(cap, ["a"], [0], [3], [0, 1, 2])
    step(cap, ["a"], [3], [1], [3])
    cap.preempt_request("a")
    recompute = {("a", p): "a-again" for p in range(8)}
    step(cap, ["a"], [0], [5], [8, 9, 10, 11, 12], content=recompute)
    cap.preempt_request("a")
    step(cap, ["a"], [0], [6], [20, 21, 22, 23, 24, 25], content={("a", p): "a-third" for p in range(8)})
    step(cap, ["a"], [6], [1], [26], content=recompute)
    got = cap.finish_request("a", prompt_len=3, generated_len=5).ids_TLK
    want = np.concatenate([truth("a", 0, 4), truth("a-again", 4, 5), truth("a-third", 5, 6), truth("a-again", 6, 7)])
    np.testing.assert_array_equal(got, want)
    # Speculative drafts: only the positions the engine says it had accepted are kept.
    step(cap, ["b"], [0], [4], [0, 1, 2, 3])
    cap.preempt_request("b", computed=2)
    step(cap, ["b"], [0], [5], [30, 31, 32, 33, 34], content={("b", p): "b-again" for p in range(8)})
    got = cap.finish_request("b", prompt_len=4, generated_len=2).ids_TLK
    np.testing.assert_array_equal(got, np.concatenate([truth("b", 0, 2), truth("b-again", 2, 5)]))
    step(cap, ["c"], [0], [4], [0, 1, 2, 3])
    cap.preempt_request("c")
    cap.abort_request("c")
    step(cap, ["c"], [0], [4], [40, 41, 42, 43], content={("c", p): "c-again" for p in range(8)})
    np.testing.assert_array_equal(cap.finish_request("c", prompt_len=4, generated_len=1).ids_TLK, truth("c-again", 0, 4))


def test_preemption_not_announced_and_partial_recompute_is_detected():
    cap, _ = make()
    step(cap, ["a"], [0], [4], [0, 1, 2, 3])
    step(cap, ["b"], [0], [2], [2, 3])  # engine gave a's slots away without telling
    step(cap, ["a"], [0], [2], [8, 9])  # ... and a recomputes only part of it
    with pytest.raises(StaleSlotError, match=r"positions \[2, 3\]"):
        cap.finish_request("a", prompt_len=4, generated_len=1)


# -- prefix caching and slot reuse ----------------------------------------------------------------


def test_prefix_hit_then_slot_reuse_is_detected():
    cap, _ = make()
    step(cap, ["a"], [0], [4], [0, 1, 2, 3])
    cap.finish_request("a", prompt_len=4, generated_len=1)
    cap.attach_cached("b", [0, 1, 2, 3], [0, 1, 2, 3])  # b hits a's cached prefix
    step(cap, ["b"], [4], [1], [4])
    step(cap, ["c"], [0], [2], [2, 3])  # the block is evicted and rewritten before b finishes
    with pytest.raises(StaleSlotError, match=r"positions \[2, 3\]"):
        cap.finish_request("b", prompt_len=5, generated_len=1)


def test_released_slot_is_refused_until_rewritten():
    cap, _ = make()
    step(cap, ["a"], [0], [4], [0, 1, 2, 3])
    cap.finish_request("a", prompt_len=4, generated_len=1)
    cap.release_slots([2, 3])  # evicted from the prefix cache
    with pytest.raises(StaleSlotError, match="released"):
        cap.attach_cached("b", [0, 1, 2, 3], [0, 1, 2, 3])
    step(cap, ["c"], [0], [2], [2, 3])
    cap.attach_cached("d", [0, 1], [2, 3])  # rewritten: valid again (c's rows)
    np.testing.assert_array_equal(cap.finish_request("d", prompt_len=2, generated_len=1).ids_TLK, truth("c", 0, 2))


def test_slot_released_while_a_request_relies_on_it():
    cap, _ = make()
    step(cap, ["a"], [0], [3], [0, 1, 2])
    cap.release_slots([1])
    with pytest.raises(StaleSlotError, match=r"positions \[1\]"):
        cap.finish_request("a", prompt_len=3, generated_len=1)


def test_prefix_hit_gets_the_cached_rows():
    cap, _ = make()
    step(cap, ["a"], [0], [4], [0, 1, 2, 3])
    cap.attach_cached("b", [0, 1, 2], [0, 1, 2])
    step(cap, ["b"], [3], [2], [10, 11], content={("b", 3): "b", ("b", 4): "b"})
    rec = cap.finish_request("b", prompt_len=5, generated_len=1)
    np.testing.assert_array_equal(rec.ids_TLK, np.concatenate([truth("a", 0, 3), truth("b", 3, 5)]))


# -- n > 1 ----------------------------------------------------------------------------------------


def test_n_samples_forked_with_copy_on_write_each_get_full_routing():
    cap, _ = make()
    step(cap, ["s0"], [0], [6], [0, 1, 2, 3, 4, 5], content={("s0", p): "prompt" for p in range(6)})
    # block size 4: positions 0..3 shared, 4..5 copied into each child's own block
    cap.fork_request("s0", "s1", 6, slots=[0, 1, 2, 3, 8, 9])
    cap.fork_request("s0", "s2", 6, slots=[0, 1, 2, 3, 12, 13])
    step(cap, ["s0", "s1", "s2"], [6, 6, 6], [1, 1, 1], [6, 10, 14])
    prompt = truth("prompt", 0, 6)
    rec0 = cap.finish_request("s0", prompt_len=6, generated_len=2)
    step(cap, ["z"], [0], [2], [4, 5])  # s0's last block reused: the children copied it
    for sid in ("s1", "s2"):
        rec = cap.finish_request(sid, prompt_len=6, generated_len=2)
        np.testing.assert_array_equal(rec.ids_TLK, np.concatenate([prompt, truth(sid, 6, 7)]))
    np.testing.assert_array_equal(rec0.ids_TLK, np.concatenate([prompt, truth("s0", 6, 7)]))
    assert cap.active_requests == 1  # z


# -- EPLB -----------------------------------------------------------------------------------------


def test_eplb_physical_replicas_are_stored_as_logical_experts():
    phys_to_logical = torch.as_tensor([3, 0, 1, 2, 3, 0, 1, 2])  # 8 physical slots, 4 logical experts
    cap, _ = make(num_experts=4, expert_map=phys_to_logical)
    cap.begin_step(["a"], [0], [2], [0, 1])
    for layer in LAYERS:
        cap.record(layer, torch.as_tensor([[0, 5], [7, 2]], dtype=torch.int32))
    cap.end_step()
    cap.set_expert_map(torch.arange(4))  # rebalanced: identity from now on
    cap.begin_step(["a"], [2], [1], [2])
    for layer in LAYERS:
        cap.record(layer, torch.as_tensor([[3, 1]]))
    cap.end_step()
    rec = cap.finish_request("a", prompt_len=3, generated_len=1)
    np.testing.assert_array_equal(rec.ids_TLK[:, 0], [[3, 0], [2, 1], [3, 1]])
    with pytest.raises(ShapeMismatchError, match="logical ids"):
        cap.set_expert_map(torch.as_tensor([0, 4]))


# -- multi-turn through the store -----------------------------------------------------------------


def _conversation(cap):
    step(cap, ["c.t0"], [0], [3], [0, 1, 2], content={("c.t0", p): "conv" for p in range(3)})
    step(cap, ["c.t0"], [3], [1], [3], content={("c.t0", 3): "conv"})
    t0 = cap.finish_request("c.t0", prompt_len=3, generated_len=2, store_as="c")  # rows 0..3
    return t0


def test_multi_turn_later_turn_stores_only_its_new_rows(tmp_path):
    cap, sink = make()
    t0 = _conversation(cap)
    # Turn 2: prompt = turn 1's 5 tokens + 2 user tokens; prefix hit on 0..3, computes 4..6, +1 decode.
    cap.attach_cached("c.t1", [0, 1, 2, 3], [0, 1, 2, 3])
    step(cap, ["c.t1"], [4], [3], [4, 5, 6], content={("c.t1", p): "conv" for p in range(4, 7)})
    step(cap, ["c.t1"], [7], [1], [7], content={("c.t1", 7): "conv"})
    t1 = cap.finish_request("c.t1", prompt_len=7, generated_len=2, store_as="c", start_row=t0.num_rows)
    assert (t1.start_row, t1.num_rows, t1.request_id) == (4, 4, "c")
    with LocalRoutingStore(tmp_path) as store:
        store.commit([t0, t1])  # both turns in one batch
    reader = RoutingReader(tmp_path)
    np.testing.assert_array_equal(reader.get_numpy("r", ["c"])["c"], truth("conv", 0, 8))
    packed = reader.get_packed("r", ["c"])
    assert packed.start_rows == (0,) and int(packed.cu_seqlens[-1]) == 8


def test_only_last_turn_keeps_the_latest_turns_full_view(tmp_path):
    cap, _ = make()
    t0 = _conversation(cap)
    cap.attach_cached("c.t1", [0, 1, 2, 3], [0, 1, 2, 3])
    step(cap, ["c.t1"], [4], [3], [4, 5, 6], content={("c.t1", p): "conv" for p in range(4, 7)})
    t1_full = cap.finish_request("c.t1", prompt_len=7, generated_len=1, store_as="c")  # rows 0..6
    with LocalRoutingStore(tmp_path / "plain") as store:
        store.commit([t0])
        with pytest.raises(DuplicateRequestError, match="only start_row 4 would extend it"):
            store.commit([t1_full])  # without only_last_turn a full re-push is a conflict
    with LocalRoutingStore(tmp_path / "olt", only_last_turn=True) as store:
        store.commit([t0])
        store.commit([t1_full])
        with pytest.raises(SegmentOverlapError):
            store.commit([t0])  # the older, shorter view arriving late is refused, never applied
    reader = RoutingReader(tmp_path / "olt")
    np.testing.assert_array_equal(reader.get_numpy("r", ["c"])["c"], truth("conv", 0, 7))


def test_only_last_turn_refuses_an_older_shorter_view(tmp_path, make_record):
    with LocalRoutingStore(tmp_path, only_last_turn=True) as store:
        store.commit([make_record("c", rows=8, seed=1)])
        with pytest.raises(SegmentOverlapError):
            store.commit([make_record("c", rows=5, seed=2)])


# -- prefill/decode disaggregation ----------------------------------------------------------------


def _pd_records(make_record, prompt=6, total=10):
    whole = make_record("q", rows=total, seed=3).ids_TLK
    part = RequestRecord("roll-0", "q", whole[:prompt], (0, 1, 2), 16, start_row=0, final=False)
    final = RequestRecord("roll-0", "q", whole[prompt:], (0, 1, 2), 16, start_row=prompt, total_rows=total)
    return whole, part, final


@pytest.mark.parametrize("order", ["prefill_first", "decode_first", "one_batch"])
def test_pd_segments_become_visible_only_when_complete(tmp_path, make_record, order):
    whole, part, final = _pd_records(make_record)
    reader = RoutingReader(tmp_path)
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("other")])
        if order == "one_batch":
            result = store.commit([final, part])
            assert result.pending == 0
        else:
            first, second = (part, final) if order == "prefill_first" else (final, part)
            assert store.commit([first]).pending == 1
            assert "q" in store.pending("roll-0")
            with pytest.raises(UnknownRequestError, match="pending"):
                reader.get_numpy("roll-0", ["q"])
            assert reader.info("roll-0").request_ids == ("other",)
            assert store.commit([second]).pending == 0
        assert store.pending("roll-0") == {}
        store.require_complete("roll-0")
        assert store.commit([part, final]).duplicates == 2  # retries are idempotent
    np.testing.assert_array_equal(reader.get_numpy("roll-0", ["q"])["q"], whole)
    assert RoutingReader(tmp_path).info("roll-0").total_rows == 10 + 10


def test_pd_gaps_overlaps_and_conflicting_ends(tmp_path, make_record):
    whole, part, final = _pd_records(make_record)
    with LocalRoutingStore(tmp_path) as store:
        short = RequestRecord("roll-0", "q", whole[:4], (0, 1, 2), 16, final=False)
        store.commit([short, final])  # rows 4..5 missing: stays pending
        assert store.pending("roll-0") == {"q": ((0, 4, False), (6, 10, True))}
        with pytest.raises(SegmentGapError, match="incomplete"):
            store.require_complete("roll-0")
        overlapping = RequestRecord("roll-0", "q", whole[3:6] ^ 1, (0, 1, 2), 16, start_row=3, final=False)
        with pytest.raises(SegmentOverlapError, match="overlaps its pending segment rows 0..3"):
            store.commit([overlapping])
        other_end = RequestRecord("roll-0", "q", whole[4:5], (0, 1, 2), 16, start_row=4, total_rows=5)
        with pytest.raises(SegmentOverlapError, match="two final segments"):
            store.commit([other_end])
        store.commit([RequestRecord("roll-0", "q", whole[4:6], (0, 1, 2), 16, start_row=4, final=False)])
        assert store.pending("roll-0") == {}
        with pytest.raises(SegmentOverlapError, match="already stored"):
            store.commit([RequestRecord("roll-0", "q", whole[8:10] ^ 1, (0, 1, 2), 16, start_row=8)])
        beyond = RequestRecord("roll-0", "z", whole[:3], (0, 1, 2), 16, start_row=0, total_rows=3)
        store.commit([RequestRecord("roll-0", "z2", whole[:1], (0, 1, 2), 16, start_row=2, total_rows=3)])
        with pytest.raises(SegmentOverlapError, match="past the request's last row 2"):
            store.commit([RequestRecord("roll-0", "z2", whole[:2], (0, 1, 2), 16, start_row=3, final=False)])
        store.commit([beyond])
        # A later segment first, then the rows before it (issue 19): held pending, then whole.
        store.commit([RequestRecord("roll-0", "late", whole[5:8], (0, 1, 2), 16, start_row=5),
                      RequestRecord("roll-0", "late", whole[:5], (0, 1, 2), 16, final=False)])
        store.discard_pending("roll-0", "z2")
        assert store.pending("roll-0") == {}
    got = RoutingReader(tmp_path).get_numpy("roll-0", ["q", "late"])
    np.testing.assert_array_equal(got["q"], whole)
    np.testing.assert_array_equal(got["late"], whole[:8])


def test_pd_multi_turn_decode_first(tmp_path, make_record):
    """Turn 2 of a conversation through P/D: its prefill part continues turn 1's rows."""
    whole = make_record("c", rows=20, seed=5).ids_TLK
    t1 = RequestRecord("roll-0", "c", whole[:8], (0, 1, 2), 16)
    part = RequestRecord("roll-0", "c", whole[8:13], (0, 1, 2), 16, start_row=8, final=False)
    final = RequestRecord("roll-0", "c", whole[13:], (0, 1, 2), 16, start_row=13, total_rows=12)
    with LocalRoutingStore(tmp_path) as store:
        store.commit([t1])
        store.commit([final])
        assert RoutingReader(tmp_path).get_numpy("roll-0", ["c"])["c"].shape[0] == 8  # turn 2 invisible
        store.commit([part])
    np.testing.assert_array_equal(RoutingReader(tmp_path).get_numpy("roll-0", ["c"])["c"], whole)


def test_pd_capturer_side(tmp_path):
    """Prefill engine pushes rows 0..P-1 as a part; decode engine rows P.. with total_rows."""
    pre, pre_sink = make()
    dec, dec_sink = make()
    step(pre, ["q"], [0], [4], [0, 1, 2, 3])
    pre.finish_request("q", prompt_len=4, generated_len=1, final=False)
    dec.release_slots([8, 9, 10, 11])  # KV arrived by transfer: no routing rows here
    step(dec, ["q"], [4], [1], [12])
    step(dec, ["q"], [5], [1], [13])
    dec.finish_request("q", prompt_len=4, generated_len=3, start_row=4, total_rows=6)
    with LocalRoutingStore(tmp_path) as store:
        store.commit(dec_sink.records)
        store.commit(pre_sink.records)
    np.testing.assert_array_equal(RoutingReader(tmp_path).get_numpy("r", ["q"])["q"], truth("q", 0, 6))


def test_record_segment_fields_validated(make_record):
    ids = make_record("a", rows=4).ids_TLK
    with pytest.raises(ShapeMismatchError, match="final record only"):
        RequestRecord("r", "a", ids, (0, 1, 2), 16, final=False, total_rows=4)
    with pytest.raises(ShapeMismatchError, match="total_rows must be in 4..6"):
        RequestRecord("r", "a", ids, (0, 1, 2), 16, start_row=2, total_rows=7)


def test_missing_rows_still_an_error_after_all_features():
    cap, _ = make()
    step(cap, ["a"], [0], [2], [0, 1])
    with pytest.raises(MissingRowsError):
        cap.finish_request("a", prompt_len=4, generated_len=1)
