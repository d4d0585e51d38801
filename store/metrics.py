"""Prometheus metrics of one store node (own registry: several nodes may share a process in tests).

HTTP traffic is counted where it is served: by the node process itself, or by its read
workers (store/read_workers.py), which keep their counters in prometheus-client's
multiprocess files; the node's registry then adds those up (``workers_dir``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["NodeMetrics", "HttpMetrics"]


class _HttpCounters:
    """The HTTP counters whoever serves the read service keeps (a node, or a read worker).

    A plain class, not a dataclass: its attributes are set by :meth:`_add_http_counters`, never
    passed to a constructor.
    """

    http_requests: Counter
    http_bytes: Counter

    def _add_http_counters(self, registry: CollectorRegistry | None) -> None:
        self.http_requests = Counter(
            "r3rdma_store_http_requests", "HTTP reads, by route and status", ["route", "status"], registry=registry
        )
        self.http_bytes = Counter("r3rdma_store_http_bytes", "Bytes served over HTTP (file bodies)", registry=registry)


@dataclass
class HttpMetrics(_HttpCounters):
    """A read worker's counters (its process runs with ``PROMETHEUS_MULTIPROC_DIR`` set, so
    they live in files that the node process adds up)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self._add_http_counters(self.registry)


@dataclass
class NodeMetrics(_HttpCounters):
    """A store node's metrics, registered in ``registry``: ingest counters, commit latency, disk
    and client gauges, and the HTTP counters (its own, or its read workers' from ``workers_dir``).
    :func:`bind_node_gauges` adds ``root_bytes`` once the node's server runs."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    workers_dir: str | None = None  # read workers serve HTTP and count it in files here

    def __post_init__(self) -> None:
        r = self.registry
        self.requests_ingested = Counter("r3rdma_store_requests_ingested", "Requests made durable", registry=r)
        self.bytes_ingested = Counter("r3rdma_store_bytes_ingested", "Routing payload bytes made durable", registry=r)
        self.duplicates = Counter("r3rdma_store_duplicate_requests", "Re-pushed requests with identical bytes", registry=r)
        self.batches = Counter("r3rdma_store_batches", "Batches committed", registry=r)
        self.errors = Counter("r3rdma_store_errors", "Errors answered to clients, by type", ["type"], registry=r)
        self.ack_latency = Histogram(
            "r3rdma_store_commit_seconds",
            "Time from a batch's arrival to its durable commit",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        if self.workers_dir is None:
            self._add_http_counters(r)
        else:
            # The workers' files hold the HTTP counts; the node's own HTTP (its control socket,
            # reached only through a worker, which counted the request) goes unexported.
            from prometheus_client.multiprocess import MultiProcessCollector

            self._add_http_counters(CollectorRegistry())
            MultiProcessCollector(r, path=self.workers_dir)
        self.disk_used = Gauge("r3rdma_store_disk_used_bytes", "Bytes used by the filesystem holding the root", registry=r)
        self.disk_free = Gauge("r3rdma_store_disk_free_bytes", "Bytes free on the filesystem holding the root", registry=r)
        self.connected_clients = Gauge("r3rdma_store_connected_clients", "Pushing clients connected now", registry=r)
        self.root_bytes: Gauge | None = None  # set by bind_node_gauges


def bind_node_gauges(metrics: NodeMetrics, root, server) -> None:
    """Gauges computed at scrape time: clients connected to ``server`` (its live sessions) and
    the bytes under the node's ``root`` (a directory walk, cached for 10 s so scrapes stay cheap)."""
    import os
    import time
    from pathlib import Path

    metrics.connected_clients.set_function(lambda: float(len(getattr(server, "_sessions", ()))))
    root = Path(root)
    cache = {"at": -1e9, "value": 0.0}

    def root_bytes() -> float:
        now = time.monotonic()
        if now - cache["at"] > 10.0:
            total = 0
            for directory, _, files in os.walk(root):
                for name in files:
                    try:
                        total += os.stat(os.path.join(directory, name)).st_blocks * 512
                    except OSError:
                        pass  # deleted by retention while we walk
            cache.update(at=now, value=float(total))
        return cache["value"]

    metrics.root_bytes = Gauge(
        "r3rdma_store_root_bytes", "Bytes on disk under this node's root (all rollouts)", registry=metrics.registry
    )
    metrics.root_bytes.set_function(root_bytes)
