"""Moves finished requests off the engine's path: a background thread batches and commits them.

``RoutingWriter.submit`` only enqueues (and blocks when more than ``max_inflight_bytes`` are
waiting: backpressure instead of unbounded memory). A worker thread commits MB-sized batches
to a store (anything with ``commit(records)`` that returns once the data is durable: the
:class:`~r3rdma.local_store.LocalRoutingStore`, or a client of remote store nodes).
An error in a commit is raised to the engine at its next ``submit`` or ``flush``; nothing is
dropped silently.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Protocol, Sequence

from .errors import R3Error, R3TimeoutError, StoreError
from .records import RequestRecord

__all__ = ["RoutingWriter", "RecordStore"]


class RecordStore(Protocol):
    def commit(self, records: Sequence[RequestRecord]) -> object: ...


class RoutingWriter:
    """Batches records and commits them from a background thread."""

    def __init__(
        self,
        store: RecordStore,
        *,
        flush_bytes: int = 8 << 20,
        flush_interval_s: float = 0.05,
        max_inflight_bytes: int = 1 << 30,
    ) -> None:
        self.store = store
        self.flush_bytes = flush_bytes
        self.flush_interval_s = flush_interval_s
        self.max_inflight_bytes = max_inflight_bytes
        self._cond = threading.Condition()
        self._queue: deque[RequestRecord] = deque()
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
        self._thread = threading.Thread(target=self._run, name="r3rdma-writer", daemon=True)
        self._thread.start()

    def submit(self, record: RequestRecord) -> None:
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
        """Flush, then stop the worker."""
        try:
            self.flush(timeout)
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._thread.join(timeout)

    def __enter__(self) -> "RoutingWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
                batch: list[RequestRecord] = []
                size = 0
                while self._queue and (not batch or size + self._queue[0].nbytes <= self.flush_bytes):
                    record = self._queue.popleft()
                    batch.append(record)
                    size += record.nbytes
                self._queued_bytes -= size
                self._first_enqueued = time.monotonic()
            error: BaseException | None = None
            try:
                self.store.commit(batch)
            except BaseException as e:  # handed to the engine thread at its next call
                error = e
            with self._cond:
                self._inflight_bytes -= size
                self._done += len(batch)
                if error is None:
                    self.requests_committed += len(batch)
                    self.bytes_committed += size
                elif self._error is None:
                    self._error = error
                self._cond.notify_all()
