"""Replicas (issue 19): each request on R store nodes, durable only once all R acked; a lost
node loses nothing; readers take any replica and fail over. Real store nodes on 127.0.0.1."""

import logging
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from r3rdma import RoutingReader, RoutingWriter
from r3rdma.errors import (
    ConfigError,
    CorruptDataError,
    TransportError,
    UnknownRolloutError,
)
from r3rdma.store.retention import delete_rollout
from r3rdma.transport import TransportLimits
from r3rdma.write.push_client import StoreNodesClient, rendezvous_order

from .store_nodes import new_token, start_node

# A push to a killed node fails once its connect times out: keep that short here.
LIMITS = TransportLimits(timeout_s=3)


@pytest.fixture
def three_nodes(tmp_path):
    token = new_token()
    with ThreadPoolExecutor(3) as pool:  # each start waits for the node's ready line
        nodes = list(pool.map(lambda i: start_node(tmp_path / f"node{i}", token), range(3)))
    yield nodes
    for node in nodes:
        node.kill()


def read_token(node):
    """The node's HTTP read token (a derived token where nodes have one, else the secret)."""
    return getattr(node, "read_token", node.token)


def admin_token(node):
    """The node's HTTP token for deletes (derived where nodes have one, else the secret)."""
    return getattr(node, "admin_token", node.token)


def held_by(node, rollout_id="roll-0"):
    """Request ids node's own index lists (read over its HTTP service)."""
    with RoutingReader(node.http_url, token=read_token(node), timeout_s=10) as reader:
        try:
            return set(reader.info(rollout_id).request_ids)
        except UnknownRolloutError:
            return set()


def records(make_record, n, prefix="q"):
    return [make_record(f"{prefix}{i}", rows=5 + i % 7, seed=i) for i in range(n)]


def test_replicas_default_and_validation():
    token = new_token()
    with StoreNodesClient(["127.0.0.1:1"], secret=token) as one:
        assert one.replicas == 1
    with StoreNodesClient(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], secret=token) as three:
        assert three.replicas == 2
    for bad in (0, 4, True, 1.5, "2"):
        with pytest.raises(ConfigError, match="replicas"):
            StoreNodesClient(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], secret=token, replicas=bad)


def test_a_lost_node_loses_nothing(three_nodes, make_record):
    recs = records(make_record, 30)
    urls = [n.push_url for n in three_nodes]
    with StoreNodesClient(urls, secret=three_nodes[0].token, replicas=2, limits=LIMITS) as client:
        with RoutingWriter(client, flush_bytes=512) as writer:  # several commits
            for r in recs:
                writer.submit(r)
            writer.flush(timeout=60)
        assert client.requests_pushed == 30 and client.copies_pushed == 60 and client.failovers == 0
        assert client.bytes_pushed == sum(r.nbytes for r in recs) and client.bytes_sent == 2 * client.bytes_pushed
        placement = {r.request_id: client.replica_set(r) for r in recs}
    # Each request is on exactly the first two nodes of its rendezvous order.
    held = {n.push_url: held_by(n) for n in three_nodes}
    for rid, replica_set in placement.items():
        assert {u for u, ids in held.items() if rid in ids} == set(replica_set)

    http = [n.http_url for n in three_nodes]
    reader = RoutingReader(http, token=read_token(three_nodes[0]), timeout_s=10)
    reader.info("roll-0")  # index cached with all three nodes: the next read must fail over
    lost = three_nodes[0]
    lost.stop(signal.SIGKILL)
    shutil.rmtree(lost.root)
    got = reader.get_numpy("roll-0", [r.request_id for r in recs])
    for r in recs:
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)
        assert got[r.request_id].dtype == r.ids_TLK.dtype
    on_lost = [rid for rid, rs in placement.items() if lost.push_url in rs]
    assert on_lost and reader.read_failovers >= 1
    reader.close()

    # A fresh reader: the dead node is skipped when the index is fetched, and said so.
    with RoutingReader(http, token=read_token(three_nodes[0]), timeout_s=10) as fresh:
        assert set(fresh.info("roll-0").request_ids) == {r.request_id for r in recs}
        assert list(fresh.last_skipped_nodes) == [lost.http_url]
        packed = fresh.get_packed("roll-0", [r.request_id for r in recs])
        np.testing.assert_array_equal(packed.ids_TLK.numpy(), np.concatenate([r.ids_TLK for r in recs]).astype(np.int32))

        # Lose a second node: what only the two dead nodes held is gone for now, and the
        # error names them; what the survivor holds still reads.
        second = three_nodes[1]
        second.stop(signal.SIGKILL)
        survivor = three_nodes[2]
        only_dead = [rid for rid, rs in placement.items() if survivor.push_url not in rs]
        kept = [rid for rid, rs in placement.items() if survivor.push_url in rs]
        assert only_dead and kept
        # The index is cached from before: the read fails over, and finds no live holder.
        with pytest.raises(TransportError) as info:
            fresh.get_numpy("roll-0", only_dead[:1])
        assert lost.http_url in str(info.value) and second.http_url in str(info.value)
        got = fresh.get_numpy("roll-0", kept)
        for r in recs:
            if r.request_id in kept:
                np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)
        # Fetched afresh: both dead nodes are skipped, the survivor's requests are listed.
        assert set(fresh.info("roll-0").request_ids) == set(kept)
        assert set(fresh.last_skipped_nodes) == {lost.http_url, second.http_url}
        with pytest.raises(TransportError) as info:
            fresh.get_numpy("roll-0", only_dead)
        assert lost.http_url in str(info.value) and second.http_url in str(info.value)


def test_push_fails_typed_when_fewer_live_nodes_than_replicas(three_nodes, make_record):
    a, b, c = three_nodes
    b.stop(signal.SIGKILL)
    c.stop(signal.SIGKILL)
    recs = records(make_record, 6, prefix="lonely")
    with StoreNodesClient([a.push_url, b.push_url, c.push_url], secret=a.token, replicas=2, limits=LIMITS) as client:
        with pytest.raises(TransportError, match="cannot be durable on 2 distinct store nodes") as info:
            client.commit(recs)
        assert all(f"roll-0/{r.request_id}" in str(info.value) for r in recs)
        # nothing reported durable, and the failed nodes are known
        assert client.requests_pushed == 0 and client.bytes_pushed == 0 and client.copies_pushed == 0
        assert client.failovers >= 1 and set(client.nodes_down()) <= {b.push_url, c.push_url}
        # The same through a writer: its flush raises, nothing counted committed.
        with RoutingWriter(client) as writer:
            writer.submit(recs[0])
            with pytest.raises(TransportError, match="lonely0"):
                writer.flush(timeout=60)
        assert client.requests_pushed == 0


def test_a_node_down_at_push_time_fails_over_to_two_live_copies(three_nodes, make_record, caplog):
    a, b, c = three_nodes
    urls = [n.push_url for n in three_nodes]
    c.stop(signal.SIGKILL)
    recs = records(make_record, 20)
    with StoreNodesClient(urls, secret=a.token, replicas=2, limits=LIMITS, down_cooldown_s=60) as client:
        moved = sum(c.push_url in client.replica_set(r) for r in recs)
        assert moved  # some must move
        with caplog.at_level(logging.WARNING, logger="r3rdma"):
            stats = client.commit(recs)
        assert stats.requests == 20 and stats.copies == 40 and stats.failovers == 1
        assert client.nodes_down() == [c.push_url]
    # The failover is logged once, naming the node and how many requests moved.
    (line,) = [r.getMessage() for r in caplog.records if "failed a push" in r.getMessage()]
    assert f"store node {c.push_url} failed a push of {moved} requests" in line and "tried last for 60 s" in line
    on_a, on_b = held_by(a), held_by(b)
    ids = {r.request_id for r in recs}
    assert on_a == ids and on_b == ids  # two live nodes: both hold every request
    # Each request went to the first two *live* nodes of its order (here: a and b).
    for r in recs:
        live = [n for n in rendezvous_order(urls, f"roll-0/{r.request_id}") if n != c.push_url][:2]
        assert set(live) == {a.push_url, b.push_url}


def test_replicas_with_different_bytes_are_corrupt(three_nodes, make_record):
    a, b, _ = three_nodes
    with StoreNodesClient([a.push_url], secret=a.token) as client:
        client.commit([make_record("twin", seed=1), make_record("same", seed=3)])
    with StoreNodesClient([b.push_url], secret=b.token) as client:
        client.commit([make_record("twin", seed=2), make_record("same", seed=3)])
    with RoutingReader([a.http_url, b.http_url], token=read_token(a), timeout_s=10) as reader:
        # Copies are compared when read (an index open compares none: it cost ~40% of a fresh
        # open at 16k requests): the twin fails, naming both nodes; its neighbour reads fine.
        assert reader.get_numpy("roll-0", ["same"])["same"].shape == make_record("same", seed=3).ids_TLK.shape
        with pytest.raises(CorruptDataError, match="twin") as info:
            reader.get_numpy("roll-0", ["same", "twin"])
        assert a.http_url in str(info.value) and b.http_url in str(info.value)


def test_retention_deletes_every_replica_and_names_unreachable_nodes(three_nodes, make_record):
    a, b, c = three_nodes
    recs = records(make_record, 12)
    with StoreNodesClient([n.push_url for n in three_nodes], secret=a.token, replicas=2, limits=LIMITS) as client:
        client.commit(recs)
        client.commit([make_record("k", rollout_id="keep")])
    http = [n.http_url for n in three_nodes]
    assert delete_rollout(http, "roll-0", token=admin_token(a)) == {u: True for u in http}
    assert all(held_by(n) == set() for n in three_nodes)
    assert all(not (n.root / "roll-0").exists() for n in three_nodes)
    with RoutingReader(http, token=read_token(a)) as reader, pytest.raises(UnknownRolloutError):
        reader.info("roll-0")

    # A replica on a node that is down survives the delete: the call says which node.
    with StoreNodesClient([n.push_url for n in three_nodes], secret=a.token, replicas=3, limits=LIMITS) as client:
        client.commit(recs[:3])
    c.stop(signal.SIGKILL)
    with pytest.raises(TransportError, match="retention incomplete on 1 of 3 nodes") as info:
        delete_rollout(http, "roll-0", token=admin_token(a), timeout_s=10)
    assert c.http_url in str(info.value) and info.value.failed_nodes == [c.http_url]
    assert held_by(a) == set() and held_by(b) == set()
    assert (c.root / "roll-0").exists()
    back = start_node(c.root, c.token)  # same root, new ports
    try:
        assert delete_rollout([a.http_url, b.http_url, back.http_url], "roll-0", token=admin_token(a)) == {
            a.http_url: False, b.http_url: False, back.http_url: True}
        assert held_by(back) == set()
    finally:
        back.kill()
