"""RoutingReader.collect: a trainer rank's share read while the rollout is being committed."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from r3rdma.errors import InvalidIdError, R3Error, R3TimeoutError
from r3rdma.read.reader import RoutingReader
from r3rdma.store.local_store import LocalRoutingStore


def test_share_arrives_while_commits_run(tmp_path, make_record):
    records = [make_record(f"r{i}", rows=5 + i, seed=i) for i in range(12)]
    share = [f"r{i}" for i in (11, 3, 7, 0)]  # named up front, in the trainer's order
    with LocalRoutingStore(tmp_path) as store, RoutingReader(tmp_path) as reader:
        collector = reader.collect("roll-0", share, poll_s=0.01)
        assert not collector.done()  # the rollout does not exist yet: it keeps polling

        def rollout():
            for start in range(0, 12, 3):
                store.commit(records[start : start + 3])
                time.sleep(0.05)

        writer = threading.Thread(target=rollout)
        writer.start()
        got = collector.result(timeout=30)
        writer.join()
        assert list(got) == share
        for rid in share:
            np.testing.assert_array_equal(got[rid], records[int(rid[1:])].ids_TLK)
        assert collector.ready == collector.total == 4 and collector.reads >= 1
        packed = collector.packed()
        assert packed.request_ids == tuple(share)
        assert packed.cu_seqlens.tolist() == [0, 16, 24, 36, 41]
        np.testing.assert_array_equal(packed.ids_TLK[16:24].numpy(), records[3].ids_TLK)


def test_timeout_names_what_is_missing_and_waiting_goes_on(tmp_path, make_record):
    with LocalRoutingStore(tmp_path) as store, RoutingReader(tmp_path) as reader:
        store.commit([make_record("a", rows=4)])
        with reader.collect("roll-0", ["a", "late"], poll_s=0.01) as collector:
            with pytest.raises(R3TimeoutError, match=r"1 of the 2 requests of this share.*'late'"):
                collector.result(timeout=0.3)
            store.commit([make_record("late", rows=3)])
            assert collector.result(timeout=30)["late"].shape[0] == 3


def test_closed_before_done_says_so_and_bad_ids_fail_up_front(tmp_path, make_record):
    with LocalRoutingStore(tmp_path) as store, RoutingReader(tmp_path) as reader:
        store.commit([make_record("a", rows=4)])
        with pytest.raises(InvalidIdError, match="repeat"):
            reader.collect("roll-0", ["a", "a"])
        collector = reader.collect("roll-0", ["a", "never"], poll_s=0.01)
        collector.close()
        with pytest.raises(R3Error, match="closed with 1 of its 2 requests not read"):
            collector.result(timeout=5)
