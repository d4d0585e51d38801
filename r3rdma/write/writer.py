"""Moves finished requests off the engine's path: a background thread batches and commits them.

``RoutingWriter.submit`` only enqueues (and blocks when more than ``max_inflight_bytes`` are
waiting: backpressure instead of unbounded memory). A worker thread commits MB-sized batches
to a store (anything with ``commit(records)`` that returns once the data is durable: the
:class:`~r3rdma.store.local_store.LocalRoutingStore`, or a client of remote store nodes).
An error in a commit is raised to the engine at its next ``submit`` or ``flush``; nothing is
dropped silently.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Protocol, Sequence, runtime_checkable

from r3rdma.errors import ConfigError, R3Error, R3TimeoutError, StoreError
from r3rdma.records import RequestRecord

__all__ = ["DeferredRecord", "DeviceRecordStore", "RoutingWriter", "RecordStore"]


class RecordStore(Protocol):
    """Where a writer commits: ``commit`` returns once ``records`` are durable
    (:class:`~r3rdma.store.local_store.LocalRoutingStore`, :class:`~r3rdma.write.push_client.StoreNodesClient`)."""

    def commit(self, records: Sequence[RequestRecord]) -> object: ...


@runtime_checkable
class DeviceRecordStore(Protocol):
    """A store that can also push device rows (GPU-direct: UCX reads device memory) and measure
    whether that beats staging through pinned host memory: a
    :class:`~r3rdma.write.push_client.StoreNodesClient`. The local store is not one."""

    def commit(self, records: Sequence[RequestRecord]) -> object: ...

    def commit_device(self, items: Sequence[object]) -> object: ...

    def probe_transfer_mode(self, device=None): ...


class DeferredRecord(Protocol):
    """A record still being produced (e.g. its rows are being copied off the GPU).

    ``nbytes`` is known up front (for the in-flight budget); ``result()`` blocks until the
    record exists. The writer resolves it on its own thread, in submission order.
    """

    nbytes: int

    def result(self) -> RequestRecord: ...


class RoutingWriter:
    """Batches records and commits them from a background thread.

    ``submit`` also takes a :class:`DeferredRecord` (``accepts_deferred``): the capturer on
    CUDA hands over records whose device-to-host copy is still in flight, and ``flush`` then
    covers them too.

    Args:
        store: where batches are committed (:class:`RecordStore`).
        flush_bytes: a batch is committed once this many bytes are queued...
        flush_interval_s: ... or once its first record waited this long.
        max_inflight_bytes: bytes queued or being committed; ``submit`` blocks beyond it.
        owns_store: :meth:`close` also closes ``store`` (which must have ``close()``); set by
            :meth:`R3Config.build_writer <r3rdma.config.R3Config.build_writer>`. A store the
            caller passes in stays the caller's to close unless it says otherwise.
    """

    accepts_deferred = True

    @property
    def accepts_device_rows(self) -> bool:
        """Whether ``submit`` takes :class:`~r3rdma.capture.transfer.DeviceRows` (GPU-direct pushes):
        only when the store can push device memory (a :class:`DeviceRecordStore`)."""
        return isinstance(self.store, DeviceRecordStore)

    def probe_transfer_mode(self, device=None):
        """The store's transfer-mode probe (see :meth:`StoreNodesClient.probe_transfer_mode`)."""
        if not isinstance(self.store, DeviceRecordStore):
            raise ConfigError(f"transfer-mode probe needs a store that pushes device memory, got {type(self.store).__name__}")
        return self.store.probe_transfer_mode(device=device)

    def __init__(
        self,
        store: RecordStore,
        *,
        flush_bytes: int = 8 << 20,
        flush_interval_s: float = 0.05,
        max_inflight_bytes: int = 1 << 30,
        owns_store: bool = False,
    ) -> None:
        if flush_bytes <= 0 or max_inflight_bytes <= 0 or flush_interval_s < 0:
            raise ConfigError(
                "need flush_bytes > 0, max_inflight_bytes > 0 and flush_interval_s >= 0, got "
                f"{flush_bytes}, {max_inflight_bytes}, {flush_interval_s}"
            )
        if owns_store and not callable(getattr(store, "close", None)):
            raise ConfigError(f"owns_store=True needs a store with close(), got {type(store).__name__}")
        self.store = store
        self.owns_store = bool(owns_store)
        self.flush_bytes = flush_bytes
        self.flush_interval_s = flush_interval_s
        self.max_inflight_bytes = max_inflight_bytes
        self._cond = threading.Condition()
        self._queue: deque[RequestRecord | DeferredRecord] = deque()
        self._queued_bytes = 0
        self._inflight_bytes = 0  # queued + being committed
        self._submitted = 0
        self._done = 0
        self._error: BaseException | None = None
        self._closing = False
        self._flushers = 0
        self._first_enqueued = 0.0
        self.requests_committed = 0
        self.bytes_committed = 0
        self.commit_failures = 0  # batches whose commit raised (r3rdma.metrics exports it)
        self._thread = threading.Thread(target=self._run, name="r3rdma-writer", daemon=True)
        self._thread.start()

    def submit(self, record: RequestRecord | DeferredRecord) -> None:
        """Queue a finished request; blocks while the in-flight budget is exhausted."""
        with self._cond:
            self._raise_pending()
            if self._closing:
                raise StoreError("RoutingWriter is closed")
            # A record larger than the whole budget is let through alone rather than deadlocking.
            while self._inflight_bytes and self._inflight_bytes + record.nbytes > self.max_inflight_bytes:
                self._cond.wait()
                self._raise_pending()
            if not self._queue:
                self._first_enqueued = time.monotonic()
            self._queue.append(record)
            self._queued_bytes += record.nbytes
            self._inflight_bytes += record.nbytes
            self._submitted += 1
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything submitted so far is durable (or raise its error)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._submitted
            self._flushers += 1
            self._cond.notify_all()
            try:
                while self._done < target:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise R3TimeoutError(f"flush: {target - self._done} requests not durable after {timeout} s")
                    self._cond.wait(remaining)
            finally:
                self._flushers -= 1
            self._raise_pending()

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the worker, then close the store if the writer owns it (``owns_store``).

        The store is closed even when the flush raised (its error is raised after); calling
        ``close`` again does nothing more.
        """
        try:
            self.flush(timeout)
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._thread.join(timeout)
            if self.owns_store:
                self.owns_store = False  # closed once
                self.store.close()

    def __enter__(self) -> "RoutingWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def queued_requests(self) -> int:
        """Records waiting for the worker (not yet in a commit)."""
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    @property
    def inflight_bytes(self) -> int:
        """Bytes queued or being committed (bounded by ``max_inflight_bytes``)."""
        return self._inflight_bytes

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, R3Error):
                raise error
            raise StoreError(f"committing routing failed: {error!r}") from error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._queue:
                    self._cond.wait()
                if self._closing and not self._queue:
                    return
                # Let a batch grow to flush_bytes, but no longer than flush_interval_s after its
                # first record, and not at all while someone waits in flush().
                deadline = self._first_enqueued + self.flush_interval_s
                while not (self._closing or self._flushers or self._queued_bytes >= self.flush_bytes):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                batch: list = []
                size = 0
                while self._queue and (not batch or size + self._queue[0].nbytes <= self.flush_bytes):
                    record = self._queue.popleft()
                    batch.append(record)
                    size += record.nbytes
                self._queued_bytes -= size
                self._first_enqueued = time.monotonic()
            error: BaseException | None = None
            try:
                device = [r for r in batch if getattr(r, "on_device", False)]
                host = [r if isinstance(r, RequestRecord) else r.result() for r in batch if not getattr(r, "on_device", False)]
                if host:
                    self.store.commit(host)
                if device:
                    self.store.commit_device(device)  # GPU-direct: UCX reads device memory
            except BaseException as e:  # handed to the engine thread at its next call
                error = e
            with self._cond:
                self._inflight_bytes -= size
                self._done += len(batch)
                if error is None:
                    self.requests_committed += len(batch)
                    self.bytes_committed += size
                else:
                    self.commit_failures += 1
                    if self._error is None:
                        self._error = error
                self._cond.notify_all()
