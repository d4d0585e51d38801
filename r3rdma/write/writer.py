"""Moves finished requests off the engine's path: a background thread batches and commits them.

``RoutingWriter.submit`` only enqueues (and blocks when more than ``max_inflight_bytes`` are
waiting: backpressure instead of unbounded memory). A worker thread commits MB-sized batches
to a store (anything with ``commit(records)`` that returns once the data is durable: the
:class:`~r3rdma.store.local_store.LocalRoutingStore`, or a client of remote store nodes).
A failed commit is logged when it fails, on the worker thread (logger ``r3rdma``, error:
the requests it lost, first 10 and a count, and why), counted (``commit_failures``,
``requests_failed``), and raised at the next ``flush`` (and at the next ``submit``; never at
:meth:`RoutingWriter.hand_over`, the engine's step path); nothing is dropped silently: the raised
error names every request that failed since the previous one (``error.failed_request_ids``,
``error.errors``), and :meth:`RoutingWriter.failures` lists every failed request with its reason
(:class:`CommitFailure`), so an engine can report them or push them again. A batch that a
store refuses for its data (a bad record, a segment conflict) is committed again record by
record, so one bad record fails alone instead of taking its batch with it. A record whose
shared prefix the store cannot resolve (:class:`~r3rdma.errors.SharedRowsMissingError`: the
source request is not on that store) is, in that record-by-record pass, committed again with
the shared rows inline when it carries a copy of them (``SharedPrefix.ids_TLK``), else it fails
like any refused record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from r3rdma.contracts import Closable, DeferredRecord, DeviceRecordStore, EncodingStore, RecordStore
from r3rdma.errors import ConfigError, R3Error, R3TimeoutError, ShapeMismatchError, SharedRowsMissingError, StoreError
from r3rdma.records import RequestRecord
from r3rdma.store.part_retry import commit_each, retry_part_by_part
from r3rdma.store.pools import submit

if TYPE_CHECKING:
    from r3rdma.capture.transfer import DeviceRows

__all__ = ["CommitFailure", "DeferredRecord", "DeviceRecordStore", "RoutingWriter", "RecordStore"]

log = logging.getLogger("r3rdma")

_ENCODING = 3  # batches a writer has encoding at once (see RoutingWriter.__init__)
# Batches a writer has written and not yet durable: a store publishing them together
# (LocalRoutingStore: one flush for all) then waits for the disk once for several batches.
_PUBLISHING = 4

_MAX_REASON_CHARS = 2000


@dataclass(frozen=True, slots=True)
class CommitFailure:
    """A request whose routing the store did not make durable, and why.

    ``reason``: the error's type and message (``"TransportError: 3 of 3 requests cannot be
    durable on 2 distinct store nodes: ..."``). Ids are None for a deferred record whose rows
    could not even be produced."""

    rollout_id: str | None
    request_id: str | None
    reason: str

    @staticmethod
    def reason_of(error: BaseException) -> str:
        """``"<type>: <message>"`` of ``error``, at most 2000 characters (a store's message
        names at most 10 requests and each node's error, far below that; an error that
        embeds more is cut in the middle)."""
        reason = f"{type(error).__name__}: {error}"
        if len(reason) > _MAX_REASON_CHARS:
            half = _MAX_REASON_CHARS // 2
            reason = f"{reason[:half]} ... [{len(reason) - 2 * half} chars] ... {reason[-half:]}"
        return reason


class RoutingWriter:
    """Batches records and commits them from a background thread.

    ``submit`` also takes a :class:`DeferredRecord` (``accepts_deferred``, which declares it a
    :class:`~r3rdma.capture.finishing.DeferredSink`): the capturer on
    CUDA hands over records whose device-to-host copy is still in flight, and ``flush`` then
    covers them too. A capturer hands records over with :meth:`hand_over` (a
    :class:`~r3rdma.capture.finishing.HandOverSink`), which never raises another request's
    failure into the engine's step.

    Args:
        store: where batches are committed (:class:`RecordStore`).
        flush_bytes: a batch is committed once this many bytes are queued...
        flush_interval_s: ... or once its first record waited this long.
        max_inflight_bytes: bytes queued or being committed; ``submit`` blocks beyond it.
        owns_store: :meth:`close` also closes ``store`` (which must have ``close()``); set by
            :func:`~r3rdma.integrations.builders.build_writer`. A store the
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
        if owns_store and not isinstance(store, Closable):
            raise ConfigError(f"owns_store=True needs a store with close(), got {type(store).__name__}")
        self.store = store
        self.owns_store = bool(owns_store)
        self.flush_bytes = flush_bytes
        self.flush_interval_s = flush_interval_s
        self.max_inflight_bytes = max_inflight_bytes
        self._cond = threading.Condition()
        self._queue: deque[RequestRecord | DeferredRecord | DeviceRows] = deque()
        self._queued_bytes = 0
        self._inflight_bytes = 0  # queued + being committed
        self._submitted = 0
        self._done = 0
        self._error: BaseException | None = None  # the first error not yet raised to the engine
        self._errors: list[BaseException] = []  # every error since the last one raised
        self._unreported: list[tuple[str | None, str | None]] = []  # their requests, in order
        self._failures: list[CommitFailure] = []  # every failed request, ever, with its reason
        self._closing = False
        self._flushers = 0
        self._first_enqueued = 0.0
        self.requests_committed = 0
        self.bytes_committed = 0
        self.commits = 0  # batches handed to the store, committed or failed (each pays a commit's fixed cost)
        self.commit_failures = 0  # commits that raised and lost records (r3rdma.metrics exports it)
        self.requests_failed = 0
        # A store that encodes apart from writing (LocalRoutingStore.prepare) has the next
        # batches encoded on these threads while the worker writes the one before them:
        # compressing is most of a commit, and in turn with the write it left the disk idle
        # meanwhile. Several at once: one batch's serial Python (gathering its rows, the
        # chunks' CRCs) runs while the others' chunks compress without the GIL (H100 host, 16
        # cores, 8 MB batches: 0.59-0.62 of min(disk, zstd) with two, 0.66-0.73 with three).
        self._prepare = store.prepare if isinstance(store, EncodingStore) else None
        self._encoder = ThreadPoolExecutor(_ENCODING, thread_name_prefix="r3rdma-writer-encode") if self._prepare else None
        self._staging = _ENCODING if self._prepare else 1  # batches taken ahead of the one written
        self._stopped: BaseException | None = None  # what ended the worker thread early (a bug, not a commit's failure)
        self._thread = threading.Thread(target=self._run_guarded, name="r3rdma-writer", daemon=True)
        self._thread.start()

    def submit(self, record: RequestRecord | DeferredRecord | DeviceRows) -> None:
        """Queue a finished request; blocks while the in-flight budget is exhausted.

        Raises the failed commits of earlier requests not raised yet (see the module
        docstring), before queueing this one. A record without rows is refused here
        (:class:`ShapeMismatchError`), before anything is queued: a store cannot hold an array
        of 0 rows.
        """
        self._submit(record, raise_earlier=True)

    def hand_over(self, record: RequestRecord | DeferredRecord | DeviceRows) -> None:
        """Queue a finished request from an engine's step path (what a capturer calls): as
        :meth:`submit`, but nothing about another request is raised here.

        A failed commit of earlier requests stays where the store's errors go: logged when it
        failed (naming the requests), counted (``commit_failures``, ``requests_failed``),
        listed by :meth:`failures`, raised by the next :meth:`flush`. The same when the
        writer's thread has stopped: this record is counted failed and logged, not raised.
        Raised here, because they are the caller's bugs: a record without rows
        (:class:`ShapeMismatchError`) and a writer already closed (:class:`StoreError`). Blocks
        while the in-flight budget is exhausted (backpressure), like :meth:`submit`.
        """
        self._submit(record, raise_earlier=False)

    def _submit(self, record: RequestRecord | DeferredRecord | DeviceRows, *, raise_earlier: bool) -> None:
        lost: BaseException | None = None  # the error that stopped the writer's thread, if it did
        failure: CommitFailure | None = None  # this record's, when it cannot be queued (hand_over)
        with self._cond:
            if raise_earlier:
                self._raise_pending()
            if self._closing:
                raise StoreError("RoutingWriter is closed")
            if self._stopped is not None:
                lost = self._stopped
            ids = getattr(record, "ids_TLK", None)
            rows = None if ids is None or not getattr(ids, "shape", None) else int(ids.shape[0])
            if record.nbytes <= 0 or rows == 0:
                rollout_id, request_id = _ids_of(record)
                raise ShapeMismatchError(
                    f"request {request_id!r} of rollout {rollout_id!r}: a record holds at least 1 routing row, got "
                    f"{rows if rows is not None else 0} rows ({record.nbytes} bytes); nothing was queued"
                )
            # A record larger than the whole budget is let through alone rather than deadlocking.
            while lost is None and self._inflight_bytes and self._inflight_bytes + record.nbytes > self.max_inflight_bytes:
                self._cond.wait()
                if raise_earlier:
                    self._raise_pending()
                lost = self._stopped
            if lost is not None:
                if raise_earlier:
                    raise StoreError(f"RoutingWriter's thread stopped ({lost!r}): nothing more can be committed")
                failure = CommitFailure(*_ids_of(record), CommitFailure.reason_of(lost))
                self._failures.append(failure)
                self.requests_failed += 1
            else:
                if not self._queue:
                    self._first_enqueued = time.monotonic()
                self._queue.append(record)
                self._queued_bytes += record.nbytes
                self._inflight_bytes += record.nbytes
                self._submitted += 1
                self._cond.notify_all()
        if failure is not None:  # said outside the lock, as _finish does (a handler may be slow)
            log.error(
                "r3rdma: routing of %s/%s not committed: the writer's thread stopped (%s)",
                failure.rollout_id,
                failure.request_id,
                failure.reason,
            )

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything submitted so far is durable (or raise its error)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._submitted
            self._flushers += 1
            self._cond.notify_all()
            try:
                while self._done < target:
                    if self._stopped is not None:
                        raise StoreError(
                            f"flush: the writer's thread stopped ({self._stopped!r}); "
                            f"{target - self._done} requests will not be committed"
                        ) from self._stopped
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
            if self._encoder is not None:
                self._encoder.shutdown(wait=False)
            if self.owns_store:
                self.owns_store = False  # closed once
                close_store = getattr(self.store, "close", None)
                if not callable(close_store):  # refused at construction; only a hand-set owns_store gets here
                    raise ConfigError(f"owns_store=True needs a store with close(), got {type(self.store).__name__}")
                close_store()

    def __enter__(self) -> RoutingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def queued_requests(self) -> int:
        """Records waiting for the worker (not yet in a commit)."""
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        """Bytes of the records waiting for the worker (not yet in a commit)."""
        return self._queued_bytes

    @property
    def inflight_bytes(self) -> int:
        """Bytes queued or being committed (bounded by ``max_inflight_bytes``)."""
        return self._inflight_bytes

    def failed_requests(self) -> list[tuple[str | None, str | None]]:
        """``(rollout_id, request_id)`` of every request whose commit failed, in failure order
        (ids are None for a deferred record whose rows could not even be produced)."""
        with self._cond:
            return [(f.rollout_id, f.request_id) for f in self._failures]

    def failures(self) -> list[CommitFailure]:
        """Every request whose commit failed, with why (:class:`CommitFailure`), in failure
        order; cumulative (the raised errors hand each failure to the engine only once)."""
        with self._cond:
            return list(self._failures)

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, errors, failed = self._error, self._errors, self._unreported
            self._error, self._errors, self._unreported = None, [], []
            if not isinstance(error, R3Error):
                cause = error
                error = StoreError(f"committing routing failed: {cause!r}")
                error.__cause__ = cause
            # Attached to whichever R3Error this is (the store's own type is kept for the
            # engine to catch), so as attributes of this instance, not of a class.
            setattr(error, "failed_request_ids", failed)  # noqa: B010
            setattr(error, "errors", errors)  # noqa: B010
            error.add_note(
                f"r3rdma: {len(failed)} requests failed to commit ({len(errors)} errors) since the last error raised: "
                + ", ".join(f"{r}/{q}" for r, q in failed[:10])
                + (" ..." if len(failed) > 10 else "")
                + " (error.failed_request_ids lists them all; RoutingWriter.failures() with the reasons)"
            )
            raise error

    def _run_guarded(self) -> None:
        """:meth:`_run`; if it raises (a bug: commit errors are counted per batch in
        :meth:`_finish`), the records still queued fail with that error and every waiter is
        woken: flush() and close() raise instead of waiting for a thread that is gone."""
        try:
            self._run()
        except BaseException as e:
            log.exception("r3rdma: the writer's thread stopped; routing queued from now on is not committed")
            with self._cond:
                self._stopped = e
                lost = [_ids_of(r) for r in self._queue]
                self._queue.clear()
                self._queued_bytes = 0
                self._failures += [CommitFailure(r, q, CommitFailure.reason_of(e)) for r, q in lost]
                self.requests_failed += len(lost)
                self._cond.notify_all()

    def _run(self) -> None:
        # Each batch passes three stages in order: staged (being encoded by the store, when it
        # encodes apart: ``prepare`` on the encoder thread), written (``commit_async``: the
        # store makes it durable on its own thread), finished (durable or failed, counted). The
        # next batches (up to _ENCODING) are encoded while one is written, and written while one
        # is made durable.
        staged: deque[_Job] = deque()  # being encoded, oldest first
        publishing: deque[_Job] = deque()  # written, being made durable, oldest first
        while True:
            if staged:
                with self._cond:
                    encode_next = bool(self._queue)
                if not encode_next:  # nothing to encode meanwhile: write them now
                    while staged:
                        self._write(staged.popleft(), publishing)
            while publishing:
                with self._cond:
                    while not (self._queue or self._closing or publishing[0].settled()):
                        self._cond.wait()  # its future's callback notifies
                    write_next = bool(self._queue)
                if write_next:
                    break
                self._finish(publishing.popleft())  # nothing to write meanwhile: count it (flush() may wait for it)
            batch, size = self._take_batch()
            if batch is None:
                return
            staged.append(self._stage(batch, size))
            if len(staged) > self._staging:  # the oldest written while the newer ones encode
                self._write(staged.popleft(), publishing)

    def _take_batch(self) -> tuple[list | None, int]:
        """The next batch to commit, once one is due; ``(None, 0)`` when closing with none left."""
        with self._cond:
            while not self._closing and not self._queue:
                self._cond.wait()
            if self._closing and not self._queue:
                return None, 0
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
        return batch, size

    def _stage(self, batch: list, size: int) -> _Job:
        """A job for ``batch``: its host records resolved, their encoding started where the
        store encodes apart, device rows committed (GPU-direct: UCX reads device memory)."""
        job = _Job(batch, size)
        for r in batch:
            if getattr(r, "on_device", False):
                continue
            try:
                job.host.append(r if isinstance(r, RequestRecord) else r.result())
            except BaseException as e:  # this record's rows never arrived; the others go on
                job.failures.append((e, [r]))
        if job.host and self._encoder is not None and self._prepare is not None:
            job.encoding = submit(self._encoder, self._prepare, job.host)
        device = [r for r in batch if getattr(r, "on_device", False)]
        if device:
            store = self.store
            if isinstance(store, DeviceRecordStore):
                job.failures += self._commit(store.commit_device, device)
            else:  # a capturer sends device rows only where accepts_device_rows said yes
                reason = f"device rows need a store that pushes device memory, got {type(store).__name__}"
                job.failures.append((StoreError(reason), device))
        return job

    def _write(self, job: _Job, publishing: deque[_Job]) -> None:
        """Write ``job``'s host records (the store makes them durable on its own thread) and
        append it to ``publishing``; count the batches written before it that are durable
        already, and the oldest ones until at most ``_PUBLISHING`` are in flight."""
        host = job.host
        commit_async = getattr(self.store, "commit_async", None)
        if host and commit_async is not None:
            # The store writes this batch now and makes it durable on its own thread: the
            # next batch is written while this one is flushed (LocalRoutingStore).
            try:
                job.future = commit_async(job.encoding.result() if job.encoding is not None else host)
                job.future.add_done_callback(self._wake)
            except BaseException as e:
                if _retry_each(e, len(host)):
                    job.failures += self._commit_each(self.store.commit, host)
                else:
                    job.failures.append((e, host))
        elif host:
            job.failures += self._commit(self.store.commit, host)
        publishing.append(job)
        while publishing and publishing[0].settled():
            self._finish(publishing.popleft())
        while len(publishing) > _PUBLISHING:
            self._finish(publishing.popleft())

    def _wake(self, _future: Future) -> None:
        with self._cond:
            self._cond.notify_all()

    def _finish(self, job: _Job) -> None:
        """Wait until ``job``'s batch is durable (or failed), then count it."""
        if job.future is not None:
            try:
                job.future.result()
            except BaseException as e:
                job.failures.append((e, job.host))
        failures = [(error, CommitFailure.reason_of(error), items) for error, items in job.failures]
        if failures:
            with self._cond:
                for error, reason, items in failures:  # handed to the engine thread at its next call
                    ids = [_ids_of(x) for x in items]
                    self.commit_failures += 1
                    self.requests_failed += len(ids)
                    self._failures += [CommitFailure(r, q, reason) for r, q in ids]
                    self._unreported += ids
                    self._errors.append(error)
                    if self._error is None:
                        self._error = error
        # Said now, from this thread: the engine's thread hears of it only at its next call,
        # which may come much later (or never, at the end of a rollout). Logged once failures()
        # lists it and before flush() returns, outside the lock (a handler may be slow).
        for _, reason, items in failures:
            log.error(
                "r3rdma: routing of %d requests not committed: %s%s; %s",
                len(items),
                ", ".join(f"{r}/{q}" for r, q in map(_ids_of, items[:10])),
                f" and {len(items) - 10} more" if len(items) > 10 else "",
                reason,
            )
        with self._cond:
            self._inflight_bytes -= job.size
            self._done += len(job.batch)
            self.commits += 1
            self.requests_committed += len(job.batch) - sum(len(items) for *_, items in failures)
            self.bytes_committed += job.size - sum(x.nbytes for *_, items in failures for x in items)
            self._cond.notify_all()

    def _commit(self, commit, items: list) -> list[tuple[BaseException, list]]:
        """Commit ``items``; if the data is refused, again one by one, so only the bad ones fail
        (:mod:`r3rdma.store.part_retry`). A store that made some of them durable and says which
        it did not (``error.not_durable``: store nodes that could not hold every request on
        enough nodes) fails only those."""
        try:
            commit(items)
            return []
        except BaseException as e:
            not_durable = getattr(e, "not_durable", None)
            if not_durable is not None:
                return [(e, list(not_durable))]
            if not _retry_each(e, len(items)):
                return [(e, list(items))]
        return self._commit_each(commit, items)

    @staticmethod
    def _commit_each(commit, items: list) -> list[tuple[BaseException, list]]:
        """Commit each of ``items`` on its own; a record refused for its shared prefix
        (:class:`SharedRowsMissingError`) is committed again with the shared rows inline
        (:meth:`RequestRecord.prefix_inlined`) when it carries them. Returns the failures."""
        parts = [[item] for item in items]
        failures = []
        for part, outcome in zip(parts, commit_each(commit, parts)):
            if isinstance(outcome, SharedRowsMissingError) and isinstance(part[0], RequestRecord):
                inlined = part[0].prefix_inlined()
                if inlined is not None:
                    log.info(
                        "r3rdma: %s/%s: %s; storing it with its shared rows inline",
                        part[0].rollout_id,
                        part[0].request_id,
                        outcome,
                    )
                    outcome = commit_each(commit, [inlined])[0]
            if isinstance(outcome, BaseException):
                failures.append((outcome, part))
        return failures


@dataclass(eq=False)
class _Job:
    """A batch the worker took: its commit (a future while the store publishes it) and what failed."""

    batch: list
    size: int
    failures: list = field(default_factory=list)  # (error, the records it lost)
    future: Future | None = None
    host: list = field(default_factory=list)
    encoding: Future | None = None  # the store's prepare of ``host``, on the writer's encoder thread

    def settled(self) -> bool:
        """Whether the batch's commit has finished, durable or failed (never blocks)."""
        return self.future is None or self.future.done()


def _retry_each(error: BaseException, records: int) -> bool:
    """Whether a commit of ``records`` that raised ``error`` is tried again record by record: a
    refusal of the data (:func:`retry_part_by_part`), or a shared prefix refused even for one
    record (it may be stored with its rows inline, :meth:`RoutingWriter._commit_each`)."""
    return retry_part_by_part(error, records) or isinstance(error, SharedRowsMissingError)


def _ids_of(item: object) -> tuple[str | None, str | None]:
    """``(rollout_id, request_id)`` of a record, device rows or deferred record (None if unknown)."""
    return getattr(item, "rollout_id", None), getattr(item, "request_id", None)
