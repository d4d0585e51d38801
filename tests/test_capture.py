"""RoutingCapturer: row semantics, slot table, error detection (engine-agnostic, fake router)."""

import numpy as np
import pytest
import torch

from r3rdma import RoutingCapturer
from r3rdma.capture import num_routing_rows
from r3rdma.errors import CaptureStateError, MissingRowsError, ShapeMismatchError, StaleSlotError
from tests.sinks import ListSink


def fake_topk(request_ids, starts, counts, layer, k, num_experts):
    """Deterministic ids from (request, position, layer)."""
    rows = []
    for rid, s, n in zip(request_ids, starts, counts):
        for p in range(s, s + n):
            base = hash((rid, p, layer)) % num_experts
            rows.append([(base + j * 7) % num_experts for j in range(k)])
    return torch.tensor(rows, dtype=torch.long).reshape(-1, k)


def run_step(cap, request_ids, starts, counts, slots, *, num_experts=None, accepted=None):
    num_experts = num_experts or cap.num_experts
    cap.begin_step(request_ids, starts, counts, slots)
    for layer in cap.layer_map:
        cap.record(layer, fake_topk(request_ids, starts, counts, layer, cap.top_k, num_experts))
    cap.end_step(accepted)


def expected(rid, rows, cap, num_experts=None):
    num_experts = num_experts or cap.num_experts
    out = np.stack([fake_topk([rid], [0], [rows], layer, cap.top_k, num_experts).numpy() for layer in cap.layer_map], axis=1)
    return out


def make(num_experts=16, slots=64, layers=(0, 2, 3), k=2):
    sink = ListSink()
    return RoutingCapturer(layer_map=layers, top_k=k, num_experts=num_experts, num_slots=slots, sink=sink), sink


def test_rows_are_prompt_plus_generated_minus_one():
    assert num_routing_rows(5, 3) == 7
    assert num_routing_rows(5, 1) == 5
    cap, sink = make()
    # prefill 5 tokens, then 2 decode steps; 3 tokens generated, the last never an input.
    run_step(cap, ["a"], [0], [5], [10, 11, 12, 13, 14])
    run_step(cap, ["a"], [5], [1], [15])
    run_step(cap, ["a"], [6], [1], [16])
    rec = cap.finish_request("a", prompt_len=5, generated_len=3)
    assert rec.ids_TLK.shape == (7, 3, 2) and rec.ids_TLK.dtype == np.uint8
    np.testing.assert_array_equal(rec.ids_TLK, expected("a", 7, cap))
    assert sink.records == [rec] and cap.active_requests == 0


def test_extra_computed_row_is_not_stored():
    """An engine that already fed the last sampled token (overlap) must not store that row."""
    cap, _ = make()
    run_step(cap, ["a"], [0], [4], [0, 1, 2, 3])
    run_step(cap, ["a"], [4], [1], [4])  # the token sampled at step 1 was fed...
    rec = cap.finish_request("a", prompt_len=4, generated_len=1)  # ...but the request ended at 1 token
    assert rec.num_rows == 4


def test_missing_row_is_an_error_not_zeros():
    cap, _ = make()
    run_step(cap, ["a"], [0], [4], [0, 1, 2, 3])
    with pytest.raises(MissingRowsError, match=r"positions were never computed \(first: \[4, 5\]\)"):
        cap.finish_request("a", prompt_len=4, generated_len=3)


def test_unknown_request_finish():
    cap, _ = make()
    with pytest.raises(MissingRowsError, match="no step ever computed it"):
        cap.finish_request("ghost", prompt_len=3, generated_len=2)


def test_interleaved_requests_and_slot_reuse():
    cap, sink = make(slots=8)
    run_step(cap, ["a", "b"], [0, 0], [3, 2], [0, 1, 2, 3, 4])
    run_step(cap, ["a", "b"], [3, 2], [1, 1], [5, 6])
    ra = cap.finish_request("a", prompt_len=3, generated_len=2)
    # a's slots 0,1,2,5 are freed and reused by c while b is still running.
    run_step(cap, ["b", "c"], [3, 0], [1, 3], [7, 0, 1, 2])
    rb = cap.finish_request("b", prompt_len=2, generated_len=3)
    rc = cap.finish_request("c", prompt_len=3, generated_len=1)
    np.testing.assert_array_equal(ra.ids_TLK, expected("a", 4, cap))
    np.testing.assert_array_equal(rb.ids_TLK, expected("b", 4, cap))
    np.testing.assert_array_equal(rc.ids_TLK, expected("c", 3, cap))


def test_slot_rewritten_before_finish_is_detected():
    cap, _ = make(slots=8)
    run_step(cap, ["a"], [0], [3], [0, 1, 2])
    # The engine (wrongly) hands slot 1 to another request before a finished.
    run_step(cap, ["b"], [0], [1], [1])
    with pytest.raises(StaleSlotError, match=r"positions \[1\]"):
        cap.finish_request("a", prompt_len=3, generated_len=1)


def test_prefix_cache_hit_gets_cached_rows():
    cap, _ = make()
    run_step(cap, ["a"], [0], [4], [0, 1, 2, 3])
    # b shares a's first 3 positions (same tokens, cached KV in slots 0..2) and computes position 3 itself.
    cap.attach_cached("b", [0, 1, 2], [0, 1, 2])
    run_step(cap, ["b"], [3], [1], [9])
    rb = cap.finish_request("b", prompt_len=4, generated_len=1)
    np.testing.assert_array_equal(rb.ids_TLK[:3], expected("a", 3, cap))
    np.testing.assert_array_equal(rb.ids_TLK[3], expected("b", 4, cap)[3])


def test_attach_to_never_written_slot_refused():
    cap, _ = make()
    with pytest.raises(StaleSlotError, match="never written"):
        cap.attach_cached("b", [0, 1], [5, 6])


@pytest.mark.parametrize("num_experts, dtype", [(256, np.uint8), (300, np.uint16), (65536, np.uint16), (70000, np.int32)])
def test_dtype_rule_and_bit_exact_wide_ids(num_experts, dtype):
    cap, _ = make(num_experts=num_experts)
    ids = torch.tensor([[num_experts - 1, 0], [num_experts // 2 + 1, 255]])
    cap.begin_step(["a"], [0], [2], [0, 1])
    for layer in cap.layer_map:
        cap.record(layer, ids)
    cap.end_step()
    rec = cap.finish_request("a", prompt_len=2, generated_len=1)
    assert rec.ids_TLK.dtype == dtype
    np.testing.assert_array_equal(rec.ids_TLK[:, 0].astype(np.int64), ids.numpy())


def test_router_rows_select_tokens_from_padded_router_input():
    cap, _ = make()
    padded = torch.tensor([[9, 9], [1, 2], [3, 4], [9, 9]])  # rows 0 and 3 are padding
    cap.begin_step(["a"], [0], [2], [0, 1], router_rows=torch.tensor([1, 2]))
    for layer in cap.layer_map:
        cap.record(layer, padded)
    cap.end_step()
    rec = cap.finish_request("a", prompt_len=2, generated_len=1)
    np.testing.assert_array_equal(rec.ids_TLK[:, 1], [[1, 2], [3, 4]])


def test_accepted_mask_keeps_only_accepted_tokens():
    cap, _ = make()
    run_step(cap, ["a"], [0], [3], [0, 1, 2])
    # speculative verify of 3 tokens at positions 3,4,5; only the first two accepted.
    run_step(cap, ["a"], [3], [3], [3, 4, 5], accepted=[True, True, False])
    rec = cap.finish_request("a", prompt_len=3, generated_len=3)  # rows 0..4
    np.testing.assert_array_equal(rec.ids_TLK, expected("a", 5, cap))
    with pytest.raises(MissingRowsError):
        run_step(cap, ["b"], [0], [2], [10, 11], accepted=[True, False])
        cap.finish_request("b", prompt_len=2, generated_len=1)


def test_protocol_errors():
    cap, _ = make()
    with pytest.raises(CaptureStateError, match="outside"):
        cap.record(0, torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(CaptureStateError, match="without begin_step"):
        cap.end_step()
    cap.begin_step(["a"], [0], [2], [0, 1])
    with pytest.raises(CaptureStateError, match="twice"):
        cap.begin_step(["a"], [0], [2], [0, 1])
    with pytest.raises(ShapeMismatchError, match="not a captured MoE layer"):
        cap.record(1, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ShapeMismatchError, match=r"expected top-k ids \[T, 2\]"):
        cap.record(0, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ShapeMismatchError, match="announced 2 tokens but the router produced 3"):
        cap.record(0, torch.zeros(3, 2, dtype=torch.long))
    cap.record(0, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(CaptureStateError, match="recorded twice"):
        cap.record(0, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(CaptureStateError, match=r"MoE layers \[2, 3\]"):
        cap.end_step()


@pytest.mark.parametrize(
    "args, match",
    [
        ((["a"], [0], [2], [0]), "one slot per token"),
        ((["a"], [0], [2], [0, 0]), "appears twice"),
        ((["a"], [0], [2], [0, 64]), r"slots must be in 0\.\.63"),
        ((["a", "b"], [0], [2], [0, 1]), "one entry per request"),
        ((["a", "b"], [0, 0], [2], [0, 1]), "one entry per request"),
        ((["a", "b"], [0, 0], 2, [0, 1]), "one slot per token"),
    ],
)
def test_bad_step_announcements(args, match):
    cap, _ = make()
    with pytest.raises(ShapeMismatchError, match=match):
        cap.begin_step(*args)


def test_one_token_count_for_every_request_is_the_same_step():
    """``num_tokens`` as one int (a decode step) stores what the per-request list stores."""
    stored = {}
    for counts in ([1, 1], 1, [2, 2], 2):
        cap, _ = make()
        run_step(cap, ["a", "b"], [0, 0], [3, 3], [0, 1, 2, 3, 4, 5])
        per = counts if isinstance(counts, int) else counts[0]
        cap.begin_step(["a", "b"], [3, 3], counts, list(range(6, 6 + 2 * per)))
        for layer in cap.layer_map:
            cap.record(layer, fake_topk(["a", "b"], [3, 3], [per, per], layer, cap.top_k, cap.num_experts))
        cap.end_step()
        recs = [cap.finish_request(r, prompt_len=3, generated_len=per + 1) for r in ("a", "b")]
        stored[counts if isinstance(counts, int) else f"list{per}"] = [r.ids_TLK for r in recs]
    for per in (1, 2):
        for a, b in zip(stored[per], stored[f"list{per}"], strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(stored[per][0], expected("a", 3 + per, make()[0]))


def test_abort_releases_state_and_stores_nothing():
    cap, sink = make()
    run_step(cap, ["a"], [0], [3], [0, 1, 2])
    assert cap.active_requests == 1
    cap.abort_request("a")
    assert cap.active_requests == 0 and sink.records == []


def test_failed_forward_cancels_step():
    cap, sink = make()
    # A forward over "a" (4 tokens) and "b" (3 tokens) fails after its first MoE layer recorded.
    cap.begin_step(["a", "b"], [0, 0], [4, 3], [0, 1, 2, 3, 8, 9, 10])
    cap.record(cap.layer_map[0], torch.full((7, cap.top_k), cap.num_experts - 1))
    cap.cancel_step()
    assert cap.rows_captured == 0
    with pytest.raises(MissingRowsError):  # none of the cancelled step's rows count
        cap.finish_request("b", prompt_len=3, generated_len=1)
    run_step(cap, ["a"], [0], [4], [0, 1, 2, 3])  # the engine retries "a": a fresh step works
    rec = cap.finish_request("a", prompt_len=4, generated_len=1)
    np.testing.assert_array_equal(rec.ids_TLK, expected("a", 4, cap))  # the retried rows, not the cancelled ones
    assert [r.request_id for r in sink.records] == ["a"] and cap.rows_captured == 4


def test_gpu_direct_needs_a_sink_that_pushes_device_memory():
    from r3rdma.errors import ConfigError

    with pytest.raises(ConfigError, match="gpu_direct' needs a sink"):
        RoutingCapturer(layer_map=(0,), top_k=2, num_experts=16, num_slots=8, sink=ListSink(), transfer_mode="gpu_direct")
    with pytest.raises(ConfigError, match="transfer_mode must be"):
        RoutingCapturer(layer_map=(0,), top_k=2, num_experts=16, num_slots=8, transfer_mode="rdma")
    assert RoutingCapturer(layer_map=(0,), top_k=2, num_experts=16, num_slots=8, transfer_mode="auto").transfer_mode == "staged"
