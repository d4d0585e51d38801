"""What the capture and write layers expect of the objects handed to them, in one place.

The capturer hands finished requests to a *sink*; a writer commits batches to a *store*. Both
take any object with the right methods (tests pass lists and in-memory stores), so these are
structural :class:`~typing.Protocol` s, and what an object can do beyond the minimum is asked
with ``isinstance`` against a ``runtime_checkable`` protocol here, never with ``getattr``
probes spread through the code. The implementations name the protocols they fulfil:

- sinks: :class:`~r3rdma.write.writer.RoutingWriter` is a :class:`RoutingSink`,
  :class:`HandOverSink`, :class:`DeferredSink` and (over store nodes) :class:`DeviceRowsSink`;
- stores: :class:`~r3rdma.store.local_store.LocalRoutingStore` is a :class:`RecordStore` and
  :class:`EncodingStore`; :class:`~r3rdma.write.push_client.StoreNodesClient` a
  :class:`DeviceRecordStore`; both are :class:`Closable`.

This module imports nothing of r3rdma at run time, so every layer may import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, runtime_checkable

if TYPE_CHECKING:
    from r3rdma.records import RequestRecord

__all__ = [
    "Closable",
    "DeferredRecord",
    "DeferredSink",
    "DeviceRecordStore",
    "DeviceRowsSink",
    "EncodingStore",
    "HandOverSink",
    "RecordStore",
    "RoutingSink",
    "takes_deferred",
    "takes_device_rows",
]


@runtime_checkable
class Closable(Protocol):
    """A sink or store its owner closes (``owns_sink`` / ``owns_store``)."""

    def close(self, *args: Any) -> object:
        """Release what it holds (a writer also makes what it queued durable first)."""
        ...


# -- sinks: where a capturer hands finished requests ---------------------------------------------


class RoutingSink(Protocol):
    """Where finished requests go (a :class:`~r3rdma.write.writer.RoutingWriter`, a test list...)."""

    def submit(self, record: RequestRecord) -> None:
        """Take a finished request's record (may block for back-pressure; raises what went wrong before)."""
        ...


@runtime_checkable
class DeviceRowsSink(Protocol):
    """A sink that can take :class:`~r3rdma.capture.transfer.DeviceRows` (GPU-direct pushes) and
    measure whether that beats staging: a :class:`~r3rdma.write.writer.RoutingWriter`.

    ``accepts_device_rows`` says whether it can *now*: a writer over store nodes can, a writer
    over the local store cannot (its store writes host bytes), so the attribute is a value, not
    only a presence.
    """

    @property
    def accepts_device_rows(self) -> bool:
        """Whether :meth:`submit` takes device rows now."""
        ...

    def submit(self, record: Any) -> None:
        """Take a finished request: a host record, or its rows still on the device
        (:class:`~r3rdma.capture.transfer.DeviceRows`)."""
        ...

    def probe_transfer_mode(self, device=None):
        """Measure GPU-direct against staged pushes; return a :class:`~r3rdma.write.device_push.ProbeResult`."""
        ...


@runtime_checkable
class DeferredSink(Protocol):
    """A sink whose ``submit`` also takes a :class:`DeferredRecord` (rows still being copied off
    the GPU) and resolves it on its own thread, so its ``flush`` covers records in flight too: a
    :class:`~r3rdma.write.writer.RoutingWriter` (``accepts_deferred = True``). Other sinks get
    finished records from a :class:`~r3rdma.capture.finishing.FinishThread`."""

    accepts_deferred: bool

    def submit(self, record: RequestRecord | DeferredRecord) -> None:
        """Take a finished request: a record, or one whose rows are still being copied to the host."""
        ...


@runtime_checkable
class HandOverSink(Protocol):
    """A sink with a ``hand_over`` for records finished on an engine's step path: it queues the
    record and never raises about another request (a failed commit of an earlier one is logged,
    counted and reported by the sink itself): a :class:`~r3rdma.write.writer.RoutingWriter`.
    Its ``hand_over`` takes what its ``submit`` takes."""

    def hand_over(self, record: Any) -> None:
        """Queue a finished request; raise only about this record (or a sink already closed)."""
        ...


def takes_device_rows(sink: object) -> TypeGuard[DeviceRowsSink]:
    """Whether ``sink`` takes device rows now (a :class:`DeviceRowsSink` that says it does)."""
    return isinstance(sink, DeviceRowsSink) and bool(sink.accepts_device_rows)


def takes_deferred(sink: object) -> TypeGuard[DeferredSink]:
    """Whether ``sink`` resolves deferred records itself (a :class:`DeferredSink` that says it does)."""
    return isinstance(sink, DeferredSink) and bool(sink.accepts_deferred)


class DeferredRecord(Protocol):
    """A record still being produced (e.g. its rows are being copied off the GPU).

    ``nbytes`` is known up front (for the in-flight budget); ``result()`` blocks until the
    record exists. The writer resolves it on its own thread, in submission order.
    """

    nbytes: int

    def result(self) -> RequestRecord:
        """Block until the record's rows exist; return the record (raises what producing it raised)."""
        ...


# -- stores: where a writer commits ----------------------------------------------------------------


class RecordStore(Protocol):
    """Where a writer commits: ``commit`` returns once ``records`` are durable
    (:class:`~r3rdma.store.local_store.LocalRoutingStore`, :class:`~r3rdma.write.push_client.StoreNodesClient`)."""

    def commit(self, records: Sequence[RequestRecord]) -> object:
        """Make ``records`` durable; return once they are (raise if any is not)."""
        ...


@runtime_checkable
class DeviceRecordStore(Protocol):
    """A store that can also push device rows (GPU-direct: UCX reads device memory) and measure
    whether that beats staging through pinned host memory: a
    :class:`~r3rdma.write.push_client.StoreNodesClient`. The local store is not one."""

    def commit(self, records: Sequence[RequestRecord]) -> object:
        """Make host ``records`` durable; return once they are (raise if any is not)."""
        ...

    def commit_device(self, items: Sequence[object]) -> object:
        """Make :class:`~r3rdma.capture.transfer.DeviceRows` durable, pushing their device buffers directly."""
        ...

    def probe_transfer_mode(self, device=None):
        """Measure GPU-direct against staged pushes; return a :class:`~r3rdma.write.device_push.ProbeResult`."""
        ...


@runtime_checkable
class EncodingStore(Protocol):
    """A store that encodes a batch apart from writing it (a
    :class:`~r3rdma.store.local_store.LocalRoutingStore`): a writer then has the next batches
    encoded on other threads while the one before them is written."""

    def prepare(self, records: Sequence[RequestRecord]) -> object:
        """Encode ``records`` (compress, checksum) without writing them; return the prepared batch."""
        ...

    def commit_async(self, records: Any) -> Future:
        """Start writing records or a prepared batch; the future completes once they are durable."""
        ...
