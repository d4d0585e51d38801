"""The capturer stores rows the engine reused from a stored request's KV once (#35).

A prefix-cache hit or a fork makes a request hold the very (slot, generation) pairs of the
request that computed them: its record then carries only its own rows and a SharedPrefix
naming the stored request, and the store resolves it. Two computations of the same prefix are
never shared. Read back, every request's rows equal what a capturer that shares nothing stores.
"""

import numpy as np
import pytest

from r3rdma import RoutingCapturer, RoutingReader
from r3rdma.bench.group_bench import rows_stored
from r3rdma.capture.stored_prefixes import StoredPrefixes
from r3rdma.store.local_store import LocalRoutingStore
from r3rdma.write.writer import RoutingWriter
from tests.sinks import ListSink
from tests.test_capture import expected, fake_topk, run_step

LAYERS, K, E = (0, 1, 3), 2, 16


def _capturer(root, *, share=None):
    writer = RoutingWriter(LocalRoutingStore(root), owns_store=True, flush_interval_s=0.0)
    cap = RoutingCapturer(layer_map=LAYERS, top_k=K, num_experts=E, num_slots=512, sink=writer, rollout_id="r",
                          owns_sink=True, share_prefixes=share)
    return cap, writer


def _grpo(cap, writer):
    """a computes a 40-token prompt and decodes; b hits a's first 32 positions (2 blocks) and
    computes the rest itself; c is forked from a's prefill; d computes the same prompt again (its
    own prefill). Records each request's submitted record."""
    sent = {}
    hand_over = writer.hand_over

    def spy(record):
        sent[record.request_id] = record
        hand_over(record)

    writer.hand_over = spy  # what the capturer calls (RoutingWriter.hand_over)
    run_step(cap, ["a"], [0], [40], list(range(40)))
    cap.fork_request("a", "c", 40)  # n > 1: c starts from a's prefill
    run_step(cap, ["a"], [40], [1], [40])
    run_step(cap, ["a"], [41], [1], [41])
    cap.finish_request("a", prompt_len=40, generated_len=3)
    cap.attach_cached("b", range(32), range(32))
    run_step(cap, ["b"], [32], [8], list(range(100, 108)))
    run_step(cap, ["b"], [40], [1], [108])
    cap.finish_request("b", prompt_len=40, generated_len=2)
    run_step(cap, ["c"], [40], [1], [200])
    cap.finish_request("c", prompt_len=40, generated_len=2)
    run_step(cap, ["d"], [0], [40], list(range(300, 340)))
    cap.finish_request("d", prompt_len=40, generated_len=1)
    cap.flush()
    writer.flush()
    return sent


def test_prefix_hits_and_forks_reference_the_stored_rows(tmp_path):
    cap, writer = _capturer(tmp_path / "shared")
    with cap:
        sent = _grpo(cap, writer)
    assert sent["a"].shared_prefix is None and sent["a"].start_row == 0
    assert (sent["b"].shared_prefix.request_id, sent["b"].shared_prefix.rows, sent["b"].start_row) == ("a", 32, 32)
    assert sent["b"].ids_TLK.shape[0] == 41 - 32
    assert (sent["c"].shared_prefix.request_id, sent["c"].shared_prefix.rows) == ("a", 40)
    assert sent["d"].shared_prefix is None  # the same prompt computed again: its own rows, stored whole

    whole, w2 = _capturer(tmp_path / "whole", share=False)
    with whole:
        sent_whole = _grpo(whole, w2)
    assert all(r.shared_prefix is None and r.start_row == 0 for r in sent_whole.values())

    shared_rows = RoutingReader(tmp_path / "shared").get("r", ["a", "b", "c", "d"])
    whole_rows = RoutingReader(tmp_path / "whole").get("r", ["a", "b", "c", "d"])
    for rid in "abcd":
        np.testing.assert_array_equal(shared_rows[rid].numpy(), whole_rows[rid].numpy())
    np.testing.assert_array_equal(shared_rows["b"].numpy()[:32], expected("a", 32, whole))

    def rows_in_arrays(root):  # distinct rows the index's segments point at (FORMAT.md)
        return rows_stored(root / "r")

    # a 42, b 9 own rows (32 shared), c 1 own row (40 shared), d 40: against 42 + 41 + 41 + 40.
    assert rows_in_arrays(tmp_path / "shared") == 42 + 9 + 1 + 40
    assert rows_in_arrays(tmp_path / "whole") == 42 + 41 + 41 + 40


def test_a_sink_of_the_callers_own_gets_whole_records():
    sink = ListSink()
    cap = RoutingCapturer(layer_map=LAYERS, top_k=K, num_experts=E, num_slots=64, sink=sink)
    run_step(cap, ["a"], [0], [20], list(range(20)))
    cap.finish_request("a", prompt_len=20, generated_len=1)
    cap.attach_cached("b", range(16), range(16))
    run_step(cap, ["b"], [16], [4], list(range(30, 34)))
    rb = cap.finish_request("b", prompt_len=20, generated_len=1)
    assert rb.shared_prefix is None and rb.ids_TLK.shape[0] == 20


def test_a_rewritten_slot_ends_the_shared_prefix():
    prefixes = StoredPrefixes(min_rows=4)
    slots, gens = np.arange(20), np.ones(20, np.int64)
    prefixes.remember("r", "a", slots, gens)
    later = gens.copy()
    later[12:] = 2  # slots 12.. were written again since a stored them: b computed those itself
    assert prefixes.match("r", np.arange(30), np.concatenate([later, np.ones(10, np.int64)])) == ("a", 12)
    assert prefixes.match("other", np.arange(30), np.ones(30, np.int64)) is None  # another rollout
    assert prefixes.match("r", np.arange(30) + 1, np.ones(30, np.int64)) is None  # another first slot
    # All rows shared would leave the request no row of its own: one stays its own.
    assert prefixes.match("r", np.arange(20), gens) == ("a", 19)


@pytest.mark.parametrize("capacity", [1, 2])
def test_the_oldest_stored_request_is_forgotten_first(capacity):
    prefixes = StoredPrefixes(capacity=capacity, min_rows=2)
    prefixes.remember("r", "a", np.arange(4), np.zeros(4, np.int64))
    prefixes.remember("r", "b", np.arange(10, 14), np.zeros(4, np.int64))
    assert len(prefixes) == capacity
    assert (prefixes.match("r", np.arange(6), np.zeros(6, np.int64)) is None) == (capacity == 1)


@pytest.mark.gpu
def test_staged_finishes_on_the_gpu_store_shared_rows_once(tmp_path):
    """On CUDA a finished request leaves through the staged path (gather on the device, copy to
    pinned memory, record built on the writer's thread): the split record (own rows + the
    reference) is built there by the same make_record, and reads back as on the CPU."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def step(cap, ids, starts, counts, slots):
        cap.begin_step(ids, starts, counts, slots)
        for layer in cap.layer_map:
            cap.record(layer, fake_topk(ids, starts, counts, layer, cap.top_k, E).cuda())
        cap.end_step()

    writer = RoutingWriter(LocalRoutingStore(tmp_path / "gpu"), owns_store=True, flush_interval_s=0.0)
    cap = RoutingCapturer(layer_map=LAYERS, top_k=K, num_experts=E, num_slots=512, sink=writer, rollout_id="r",
                          owns_sink=True, device="cuda")
    with cap:
        step(cap, ["a"], [0], [40], list(range(40)))
        cap.fork_request("a", "c", 40)
        step(cap, ["a"], [40], [1], [40])
        cap.finish_request("a", prompt_len=40, generated_len=2)
        cap.attach_cached("b", range(32), range(32))
        step(cap, ["b", "c"], [32, 40], [8, 1], list(range(100, 108)) + [200])
        cap.finish_request("b", prompt_len=40, generated_len=1)
        cap.finish_request("c", prompt_len=40, generated_len=2)
        cap.flush()
        writer.flush()
    rows = RoutingReader(tmp_path / "gpu").get("r", ["a", "b", "c"])
    np.testing.assert_array_equal(rows["a"].numpy(), expected("a", 41, cap))
    np.testing.assert_array_equal(rows["b"].numpy()[:32], expected("a", 32, cap))
    np.testing.assert_array_equal(rows["b"].numpy()[32:], expected("b", 40, cap)[32:])
    np.testing.assert_array_equal(rows["c"].numpy()[:40], expected("a", 40, cap))
    np.testing.assert_array_equal(rows["c"].numpy()[40:], expected("c", 41, cap)[40:])
    assert rows_stored(tmp_path / "gpu" / "r") == 41 + 8 + 1  # b's and c's prompt rows are a's
