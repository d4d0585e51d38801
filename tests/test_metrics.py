"""Prometheus metrics: engine-side collector (capturer, writer, push client) and store nodes."""

import signal
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from r3rdma import RoutingWriter
from r3rdma.errors import StoreError
from r3rdma.metrics import capture_registry, serve_capture_metrics
from r3rdma.transport import TransportLimits
from r3rdma.write.push_client import StoreNodesClient

from .store_nodes import new_token, start_node


def _scrape(url, headers=None):
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


class _FakeCapturer:
    rows_captured = 123
    requests_finished = 4
    requests_aborted = 1
    requests_preempted = 0
    active_requests = 2
    tracked_positions = 57


class _FailingStore:
    def commit(self, records):
        raise OSError("disk on fire")


def test_capture_metrics_read_the_objects_counters(make_record):
    with RoutingWriter(_FailingStore(), flush_bytes=1) as writer:
        writer.submit(make_record("a"))
        with pytest.raises(StoreError):
            writer.flush(timeout=30)
        server, thread = serve_capture_metrics(0, capturer=_FakeCapturer(), writer=writer)
        try:
            values = _scrape(f"http://127.0.0.1:{server.server_port}/metrics")
        finally:
            server.shutdown()
    assert values["r3rdma_capture_rows_total"] == 123
    assert values["r3rdma_capture_requests_finished_total"] == 4
    assert values["r3rdma_capture_requests_aborted_total"] == 1
    assert values["r3rdma_capture_active_requests"] == 2
    assert values["r3rdma_writer_commit_failures_total"] == 1
    assert values["r3rdma_writer_requests_committed_total"] == 0
    assert values["r3rdma_writer_queue_requests"] == 0


def test_push_client_and_store_node_metrics(tmp_path, make_record):
    token = new_token()
    node = start_node(tmp_path / "node", token)
    try:
        records = [make_record(f"q{i}", rows=50) for i in range(5)]
        with StoreNodesClient([node.push_url], secret=token) as client:
            with RoutingWriter(client, flush_bytes=1 << 20) as writer:
                for r in records:
                    writer.submit(r)
                writer.flush(timeout=60)
                engine = {s.name: s.value for f in capture_registry(writer=writer).collect() for s in f.samples}
                store = _scrape(f"{node.http_url}/metrics", {"Authorization": f"Bearer {node.read_token}"})
        total = sum(r.nbytes for r in records)
        assert engine["r3rdma_writer_requests_committed_total"] == 5
        assert engine["r3rdma_push_bytes_total"] == total  # writer.store is the push client
        assert engine["r3rdma_push_nodes"] == 1 and engine["r3rdma_push_nodes_down"] == 0
        assert store["r3rdma_store_requests_ingested_total"] == 5
        assert store["r3rdma_store_bytes_ingested_total"] == total
        assert store["r3rdma_store_commit_seconds_count"] >= 1
        assert store["r3rdma_store_connected_clients"] == 1  # the client is still connected
        assert store["r3rdma_store_root_bytes"] > 0
        assert store["r3rdma_store_disk_free_bytes"] > 0
    finally:
        node.stop(signal.SIGKILL)


def test_nodes_in_failover_cooldown_are_public_and_exported(tmp_path, make_record):
    token = new_token()
    node = start_node(tmp_path / "node", token)
    dead = "127.0.0.1:1"  # nothing listens there
    try:
        records = [make_record(f"q{i}") for i in range(8)]
        limits = TransportLimits(timeout_s=2.0)
        with StoreNodesClient([node.push_url, dead], secret=token, limits=limits, down_cooldown_s=600, replicas=1) as client:
            assert any(client.owner(r) == dead for r in records)  # some pushes must fail over
            assert client.nodes_down() == []
            assert client.commit(records).failovers >= 1
            assert client.nodes_down() == [dead]
            engine = {s.name: s.value for f in capture_registry(client=client).collect() for s in f.samples}
        assert engine["r3rdma_push_nodes"] == 2 and engine["r3rdma_push_nodes_down"] == 1
    finally:
        node.stop(signal.SIGKILL)
