"""Prometheus metrics: engine-side collector (capturer, writer, push client) and store nodes."""

import os
import shutil
import signal
import tempfile
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from r3rdma import R3Config, RoutingWriter
from r3rdma.errors import ConfigError, StoreError
from r3rdma.integrations.builders import build_capturer
from r3rdma.metrics import capture_registry, serve_capture_metrics
from r3rdma.store.http_app import make_http_app
from r3rdma.store.metrics import NodeMetrics
from r3rdma.transport import TransportLimits
from r3rdma.write.push_client import StoreNodesClient

from .store_nodes import new_token, serve_in_thread, start_node


def _scrape(url, headers=None):
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _assert_disk_of(scraped, root):
    """The node's disk gauges are those of the filesystem holding ``root`` (others write to it
    meanwhile: within 256 MiB)."""
    usage = shutil.disk_usage(root)
    assert abs(scraped["r3rdma_store_disk_free_bytes"] - usage.free) < 256 << 20, (scraped, usage)
    assert abs(scraped["r3rdma_store_disk_used_bytes"] - usage.used) < 256 << 20, (scraped, usage)


class _FailingStore:
    def commit(self, records):
        raise OSError("disk on fire")


def _step(capturer, request_ids, starts, counts, slots):
    capturer.begin_step(request_ids, starts, counts, slots)
    n = sum(counts)
    for layer in capturer.layer_map:
        capturer.record(layer, torch.stack([torch.randperm(8)[:2] for _ in range(n)]))
    capturer.end_step()


def test_capture_metrics_of_a_real_capturer_and_writer(tmp_path):
    """A RoutingCapturer (CPU) built by R3Config, over a real writer and local store, driven through
    prefill, decode, finish, abort and preempt: every counter scraped over HTTP is the count that
    happened, not a fake's attribute."""
    config = R3Config(local_store_dir=str(tmp_path / "root"), rollout_id="metrics", flush_interval_s=0)
    capturer = build_capturer(config, layer_map=[0, 2], top_k=2, num_experts=8, num_slots=64, device="cpu")
    server, _ = serve_capture_metrics(0, capturer=capturer, writer=capturer.sink)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        _step(capturer, ["a", "b", "c"], [0, 0, 0], [3, 2, 2], list(range(7)))  # prefill: 7 positions
        _step(capturer, ["a", "b", "c"], [3, 2, 2], [1, 1, 1], [7, 8, 9])  # one decode step each
        live = _scrape(url)
        capturer.finish_request("a", prompt_len=3, generated_len=2)  # 3 + 2 - 1 = 4 rows
        capturer.abort_request("b")
        capturer.preempt_request("c")
        capturer.flush(timeout=60)  # handed to the writer ...
        capturer.sink.flush(timeout=60)  # ... and committed durably
        done = _scrape(url)
        record_bytes = sum(f.stat().st_size for f in (tmp_path / "root").rglob("*") if f.is_file())
    finally:
        server.shutdown()
        capturer.close()
    assert live["r3rdma_capture_rows_total"] == 10
    assert live["r3rdma_capture_active_requests"] == 3 and live["r3rdma_capture_tracked_positions"] >= 10
    assert live["r3rdma_capture_requests_finished_total"] == 0
    assert done["r3rdma_capture_rows_total"] == 10
    assert done["r3rdma_capture_requests_finished_total"] == 1
    assert done["r3rdma_capture_requests_aborted_total"] == 1
    assert done["r3rdma_capture_requests_preempted_total"] == 1
    assert done["r3rdma_capture_active_requests"] == 0 and done["r3rdma_capture_tracked_positions"] == 0
    assert done["r3rdma_writer_requests_committed_total"] == 1
    assert done["r3rdma_writer_bytes_committed_total"] == 4 * 2 * 2  # rows x layers x top-k, uint8
    assert done["r3rdma_writer_queue_requests"] == 0 and done["r3rdma_writer_inflight_bytes"] == 0
    assert done["r3rdma_writer_commit_failures_total"] == 0 and record_bytes > 0


def test_capture_metrics_refuse_an_object_without_a_counter(make_record):
    """A capturer or writer lacking a counter (renamed, or the wrong object) is an error naming
    it, not a metric silently missing."""

    class Renamed:
        rows_captured = requests_aborted = requests_preempted = active_requests = tracked_positions = 0
        finished = 4  # not requests_finished

    with pytest.raises(ConfigError, match="capturer given to the capture metrics .* has no counter requests_finished"):
        capture_registry(capturer=Renamed())
    with pytest.raises(ConfigError, match="writer .* has no counter requests_committed, bytes_committed"):
        capture_registry(writer=Renamed())
    with RoutingWriter(_FailingStore(), flush_bytes=1) as writer:
        writer.submit(make_record("a"))
        with pytest.raises(StoreError):
            writer.flush(timeout=30)
        values = {s.name: s.value for f in capture_registry(writer=writer).collect() for s in f.samples}
    assert values["r3rdma_writer_commit_failures_total"] == 1
    assert values["r3rdma_writer_requests_committed_total"] == 0


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
        _assert_disk_of(store, tmp_path / "node")
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


def test_store_disk_gauges_follow_the_root(tmp_path):
    """The disk gauges measure the filesystem of the node's root, not the process's working
    directory: a root on a second filesystem (tmpfs /dev/shm, where it is one) reports that one."""
    roots = [tmp_path / "root"]
    roots[0].mkdir()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as other:
        if os.stat(other).st_dev != os.stat(tmp_path).st_dev:
            roots.append(Path(other))
        for root in roots:
            app = make_http_app(root, read_token="t", admin_token=None, public_read=False, metrics=NodeMetrics())
            with serve_in_thread(app) as url:
                _assert_disk_of(_scrape(f"{url}/metrics", {"Authorization": "Bearer t"}), root)
