"""A failed commit is said when it fails: the writer logs it from its own thread (logger
``r3rdma``, the requests and why) instead of waiting for the engine's next call, and keeps the
reason of every failed request (``RoutingWriter.failures()``). A user's report: with replicas 2
and one of 2 store nodes SIGKILLed, the failure was logged only when a later request arrived,
and the reason was nowhere but in that log line."""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading

import pytest

from r3rdma import RoutingWriter
from r3rdma.errors import StoreError, TransportError
from r3rdma.transport import TransportLimits
from r3rdma.write.push_client import StoreNodesClient
from r3rdma.write.writer import CommitFailure

from .store_nodes import new_token, start_node


class _Records(logging.Handler):
    """Keeps the ``r3rdma`` logger's records; ``arrived`` is set by the first error."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self.arrived = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.arrived.set()


@pytest.fixture
def r3_log():
    handler = _Records()
    logger = logging.getLogger("r3rdma")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


class BrokenStore:
    """Every commit fails with ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def commit(self, records):
        raise self.error


@pytest.mark.timeout(30)
def test_a_failed_commit_is_logged_from_the_writer_thread_when_it_fails(make_record, r3_log):
    writer = RoutingWriter(BrokenStore(OSError("disk gone")), flush_bytes=1 << 20, flush_interval_s=0)
    writer.submit(make_record("q0", rows=2, rollout_id="r"))
    # No later submit and no flush: the writer says it by itself.
    assert r3_log.arrived.wait(10)
    (record,) = r3_log.records
    assert record.threadName == "r3rdma-writer" and record.levelno == logging.ERROR
    assert "routing of 1 requests not committed: r/q0; OSError: disk gone" in record.getMessage()
    assert writer.failures() == [CommitFailure("r", "q0", "OSError: disk gone")]
    assert writer.failed_requests() == [("r", "q0")]  # as before: ids only

    # The engine's thread still hears of it once, at its next call, as before.
    with pytest.raises(StoreError, match="disk gone") as info:
        writer.submit(make_record("next", rows=2, rollout_id="r"))
    assert info.value.failed_request_ids == [("r", "q0")]
    assert "RoutingWriter.failures() with the reasons" in "".join(info.value.__notes__)
    writer.close(timeout=10)


@pytest.mark.timeout(30)
def test_a_batch_of_many_failed_requests_is_named_first_ten_and_a_count(make_record, r3_log):
    gate = threading.Event()

    class GatedBrokenStore:
        def commit(self, records):
            gate.wait(10)  # the batch holds all 25 once it fails
            raise TransportError("store nodes gone")

    writer = RoutingWriter(GatedBrokenStore(), flush_bytes=1 << 20, flush_interval_s=3600)
    for i in range(25):
        writer.submit(make_record(f"m{i:02d}", rows=2, rollout_id="r"))
    gate.set()
    with pytest.raises(TransportError):
        writer.flush(timeout=10)
    (record,) = r3_log.records
    message = record.getMessage()
    assert message.startswith("r3rdma: routing of 25 requests not committed: r/m00, r/m01, ")
    assert "r/m09 and 15 more; TransportError: store nodes gone" in message and "r/m10" not in message
    assert len(writer.failures()) == 25
    writer.close(timeout=10)


def test_reasons_are_bounded_and_failures_are_frozen_values():
    failure = CommitFailure("r", "q", CommitFailure.reason_of(ValueError("x" * 10_000)))
    assert len(failure.reason) < 2100
    assert failure.reason.startswith("ValueError: xxx") and failure.reason.endswith("xxx") and " chars] ... " in failure.reason
    assert CommitFailure.reason_of(TransportError("short")) == "TransportError: short"
    with pytest.raises(dataclasses.FrozenInstanceError):
        failure.reason = "other"
    assert not hasattr(failure, "__dict__")  # slotted


@pytest.mark.timeout(90)
def test_replicas_2_with_one_of_2_nodes_killed_is_logged_when_the_commit_fails(tmp_path, make_record, r3_log):
    """The user's report, reproduced: the failure is logged without any later request, with
    the store's reason, and kept per request."""
    token = new_token()
    nodes = [start_node(tmp_path / f"node{i}", token) for i in range(2)]
    try:
        # A short connect timeout, as tests/test_replicas.py does: a push to a killed node fails
        # once its connect times out (30 s with the client's default limits).
        limits = TransportLimits(timeout_s=3)
        with StoreNodesClient([n.push_url for n in nodes], secret=token, replicas=2, limits=limits) as client:
            client.check()
            with RoutingWriter(client, flush_interval_s=0) as writer:
                writer.submit(make_record("before", rows=4))
                writer.flush(timeout=30)
                nodes[1].stop(signal.SIGKILL)
                writer.submit(make_record("after", rows=4))
                assert r3_log.arrived.wait(60)
                (record,) = r3_log.records
                assert record.threadName == "r3rdma-writer"
                assert "roll-0/after" in record.getMessage()
                assert "cannot be durable on 2 distinct store nodes" in record.getMessage()
                (failure,) = writer.failures()
                assert (failure.rollout_id, failure.request_id) == ("roll-0", "after")
                assert failure.reason.startswith("TransportError: 1 of 1 requests cannot be durable on 2 distinct store nodes")
                assert nodes[1].push_url in failure.reason
                with pytest.raises(TransportError):
                    writer.flush(timeout=30)  # raised once to the caller, as before
                writer.flush(timeout=30)
    finally:
        for node in nodes:
            node.kill()


def test_the_vllm_sink_queues_after_a_failure_and_adds_what_never_reached_the_writer(make_record, r3_log):
    pytest.importorskip("vllm", reason="the vLLM plug-in's worker module imports vLLM")
    from r3rdma.errors import MissingRowsError
    from r3rdma.integrations.vllm.worker import _ReportingSink

    writer = RoutingWriter(BrokenStore(OSError("disk gone")), flush_interval_s=0)
    sink = _ReportingSink(writer)
    sink.submit(make_record("a", rows=2, rollout_id="r"))
    assert r3_log.arrived.wait(10)
    with pytest.raises(StoreError):
        writer.flush(timeout=10)  # what the engine's caller would have seen
    sink.submit(make_record("b", rows=2, rollout_id="r"))
    sink.refused("r", "c", MissingRowsError("rows 3..5 never computed"))
    try:
        writer.flush(timeout=10)
    except StoreError:
        pass
    assert sink.failures() == [CommitFailure("r", "c", "MissingRowsError: rows 3..5 never computed"),
                               CommitFailure("r", "a", "OSError: disk gone"), CommitFailure("r", "b", "OSError: disk gone")]
    assert len(r3_log.records) == 2  # one line per failed commit, none repeated by the sink
    writer.close(timeout=10)
