"""A store node: ingests routing over UCX into a local Zarr root and serves it over HTTP."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from r3rdma.errors import R3Error
from r3rdma.local_store import LocalRoutingStore
from r3rdma.records import RequestRecord
from r3rdma.transport import TransportLimits, UcxxServer

from .http_app import make_http_app
from .metrics import NodeMetrics, bind_node_gauges

__all__ = ["StoreNode", "NodeAddress"]

log = logging.getLogger("r3rdma.store")


@dataclass(frozen=True, slots=True)
class NodeAddress:
    host: str
    ucx_port: int
    http_port: int

    @property
    def push_url(self) -> str:
        return f"{self.host}:{self.ucx_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"


class StoreNode:
    """Owns one store root. ``start`` listens on UCX and HTTP; ``stop`` drains.

    Each received batch is committed (written, fsynced, indexed) in a worker thread before the
    transport acks it, so an ack always means durable.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        secret: bytes | str,
        host: str = "127.0.0.1",
        ucx_port: int = 0,
        http_port: int = 0,
        public_read: bool = False,
        limits: TransportLimits | None = None,
        zstd_level: int = 3,
        chunk_rows: int = 1024,
    ) -> None:
        self.root = Path(root)
        self.host = host
        self.metrics = NodeMetrics()
        self.store = LocalRoutingStore(self.root, zstd_level=zstd_level, chunk_rows=chunk_rows)
        token = secret.decode() if isinstance(secret, bytes) else secret
        self._http_app = make_http_app(
            self.root, token=token, public_read=public_read, metrics=self.metrics, store=self.store
        )
        self._http_port = http_port
        self._runner: web.AppRunner | None = None
        self._server = UcxxServer(self._ingest, secret=secret, host=host, port=ucx_port, limits=limits)
        bind_node_gauges(self.metrics, self.root, self._server)
        self.address: NodeAddress | None = None

    async def _ingest(self, records: list[RequestRecord]) -> None:
        started = time.perf_counter()
        try:
            result = await asyncio.to_thread(self.store.commit, records)
        except R3Error as e:
            self.metrics.errors.labels(type(e).__name__).inc()
            log.warning("batch of %d requests refused: %s", len(records), e)
            raise
        self.metrics.ack_latency.observe(time.perf_counter() - started)
        self.metrics.batches.inc()
        self.metrics.requests_ingested.inc(result.committed)
        self.metrics.bytes_ingested.inc(result.bytes_written)
        self.metrics.duplicates.inc(result.duplicates)

    async def start(self) -> NodeAddress:
        ucx = await self._server.start()
        self._runner = web.AppRunner(self._http_app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._http_port)
        await site.start()
        http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.address = NodeAddress(self.host, ucx.port, http_port)
        return self.address

    async def stop(self, drain: bool = True) -> None:
        """Stop ingesting (finishing and acking batches in flight when ``drain``), then serving."""
        try:
            await self._server.stop(drain=drain)
        finally:
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None
            self.store.close()
