"""A sample of a sample is placed on its root source's replicas (issue #50, "Stored as said").

docs/ENGINE_SEMANTICS.md lets a shared prefix's source be a sample itself: a prompt P, a sample
A that hit P's prompt blocks and computed more of its own prompt, a sample B that hit A's. The
capturer then sends B by reference to A. With 3 store nodes and 2 replicas, B used to be placed
by A's id, whose rendezvous order differs from P's (where A lies) in 2 of 3 cases: the node
without A refused the reference, B went inline to a third replica set, and the writer reported
a ``SegmentOverlapError`` for a request every node held right (before the store judged records
by their rows). Now every record of a chain is placed by its root source, and the inline
fallback after a failover holds the same rows as the copy by reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from r3rdma import RoutingCapturer, RoutingReader
from r3rdma.records import RequestRecord, SharedPrefix
from r3rdma.write.push_client import Placement, rendezvous_order
from r3rdma.write.writer import RoutingWriter
from tests.inproc_nodes import InProcessNodes
from tests.test_capture import fake_topk, run_step

ROLLOUT = "r"
LAYERS, K, E = (0, 1, 3), 2, 16


def _rows(cap, parts):
    """Expected rows: ``(request that computed them, first position, count)`` pieces, in order."""
    return np.concatenate(
        [
            np.stack(
                [fake_topk([rid], [start], [n], layer, cap.top_k, cap.num_experts).numpy() for layer in cap.layer_map], axis=1
            )
            for rid, start, n in parts
        ]
    ).astype(np.uint8)


def _chain(cap, c: int) -> dict[str, np.ndarray]:
    """Prompt ``p<c>`` (32 tokens), sample ``a<c>`` that hits its 32 prompt positions and computes
    16 more prompt tokens, sample ``b<c>`` that hits a's 48 prompt positions: b shares a's rows,
    which share p's. Returns each request's expected rows."""
    p, a, b, s0 = f"p{c}", f"a{c}", f"b{c}", 100 * c
    run_step(cap, [p], [0], [32], list(range(s0, s0 + 32)))
    run_step(cap, [p], [32], [1], [s0 + 32])
    cap.finish_request(p, prompt_len=32, generated_len=2)
    cap.attach_cached(a, range(32), range(s0, s0 + 32))
    run_step(cap, [a], [32], [16], list(range(s0 + 40, s0 + 56)))
    run_step(cap, [a], [48], [1], [s0 + 56])
    cap.finish_request(a, prompt_len=48, generated_len=2)
    cap.attach_cached(b, range(48), [*range(s0, s0 + 32), *range(s0 + 40, s0 + 56)])
    run_step(cap, [b], [48], [8], list(range(s0 + 60, s0 + 68)))
    run_step(cap, [b], [56], [1], [s0 + 68])
    cap.finish_request(b, prompt_len=56, generated_len=2)
    return {
        p: _rows(cap, [(p, 0, 33)]),
        a: _rows(cap, [(p, 0, 32), (a, 32, 17)]),
        b: _rows(cap, [(p, 0, 32), (a, 32, 16), (b, 48, 9)]),
    }


def _capturer(writer):
    sent: dict[str, RequestRecord] = {}
    hand_over = writer.hand_over

    def spy(record):
        sent[record.request_id] = record
        hand_over(record)

    writer.hand_over = spy
    cap = RoutingCapturer(layer_map=LAYERS, top_k=K, num_experts=E, num_slots=4096, sink=writer, rollout_id=ROLLOUT)
    return cap, sent


def _held(roots, want) -> dict[str, list[int]]:
    """Which nodes list each request; every copy checked bit for bit against ``want``."""
    held: dict[str, list[int]] = {}
    for i, root in enumerate(roots):
        with RoutingReader(str(root)) as reader:
            have = sorted(set(reader.info(ROLLOUT).request_ids) & set(want))
            got = reader.get_numpy(ROLLOUT, have)
        for rid in have:
            np.testing.assert_array_equal(got[rid], want[rid], err_msg=f"{rid} on node {i}")
            held.setdefault(rid, []).append(i)
    return held


def _refusals(nodes) -> float:
    """Batches the nodes refused (their ``r3rdma_store_errors_total``)."""
    return sum(s.value for n in nodes.nodes for m in n.metrics.errors.collect() for s in m.samples if s.name.endswith("_total"))


def test_placement_follows_a_chain_to_its_root():
    ids = np.zeros((4, 1, 1), np.uint8)

    def rec(rid, source=None, start_row=0):
        shared = None if source is None else SharedPrefix(source, 2, ids_TLK=ids[:2])
        return RequestRecord(ROLLOUT, rid, ids, (0,), 4, start_row + (2 if shared else 0), shared_prefix=shared)

    placement = Placement(capacity=3)
    assert placement.key(rec("p")) == f"{ROLLOUT}/p"
    assert placement.key(rec("a", "p"), learn=False) == f"{ROLLOUT}/p" and len(placement) == 0  # looked, not learnt
    assert placement.key(rec("a", "p")) == f"{ROLLOUT}/p"
    assert placement.key(rec("b", "a")) == f"{ROLLOUT}/p"  # a sample of a sample: the prompt's replicas
    assert placement.key(rec("c", "b")) == f"{ROLLOUT}/p"
    # Everything later of a request placed by a source follows it: its rows inline, a later turn.
    assert placement.key(rec("b")) == f"{ROLLOUT}/p"
    assert placement.key(rec("b", start_row=12)) == f"{ROLLOUT}/p"
    assert [r.request_id for r in rec("b", "a").prefix_inlined() or []] == ["b", "b"]
    assert {placement.key(r) for r in rec("b", "a").prefix_inlined() or []} == {f"{ROLLOUT}/p"}
    # Bounded: the oldest request placed by a source is forgotten first, then placed by its source.
    assert placement.key(rec("d", "c")) == f"{ROLLOUT}/p" and len(placement) == 3
    assert placement.key(rec("a")) == f"{ROLLOUT}/a"
    other = RequestRecord("r2", "x", ids, (0,), 4, 2, shared_prefix=SharedPrefix("p", 2))
    assert placement.key(other) == "r2/p"  # another rollout's p: no chain known there


def test_a_sample_of_a_sample_is_placed_on_its_root_sources_replicas(tmp_path):
    """3 nodes, 2 replicas, 6 chains (6 prompts spread the roots over the three replica sets):
    every request of a chain is on its prompt's two nodes, resolved by reference there, and no
    node refused anything. Before the fix b went to a's own order, so each b was refused by a
    node (its reference) and 4 of 6 ended off the chain's nodes, 2 of them on all 3."""
    with InProcessNodes(tmp_path, 3, replicas=2) as nodes:
        with RoutingWriter(nodes.client, flush_interval_s=0.0) as writer:
            cap, sent = _capturer(writer)
            want: dict[str, np.ndarray] = {}
            for c in range(6):
                want.update(_chain(cap, c))
            writer.flush(timeout=60)
            assert writer.failures() == [] and writer.requests_failed == 0
        assert _refusals(nodes) == 0
        held = _held(nodes.roots, want)
        for c in range(6):
            assert sent[f"b{c}"].shared_prefix.request_id == f"a{c}" and sent[f"a{c}"].shared_prefix.request_id == f"p{c}"
            chain_nodes = sorted(nodes.index_of(u) for u in rendezvous_order(nodes.urls, f"{ROLLOUT}/p{c}")[:2])
            assert held[f"p{c}"] == held[f"a{c}"] == held[f"b{c}"] == chain_nodes
        assert {tuple(v) for v in held.values()} != {tuple(held["p0"])}  # the roots spread over the nodes
        with RoutingReader(nodes.live_roots()) as reader:  # merged: copies compared, read from any
            got = reader.get_numpy(ROLLOUT, list(want))
        for rid, rows in want.items():
            np.testing.assert_array_equal(got[rid], rows)


def test_after_a_failover_the_inline_copy_holds_the_same_rows(tmp_path):
    """One of the prompt's nodes dies after p and a are stored: b fails over to the third node,
    which lacks a and refuses the reference; the writer stores b there inline. Two live copies
    (by reference and inline), the same rows, no failure reported."""
    with InProcessNodes(tmp_path, 3, replicas=2) as nodes:
        with RoutingWriter(nodes.client, flush_interval_s=0.0) as writer:
            cap, sent = _capturer(writer)
            want = _chain_until_a(cap)
            writer.flush(timeout=60)
            first, second = (nodes.index_of(u) for u in rendezvous_order(nodes.urls, f"{ROLLOUT}/p0")[:2])
            nodes.kill(second)
            want.update(_finish_b(cap))
            writer.flush(timeout=60)
            assert writer.failures() == []
        third = ({0, 1, 2} - {first, second}).pop()
        assert sent["b0"].shared_prefix.request_id == "a0"
        held = _held(nodes.roots, want)
        assert held["b0"] == sorted([first, third]) and held["a0"] == sorted([first, second])
        segments = {i: _segments(nodes.roots[i], "b0") for i in (first, third)}
        assert len(segments[first]) == 3 and len(segments[third]) == 2  # by reference (p, a, b) / inline (0..47, b)
        with RoutingReader(nodes.live_roots()) as reader:  # the copies cut differently compare by their rows
            np.testing.assert_array_equal(reader.get_numpy(ROLLOUT, ["b0"])["b0"], want["b0"])


def _chain_until_a(cap) -> dict[str, np.ndarray]:
    run_step(cap, ["p0"], [0], [32], list(range(32)))
    run_step(cap, ["p0"], [32], [1], [32])
    cap.finish_request("p0", prompt_len=32, generated_len=2)
    cap.attach_cached("a0", range(32), range(32))
    run_step(cap, ["a0"], [32], [16], list(range(40, 56)))
    run_step(cap, ["a0"], [48], [1], [56])
    cap.finish_request("a0", prompt_len=48, generated_len=2)
    return {"p0": _rows(cap, [("p0", 0, 33)]), "a0": _rows(cap, [("p0", 0, 32), ("a0", 32, 17)])}


def _finish_b(cap) -> dict[str, np.ndarray]:
    cap.attach_cached("b0", range(48), [*range(32), *range(40, 56)])
    run_step(cap, ["b0"], [48], [8], list(range(60, 68)))
    run_step(cap, ["b0"], [56], [1], [68])
    cap.finish_request("b0", prompt_len=56, generated_len=2)
    return {"b0": _rows(cap, [("p0", 0, 32), ("a0", 32, 16), ("b0", 48, 9)])}


def _segments(root, request_id):
    """The request's segments in the node's own index (every part merged, read from its root)."""
    group = zarr.open_group(str(root), path=ROLLOUT, mode="r")
    requests = {}
    for n in range(1, group.attrs["r3rdma"]["parts"] + 1):
        requests.update(group[f"i{n:08d}"].attrs["r3rdma"]["requests"])
    return [(s["start_row"], s["rows"]) for s in requests[request_id]["segments"]]


@pytest.fixture
def three_ucx_nodes(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from tests.store_nodes import new_token, start_node

    token = new_token()
    with ThreadPoolExecutor(3) as pool:
        nodes = list(pool.map(lambda i: start_node(tmp_path / f"node{i}", token), range(3)))
    yield nodes
    for node in nodes:
        node.kill()


def test_chains_over_ucx_nodes_stay_on_their_root_sources_replicas(three_ucx_nodes):
    """The issue's own setting: store nodes over UCX (TCP loopback), 3 nodes, 2 replicas."""
    from r3rdma.transport import TransportLimits
    from r3rdma.write.push_client import StoreNodesClient

    nodes = three_ucx_nodes
    urls = [n.push_url for n in nodes]
    limits = TransportLimits(timeout_s=30, connect_timeout_s=20)  # a loaded CI host: first UCX connects take ~5 s
    with StoreNodesClient(urls, secret=nodes[0].token, replicas=2, limits=limits) as client:
        with RoutingWriter(client, flush_interval_s=0.0) as writer:
            cap, _ = _capturer(writer)
            want: dict[str, np.ndarray] = {}
            for c in range(6):
                want.update(_chain(cap, c))
            writer.flush(timeout=120)
            assert writer.failures() == []
    held = _held([n.root for n in nodes], want)
    for c in range(6):
        chain_nodes = sorted(urls.index(u) for u in rendezvous_order(urls, f"{ROLLOUT}/p{c}")[:2])
        assert held[f"p{c}"] == held[f"a{c}"] == held[f"b{c}"] == chain_nodes
