"""Prometheus metrics of the engine side: capturer, writer and push client counters.

The counters live on the objects themselves (plain ints, updated without locks on the hot
path); :class:`CaptureMetrics` is a prometheus-client collector that reads them at scrape
time, so capturing costs nothing extra when nobody scrapes. Store nodes export their own
metrics on their HTTP port (``/metrics``, see ``r3rdma.store.metrics``).

```python
from r3rdma.metrics import serve_capture_metrics
server, thread = serve_capture_metrics(9464, capturer=capturer, writer=writer)  # GET :9464/metrics
```
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CaptureMetrics", "capture_registry", "serve_capture_metrics"]

# (attribute, metric name, help) read from each object; an object given without one is refused.
_CAPTURER_COUNTERS = [
    ("rows_captured", "r3rdma_capture_rows", "Routing rows captured (token positions x steps)"),
    ("requests_finished", "r3rdma_capture_requests_finished", "Requests finished and handed to the sink"),
    ("requests_aborted", "r3rdma_capture_requests_aborted", "Requests aborted (their routing is dropped)"),
    ("requests_preempted", "r3rdma_capture_requests_preempted", "Requests preempted (rows kept, recomputed later)"),
]
_CAPTURER_GAUGES = [
    ("active_requests", "r3rdma_capture_active_requests", "Requests being tracked now"),
    ("tracked_positions", "r3rdma_capture_tracked_positions", "Token positions being tracked now"),
]
_WRITER_COUNTERS = [
    ("requests_committed", "r3rdma_writer_requests_committed", "Requests made durable by the store"),
    ("bytes_committed", "r3rdma_writer_bytes_committed", "Routing bytes made durable by the store"),
    ("commits", "r3rdma_writer_commits", "Batches handed to the store, committed or failed"),
    ("commit_failures", "r3rdma_writer_commit_failures", "Batches whose commit failed (error raised to the engine)"),
]
_WRITER_GAUGES = [
    ("queued_requests", "r3rdma_writer_queue_requests", "Push queue depth: finished requests waiting to be committed"),
    ("queued_bytes", "r3rdma_writer_queue_bytes", "Bytes waiting to be committed"),
    ("inflight_bytes", "r3rdma_writer_inflight_bytes", "Bytes queued or being committed (backpressure above max_inflight_bytes)"),
]
_CLIENT_COUNTERS = [
    ("requests_pushed", "r3rdma_push_requests", "Requests pushed to store nodes and acked durable (on every replica)"),
    ("bytes_pushed", "r3rdma_push_bytes", "Routing bytes pushed to store nodes and acked durable (counted once)"),
    ("copies_pushed", "r3rdma_push_copies", "Request copies acked by store nodes (requests x replicas)"),
    ("bytes_sent", "r3rdma_push_sent_bytes", "Routing bytes acked by store nodes, every replica counted"),
    ("failovers", "r3rdma_push_failovers", "Pushes to a node that failed and were retried on the next node"),
]


class CaptureMetrics(Collector):
    """Collector reading the counters of a capturer, a :class:`RoutingWriter` and a
    :class:`StoreNodesClient` (each optional; the client defaults to ``writer.store`` when
    that is a store-node client).

    Each object given must have every counter and gauge of its kind: one that lacks any (a
    renamed counter, the wrong object) is a :class:`~r3rdma.errors.ConfigError` naming them,
    here and at scrape time, never a metric silently missing from the dashboards."""

    def __init__(self, capturer: Any = None, writer: Any = None, client: Any = None) -> None:
        self.capturer = capturer
        self.writer = writer
        if client is None and writer is not None and hasattr(getattr(writer, "store", None), "bytes_pushed"):
            client = writer.store
        self.client = client
        for obj, counters, gauges, kind in self._tables():
            _require_attributes(obj, counters + gauges, kind)

    def _tables(self):
        return [
            (obj, counters, gauges, kind)
            for obj, counters, gauges, kind in (
                (self.capturer, _CAPTURER_COUNTERS, _CAPTURER_GAUGES, "capturer"),
                (self.writer, _WRITER_COUNTERS, _WRITER_GAUGES, "writer"),
                (self.client, _CLIENT_COUNTERS, [], "client"),
            )
            if obj is not None
        ]

    def collect(self) -> Iterator[Metric]:
        """The current counters and gauges (prometheus_client calls it at each scrape); raises
        :class:`~r3rdma.errors.ConfigError` if an object lost one of its attributes."""
        for obj, counters, gauges, kind in self._tables():
            _require_attributes(obj, counters + gauges, kind)
            for family, table in ((CounterMetricFamily, counters), (GaugeMetricFamily, gauges)):
                for attr, name, doc in table:
                    yield family(name, doc, value=float(getattr(obj, attr)))
        if self.client is not None and hasattr(self.client, "nodes_down"):
            yield GaugeMetricFamily("r3rdma_push_nodes", "Store nodes configured", value=float(len(self.client.nodes)))
            if getattr(self.client, "replicas", None) is not None:
                yield GaugeMetricFamily(
                    "r3rdma_push_replicas", "Store nodes each request is made durable on", value=float(self.client.replicas)
                )
            yield GaugeMetricFamily(
                "r3rdma_push_nodes_down", "Store nodes in failover cool-down now", value=float(len(self.client.nodes_down()))
            )


def _require_attributes(obj: Any, table: list[tuple[str, str, str]], kind: str) -> None:
    from r3rdma.errors import ConfigError

    missing = [attr for attr, _, _ in table if getattr(obj, attr, None) is None]
    if missing:
        raise ConfigError(
            f"the {kind} given to the capture metrics ({type(obj).__name__}) has no counter "
            f"{', '.join(missing)}: expected every one of {[attr for attr, _, _ in table]}"
        )


def capture_registry(capturer: Any = None, writer: Any = None, client: Any = None) -> CollectorRegistry:
    """A registry holding one :class:`CaptureMetrics` (own registry: no global state)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(CaptureMetrics(capturer, writer, client))
    return registry


def serve_capture_metrics(port: int, *, addr: str = "127.0.0.1", capturer: Any = None, writer: Any = None, client: Any = None):
    """Serve the metrics over HTTP (``GET /metrics``) from a daemon thread; returns
    ``(server, thread)`` (``server.shutdown()`` stops it). Port 0 picks a free port:
    ``server.server_port``."""
    return start_http_server(port, addr=addr, registry=capture_registry(capturer, writer, client))
