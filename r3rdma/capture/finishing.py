"""Finishing: how a resolved request's rows become a record at its sink.

Given the slots of a finished request (from the request ledger), :class:`Finishing` gathers
its rows from the :class:`~r3rdma.capture.slot_table.SlotTable` and dispatches them by where
the table lives and what the sink declares it takes:

- CPU table, or no sink: gather, copy to the host, build the :class:`RequestRecord` now, and
  hand it to the sink (the record is also returned);
- CUDA with a sink, ``gpu_direct`` (:class:`DeviceRowsSink`): the gathered device rows
  themselves, with a CUDA event the pusher waits on in its own thread;
- CUDA with a sink, staged: an asynchronous copy into pinned host memory
  (:func:`~r3rdma.capture.transfer.stage_to_host`) wrapped as a deferred record; a
  :class:`DeferredSink` (a :class:`~r3rdma.write.writer.RoutingWriter`) resolves it on its own
  thread, any other sink gets it through a :class:`FinishThread` thread started on first use.

The sink protocols it dispatches on live in :mod:`r3rdma.contracts`.

Errors of the store never reach the engine's step path through here. A sink that takes records
from an engine's step path (a :class:`HandOverSink`: a
:class:`~r3rdma.write.writer.RoutingWriter`, whose ``hand_over`` is used instead of ``submit``)
keeps a failed commit to itself (logged with the requests, counted, listed by its
``failures()``, raised by its ``flush``), so one request's failure never refuses the next
request's finish. A sink of the caller's own raises what its ``submit`` raises, for the record
being finished (CPU); on CUDA, the finisher thread's errors are logged with the request and
raised by :meth:`Finishing.flush` (the capturer's ``flush``), not by a later finish.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import numpy as np
import torch

from r3rdma.capture.slot_table import SlotTable
from r3rdma.capture.transfer import DeviceRows, StagedRows, stage_to_host
from r3rdma.contracts import (
    DeferredSink,
    DeviceRowsSink,
    HandOverSink,
    RoutingSink,
    takes_deferred,
    takes_device_rows,
)
from r3rdma.errors import ConfigError
from r3rdma.records import RequestRecord, SharedPrefix

__all__ = [
    "RoutingSink",
    "DeviceRowsSink",
    "DeferredSink",
    "HandOverSink",
    "Finishing",
    "FinishThread",
    "StagedRecord",
    "make_record",
]

log = logging.getLogger("r3rdma")


def make_record(ids: np.ndarray, storage_dtype: np.dtype, meta: dict) -> RequestRecord:
    """The :class:`RequestRecord` of rows ``ids`` (the slot table's dtype) and ``meta`` (its other fields).

    ``meta["shared"] = (source id, rows)``: the first ``rows`` rows are a stored request's
    (:mod:`r3rdma.capture.stored_prefixes`); the record carries the rest, and those rows only as
    the client-side copy a store that cannot resolve the reference gets instead."""
    if storage_dtype == np.uint16:
        ids = ids.view(np.uint16)  # the table holds uint16 bit patterns as int16
    shared = meta.get("shared")
    if shared is None:
        return RequestRecord(ids_TLK=ids, **meta)
    fields = {k: v for k, v in meta.items() if k != "shared"}
    source, rows = shared
    prefix = SharedPrefix(source, rows, ids_TLK=ids[:rows])
    return RequestRecord(ids_TLK=ids[rows:], **{**fields, "start_row": rows}, shared_prefix=prefix)


class StagedRecord:
    """A finished request whose rows are still being copied to pinned host memory.

    ``result()`` waits for the copy (its CUDA event, not the device) and builds the record.
    """

    __slots__ = ("_staged", "_dtype", "_meta", "nbytes")

    def __init__(self, staged: StagedRows, storage_dtype: np.dtype, meta: dict, nbytes: int) -> None:
        self._staged, self._dtype, self._meta, self.nbytes = staged, storage_dtype, meta, nbytes

    @property
    def rollout_id(self) -> str:
        """The rollout the request belongs to."""
        return self._meta["rollout_id"]

    @property
    def request_id(self) -> str:
        """The id the request is stored as."""
        return self._meta["request_id"]

    def result(self) -> RequestRecord:
        """Wait for the copy, then build the record over the pinned rows."""
        # The pinned block returns to torch's pool when `staged` is dropped; the record owns a
        # copy-free numpy view of it until then.
        return make_record(self._staged.wait(), self._dtype, self._meta)


class FinishThread:
    """A thread that waits for finished requests' D2H copies and hands the records to the sink.

    Started on the first CUDA finish (never at import or construction). The engine thread
    only enqueues; the wait on the copy's event, the CRC of the record and the sink's
    back-pressure all happen here.
    """

    def __init__(self, sink: RoutingSink) -> None:
        self.sink = sink
        self.error: BaseException | None = None  # the first error not yet raised (by Finishing.flush)
        self.failed = 0  # records the sink refused (each logged with its request)
        self._queue: queue.Queue[StagedRecord | threading.Event | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="r3rdma-finish", daemon=True)
        self._thread.start()

    def put(self, deferred: StagedRecord) -> None:
        """Queue a staged record for the thread to wait on and hand over (never blocks)."""
        self._queue.put(deferred)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything queued so far was handed to the sink; raise
        :class:`~r3rdma.errors.R3TimeoutError` after ``timeout`` seconds."""
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout):
            from r3rdma.errors import R3TimeoutError

            raise R3TimeoutError(f"finished requests not handed to the sink within {timeout} s")

    def stop(self) -> None:
        """Let the thread finish what is queued, then end it (waits up to 30 s)."""
        self._queue.put(None)
        self._thread.join(30)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self.sink.submit(item.result())
            except BaseException as e:  # raised to the engine at its next flush (Finishing.flush)
                self.failed += 1
                log.error("r3rdma: routing of %s/%s not handed to the sink: %r", item.rollout_id, item.request_id, e)
                if self.error is None:
                    self.error = e


class Finishing:
    """Gathers a finished request's rows and hands them to the sink (see the module docstring).

    ``transfer_mode`` is ``staged`` or ``gpu_direct`` (already resolved and checked by the
    capturer). Records go to the sink's ``hand_over`` when it has one (:class:`HandOverSink`),
    else to its ``submit``; errors of the finisher thread are raised at the next :meth:`flush`.
    """

    def __init__(
        self, *, table: SlotTable, sink: RoutingSink | None, transfer_mode: str, storage_dtype: np.dtype, row_bytes: int
    ) -> None:
        self.table = table
        self.sink = sink
        self.transfer_mode = transfer_mode
        self.storage_dtype = storage_dtype
        self.row_bytes = row_bytes  # one [L, K] row in the storage dtype
        self._finisher: FinishThread | None = None
        # The sink as a taker of device rows; the capturer chose gpu_direct only for such a sink.
        self._device_sink = sink if takes_device_rows(sink) else None
        self._uses_hand_over = isinstance(sink, HandOverSink)

    def finish(self, slots: np.ndarray, meta: dict) -> RequestRecord | None:
        """The record (CPU, or without a sink), or None once the rows are on their way (CUDA)."""
        if self.table.cuda and self.sink is not None:
            if self.transfer_mode == "gpu_direct":
                # The gathered device rows are the payload; the pusher waits on `ready`
                # (a CUDA event) in its own thread before UCX reads them.
                device_sink = self._device_sink
                if device_sink is None:
                    raise ConfigError(
                        f"transfer_mode 'gpu_direct' needs a sink that pushes device memory; {type(self.sink).__name__} does not"
                    )
                rows = self.table.gather(slots)
                ready = torch.cuda.Event()
                ready.record()
                # Device rows leave whole: the pusher sends one device buffer per request.
                fields = {k: v for k, v in meta.items() if k != "shared"}
                self._hand_over(DeviceRows(ids_TLK=rows, ready=ready, **fields))
                return None
            # Gather on the GPU, copy to pinned host memory asynchronously, and let the
            # finisher thread wait for the copy and hand the record over: no sync here.
            staged = stage_to_host(self.table.gather(slots))
            deferred = StagedRecord(staged, self.storage_dtype, meta, int(slots.size) * self.row_bytes)
            if takes_deferred(self.sink):
                # A RoutingWriter resolves it on its own thread, so its flush() also covers
                # records whose copy is still in flight.
                self._hand_over(deferred)
            else:
                if self._finisher is None:
                    self._finisher = FinishThread(self.sink)
                self._finisher.put(deferred)
            return None
        ids = self.table.gather_host(slots)
        record = make_record(ids, self.storage_dtype, meta)
        if self.sink is not None:
            self._hand_over(record)
        return record

    def finish_rows(self, ids: np.ndarray, meta: dict) -> RequestRecord:
        """The record of rows already on the host (``ids``, the table's dtype), handed to the sink."""
        record = make_record(ids, self.storage_dtype, meta)
        if self.sink is not None:
            self._hand_over(record)
        return record

    def _hand_over(self, record: Any) -> None:
        """Give a finished record to the sink: its ``hand_over`` (a :class:`HandOverSink`), else its ``submit``."""
        if self._uses_hand_over:
            self.sink.hand_over(record)  # type: ignore[union-attr]
        else:
            self.sink.submit(record)  # type: ignore[union-attr]

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the finisher thread (if any) handed over everything queued; raise its first error."""
        if self._finisher is not None:
            self._finisher.flush(timeout)
        self.raise_error()

    def stop(self) -> None:
        """Stop the finisher thread, if one was started (a later CUDA finish starts another)."""
        if self._finisher is not None:
            self._finisher.stop()
            self._finisher = None

    def raise_error(self) -> None:
        """Raise the finisher thread's first error not yet raised, if any (then forget it)."""
        if self._finisher is not None and self._finisher.error is not None:
            error, self._finisher.error = self._finisher.error, None
            raise error
