"""RoutingWriter: batching, flush, backpressure, error propagation (no sleeps: events only)."""

import threading

import pytest

from r3rdma import R3TimeoutError, RoutingWriter
from r3rdma.errors import DuplicateRequestError, StoreError


class GatedStore:
    """Commits block until the test opens the gate."""

    def __init__(self):
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.batches = []
        self.fail = None

    def commit(self, records):
        self.entered.set()
        assert self.gate.wait(10)
        if self.fail:
            raise self.fail
        self.batches.append([r.request_id for r in records])


def test_flush_waits_for_durability_and_batches(make_record):
    store = GatedStore()
    store.gate.set()
    recs = [make_record(f"r{i}", rows=100) for i in range(10)]  # 600 B each
    with RoutingWriter(store, flush_bytes=2000, flush_interval_s=60) as writer:
        for r in recs:
            writer.submit(r)
        writer.flush(timeout=10)
        assert sum(len(b) for b in store.batches) == 10
        assert max(len(b) for b in store.batches) <= 3  # batches bounded by flush_bytes
        assert writer.requests_committed == 10


def test_backpressure_blocks_submit_until_commit(make_record):
    store = GatedStore()
    writer = RoutingWriter(store, flush_bytes=600, flush_interval_s=0, max_inflight_bytes=1200)
    writer.submit(make_record("a", rows=100))
    assert store.entered.wait(10)
    writer.submit(make_record("b", rows=100))  # 1200 in flight: at the budget
    blocked = threading.Event()
    done = threading.Event()

    def third():
        blocked.set()
        writer.submit(make_record("c", rows=100))
        done.set()

    t = threading.Thread(target=third)
    t.start()
    assert blocked.wait(10)
    assert not done.wait(0.2)  # still blocked: the budget is exhausted
    store.gate.set()
    assert done.wait(10)
    t.join()
    writer.close(timeout=10)
    assert [rid for b in store.batches for rid in b] == ["a", "b", "c"]


def test_commit_error_reaches_the_engine(make_record):
    store = GatedStore()
    store.fail = DuplicateRequestError("request 'a' is already stored")
    store.gate.set()
    writer = RoutingWriter(store, flush_interval_s=0)
    writer.submit(make_record("a"))
    with pytest.raises(DuplicateRequestError, match="already stored"):
        writer.flush(timeout=10)
    store.fail = OSError("disk gone")
    writer.submit(make_record("b"))
    with pytest.raises(StoreError, match="disk gone"):
        writer.flush(timeout=10)
    store.fail = None
    writer.submit(make_record("c"))
    writer.close(timeout=10)
    assert store.batches == [["c"]]


def test_flush_timeout(make_record):
    store = GatedStore()
    writer = RoutingWriter(store, flush_interval_s=0)
    writer.submit(make_record("a"))
    with pytest.raises(R3TimeoutError, match="1 requests not durable"):
        writer.flush(timeout=0.05)
    store.gate.set()
    writer.close(timeout=10)
