"""A store node: ingests routing over UCX into a local Zarr root and serves it over HTTP."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import tempfile
import time
from pathlib import Path

from aiohttp import web

from r3rdma.errors import R3Error
from r3rdma.records import RequestRecord
from r3rdma.store.local_store import CommitResult, LocalRoutingStore, PreparedBatch
from r3rdma.transport import TransportLimits, UcxxServer
from r3rdma.transport.auth import derive_admin_token, derive_read_token

from .address import NodeAddress
from .http_app import make_http_app
from .metrics import NodeMetrics, bind_node_gauges
from .part_retry import commit_each, retry_part_by_part
from .read_workers import ReadWorkers, WorkerSettings, reuse_port_socket

__all__ = ["StoreNode", "NodeAddress"]

log = logging.getLogger("r3rdma.store")


class StoreNode:
    """Owns one store root. ``start`` listens on UCX and HTTP; ``stop`` drains.

    ``secret`` authenticates pushes (UCX hello); the HTTP service takes only tokens derived
    from it: ``derive_read_token(secret)`` (kept as :attr:`read_token`) for GET/HEAD and
    ``derive_admin_token(secret)`` for DELETE.

    Each received batch is committed (written, fsynced, indexed) in a worker thread before the
    transport acks it, so an ack always means durable.

    ``http_workers``: with 0 this process serves HTTP itself; with N > 0, N read-worker
    processes serve the HTTP port (store/read_workers.py) and this process only ingests,
    commits and answers the DELETE and /metrics requests they pass on.
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
        http_workers: int = 0,
        layers_per_chunk: int | None = None,
        slice_layout: bool = True,
    ) -> None:
        if not isinstance(http_workers, int) or http_workers < 0:
            raise ValueError(f"http_workers: expected an int >= 0, got {http_workers!r}")
        self.root = Path(root)
        self.host = host
        self.http_workers = http_workers
        # Read workers' HTTP counters and the node's control socket live here (removed at stop).
        self._run_dir = tempfile.mkdtemp(prefix="r3rdma-node-") if http_workers else None
        self.metrics = NodeMetrics(workers_dir=self._run_dir)
        self.store = LocalRoutingStore(
            self.root, zstd_level=zstd_level, chunk_rows=chunk_rows, layers_per_chunk=layers_per_chunk, slice_layout=slice_layout
        )
        # HTTP never takes the secret: reads take a token derived from it, deletes another
        # (transport/auth.py), so a sniffed read can neither push nor delete.
        self.read_token = derive_read_token(secret)
        self._admin_token = derive_admin_token(secret)
        self._public_read = public_read
        self._http_app = make_http_app(
            self.root,
            read_token=self.read_token,
            admin_token=self._admin_token,
            public_read=public_read,
            metrics=self.metrics,
            store=self.store,
        )
        self._workers: ReadWorkers | None = None
        self._listener: socket.socket | None = None
        self._http_port = http_port
        self._runner: web.AppRunner | None = None
        self._server = UcxxServer(self._ingest, secret=secret, host=host, port=ucx_port, limits=limits)
        bind_node_gauges(self.metrics, self.root, self._server)
        self.address: NodeAddress | None = None
        self._waiting: list[tuple[list[RequestRecord], asyncio.Future]] = []
        self._committer: asyncio.Task | None = None
        self._answering: set[asyncio.Task] = set()  # groups written, acked once durable

    async def _ingest(self, records: list[RequestRecord]) -> None:
        """Make one client batch durable (the transport acks when this returns).

        Group commit: batches that arrive while a commit is being written wait, then are
        committed together in one write + fsync + index replace. Three groups are in flight at
        once: one encoded while the one before it is written and the one before that is
        flushed by the store's publisher thread; groups are written and published in arrival
        order, and each batch is acked only once its group is durable
        (``LocalRoutingStore.commit_async``).
        Transfer probes never get here: the transport acks them without calling the handler.
        """
        started = time.perf_counter()
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((records, done))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_waiting())
        try:
            result = await done
        except R3Error as e:
            self.metrics.errors.labels(type(e).__name__).inc()
            log.warning("batch of %d requests refused: %s", len(records), e)
            raise
        self.metrics.ack_latency.observe(time.perf_counter() - started)
        self.metrics.batches.inc()
        self.metrics.requests_ingested.inc(result.committed)
        self.metrics.bytes_ingested.inc(result.bytes_written)
        self.metrics.duplicates.inc(result.duplicates)

    async def _commit_waiting(self) -> None:
        """Commit the waiting batches group by group, in arrival order: a group is encoded
        (``LocalRoutingStore.prepare``, no lock) while the group before it is written, then
        written once that one is (its ``commit_async``); each is acked once durable."""
        writing: asyncio.Task | None = None  # the previous group's write
        while True:
            if not self._waiting:
                if writing is None:
                    return
                await writing  # batches arriving meanwhile form the next group
                writing = None
                continue
            group, self._waiting = self._waiting, []
            merged = [r for records, _ in group for r in records]
            try:
                prepared = await asyncio.to_thread(self.store.prepare, merged)
            except BaseException as e:
                if writing is not None:
                    await writing  # refusals are retried batch by batch after the groups before
                    writing = None
                await self._refused(group, e)
                continue
            if writing is not None:
                await writing
            writing = asyncio.create_task(self._write_group(group, prepared))

    async def _write_group(self, group, prepared: PreparedBatch) -> None:
        """Write a prepared group; its batches are answered once it is durable."""
        try:
            # Written now; durable once the future resolves (the store's publisher thread
            # flushes it while the next group is encoded and written here).
            durable = await asyncio.to_thread(self.store.commit_async, prepared)
        except BaseException as e:
            await self._refused(group, e)
            return
        task = asyncio.create_task(self._answer(group, asyncio.wrap_future(durable)))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _answer(self, group, durable: asyncio.Future) -> None:
        """Ack a group's batches once its commit is durable; if the flush failed, each batch
        gets that failure (not the data's fault; the store then starts again from the disk)."""
        try:
            result = await durable
        except BaseException as e:
            await self._refused(group, e)
            return
        for i, (_, done) in enumerate(group):
            if not done.done():
                # Metrics count per batch: credit the group's totals to its first batch.
                done.set_result(result if i == 0 else CommitResult(0, 0, 0))

    async def _refused(self, group, error: BaseException) -> None:
        """Answer a group whose commit raised ``error``: one batch refused for its data (a
        conflicting duplicate, a geometry mismatch) has the batches committed one by one, so
        each client gets its own answer; any other error (a failing disk) is every batch's
        answer (store/part_retry.py)."""
        if retry_part_by_part(error, len(group)):
            outcomes = await asyncio.to_thread(commit_each, self.store.commit, [records for records, _ in group])
        else:
            outcomes = [error] * len(group)
        for (_, done), outcome in zip(group, outcomes):
            if done.done():
                continue
            if isinstance(outcome, BaseException):
                done.set_exception(outcome)
            else:
                done.set_result(outcome)

    async def start(self) -> NodeAddress:
        """Start the UCX server and the read service (in-process, or read workers on the HTTP
        port); return where the node listens."""
        ucx = await self._server.start()
        # aiohttp (3.14) has no separate header-read timeout: a connection that sent part of
        # a request and stalls would stay open until the fd limit (issue 19). Its keep-alive
        # timer, though, is armed when a connection is made and again after each response,
        # and closes the connection if no complete request has arrived by then (the handler
        # is idle, waiting for one); trickling bytes do not re-arm it. Set to the node's
        # network-step deadline it bounds both the wait for a request's headers and an idle
        # keep-alive connection; a request being handled is never cut by it.
        timeout = self._server.limits.timeout_s
        self._runner = web.AppRunner(self._http_app, access_log=None, keepalive_timeout=timeout)
        await self._runner.setup()
        if self._run_dir is None:
            site = web.TCPSite(self._runner, self.host, self._http_port)
            await site.start()
            http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        else:
            http_port = await self._start_workers(timeout)
        self.address = NodeAddress(self.host, ucx.port, http_port)
        return self.address

    async def _start_workers(self, keepalive_timeout_s: float) -> int:
        """Reserve the HTTP port, start the read workers on it; serve the control socket."""
        assert self._run_dir is not None and self._runner is not None
        # Bound, never listening: it reserves the port (port 0: picks it) for the workers.
        self._listener = reuse_port_socket(self.host, self._http_port, listen=False)
        port = self._listener.getsockname()[1]
        control = f"{self._run_dir}/control.sock"
        await web.UnixSite(self._runner, control).start()
        settings = WorkerSettings(
            root=str(self.root.resolve()),
            read_token=self.read_token,
            admin_token=self._admin_token,
            public_read=self._public_read,
            control=control,
            keepalive_timeout_s=keepalive_timeout_s,
            host=self.host,
            port=port,
        )
        self._workers = ReadWorkers(self.http_workers, settings, self._run_dir)
        await self._workers.start()
        return port

    async def stop(self, drain: bool = True) -> None:
        """Stop ingesting (finishing and acking batches in flight when ``drain``), then serving."""
        try:
            await self._server.stop(drain=drain)
        finally:
            if self._workers is not None:
                await self._workers.stop()
                self._workers = None
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None
            if self._run_dir is not None:
                shutil.rmtree(self._run_dir, ignore_errors=True)
            self.store.close()
