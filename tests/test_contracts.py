"""The protocols of r3rdma.contracts against the objects that fulfil them.

Capabilities are asked with ``isinstance`` against these protocols. From Python 3.12 (the GPU
machines' Python) that looks attributes up statically (``inspect.getattr_static``), past
``__getattr__`` and without running properties: an object that only forwards an attribute
through ``__getattr__`` no longer has it. So each check here is made both ways.
"""

from __future__ import annotations

import inspect

import pytest

from r3rdma.contracts import (
    Closable,
    DeferredSink,
    DeviceRecordStore,
    DeviceRowsSink,
    EncodingStore,
    HandOverSink,
    takes_deferred,
    takes_device_rows,
)
from r3rdma.store.local_store import LocalRoutingStore
from r3rdma.write.push_client import StoreNodesClient
from r3rdma.write.writer import RoutingWriter

_MEMBERS = {
    Closable: ("close",),
    HandOverSink: ("hand_over",),
    DeferredSink: ("accepts_deferred", "submit"),
    DeviceRowsSink: ("accepts_device_rows", "submit", "probe_transfer_mode"),
    EncodingStore: ("prepare", "commit_async"),
    DeviceRecordStore: ("commit", "commit_device", "probe_transfer_mode"),
}


def _statically(obj, protocol) -> bool:
    """``isinstance(obj, protocol)`` as Python 3.12+ decides it, on any Python."""
    return all(inspect.getattr_static(obj, name, None) is not None for name in _MEMBERS[protocol])


def _fulfils(obj, protocol) -> bool:
    return isinstance(obj, protocol) and _statically(obj, protocol)


def test_the_writer_and_the_stores_fulfil_what_they_name(tmp_path):
    store = LocalRoutingStore(str(tmp_path / "store"))
    writer = RoutingWriter(store, owns_store=True)
    try:
        assert _fulfils(store, EncodingStore) and _fulfils(store, Closable) and not isinstance(store, DeviceRecordStore)
        for protocol in (HandOverSink, DeferredSink, DeviceRowsSink, Closable):
            assert _fulfils(writer, protocol), protocol.__name__
        assert takes_deferred(writer) and not takes_device_rows(writer)  # the local store writes host bytes
        assert all(inspect.getattr_static(StoreNodesClient, n, None) for n in _MEMBERS[DeviceRecordStore])
        assert all(inspect.getattr_static(StoreNodesClient, n, None) for n in _MEMBERS[Closable])
    finally:
        writer.close()


def test_the_vllm_plug_in_sink_has_what_the_capturer_asks_of_it_statically(tmp_path):
    """The plug-in's sink wraps the writer and forwards the rest through ``__getattr__``; what
    the capturer asks by protocol it spells out, or on Python 3.12 the capturer refused to own
    it (no ``close``) and skipped its ``hand_over``."""
    pytest.importorskip("vllm", reason="the vLLM plug-in's worker module imports vLLM")
    from r3rdma.integrations.vllm.worker import _ReportingSink

    writer = RoutingWriter(LocalRoutingStore(str(tmp_path / "store")), owns_store=True)
    sink = _ReportingSink(writer)
    try:
        for protocol in (HandOverSink, DeferredSink, DeviceRowsSink, Closable):
            assert _fulfils(sink, protocol), protocol.__name__
        assert takes_deferred(sink) and not takes_device_rows(sink)
    finally:
        sink.close()
