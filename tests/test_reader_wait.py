"""RoutingReader.wait_committed: a server client's wait until the routing an engine's response
named is committed and readable, on a local root and on store nodes over HTTP.

The commits here happen in another thread once the reader has polled (an event the reader's own
GETs set), so every wait starts before what it waits for exists; the only pauses are the
polling's own.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from zarr.storage import LocalStore

from r3rdma.errors import ConfigError, InvalidIdError, R3TimeoutError
from r3rdma.read.reader import RoutingReader
from r3rdma.store.local_store import LocalRoutingStore
from r3rdma.store.rollout_index import part_name
from r3rdma.write.push_client import StoreNodesClient

from .store_nodes import new_token, start_node

ENTRY = "roll-0/zarr.json"  # the rollout's index entry point: one GET per poll


class CountingStore(LocalStore):
    """A read-only local root that records every key read, so a test can wait for the reader's
    n-th poll and check that it fetched each index part once."""

    def __init__(self, root) -> None:
        super().__init__(root, read_only=True)
        self.keys: list[str] = []
        self.read = threading.Condition()

    async def get(self, key, prototype, byte_range=None):
        with self.read:
            self.keys.append(key)
            self.read.notify_all()
        return await super().get(key, prototype, byte_range)

    def polls(self) -> int:
        with self.read:
            return self.keys.count(ENTRY)

    def wait_polls(self, n: int, timeout: float = 30) -> None:
        with self.read:
            assert self.read.wait_for(lambda: self.keys.count(ENTRY) >= n, timeout), f"no poll {n} in {timeout} s"


def _committing(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(60)
def test_returns_once_requests_committed_later_are_readable(tmp_path, make_record):
    records = {rid: make_record(rid, rows=5 + i, seed=i) for i, rid in enumerate("abcd")}
    with LocalRoutingStore(tmp_path) as store:
        counting = CountingStore(tmp_path)
        with RoutingReader(counting) as reader:

            def rollout():
                counting.wait_polls(1)  # the rollout does not exist yet when the wait begins
                store.commit([records["a"], records["b"]])
                seen = counting.polls()
                counting.wait_polls(seen + 2)  # a poll found part 1, but not yet "c"
                store.commit([records["c"], records["d"]])

            writer = _committing(rollout)
            reader.wait_committed("roll-0", ["c", "a", "b"], timeout_s=30)
            writer.join(30)
            polls = counting.polls()
            got = reader.get_numpy("roll-0", ["c", "a", "b"])  # no UnknownRolloutError / UnknownRequestError
            for rid in ("c", "a", "b"):
                np.testing.assert_array_equal(got[rid], records[rid].ids_TLK)
            assert counting.polls() == polls  # the read used the index the wait left, no new poll
    # Incremental: every poll read the entry point; each index part was fetched once.
    parts = [k for k in counting.keys if k.startswith(("roll-0/" + part_name(1), "roll-0/" + part_name(2)))]
    assert sorted(parts) == [f"roll-0/{part_name(1)}/zarr.json", f"roll-0/{part_name(2)}/zarr.json"]
    assert polls >= 3


@pytest.mark.timeout(60)
def test_timeout_names_the_rollout_and_what_is_missing(tmp_path, make_record):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("a", rows=4)])
    counting = CountingStore(tmp_path)
    wanted = ["a"] + [f"x{i}" for i in range(7)]
    with RoutingReader(counting) as reader:
        started = time.monotonic()
        with pytest.raises(R3TimeoutError) as info:
            reader.wait_committed("roll-0", wanted, timeout_s=0.3)
        took = time.monotonic() - started
    assert isinstance(info.value, TimeoutError)
    assert str(info.value) == (
        "rollout 'roll-0': 7 of the 8 requests waited for are not committed after 0.3 s "
        "('x0', 'x1', 'x2', 'x3', 'x4' and 2 more); the rollout has 1 committed request"
    )
    assert 0.3 <= took < 2.0, took
    # Backed off from 10 ms towards 200 ms: pauses of 10, 20, 40, 80, 150 ms fill 0.3 s.
    assert 4 <= counting.polls() <= 8, counting.polls()


@pytest.mark.timeout(60)
def test_unknown_rollout_is_not_yet(tmp_path, make_record):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("a", rows=4)])
        with RoutingReader(tmp_path) as reader:
            with pytest.raises(R3TimeoutError, match=r"rollout 'later': 1 of the 1 requests waited for are not "
                                                     r"committed after 0.2 s \('r'\); the rollout does not exist yet"):
                reader.wait_committed("later", ["r"], timeout_s=0.2)
            store.commit([make_record("r", rows=3, rollout_id="later")])
            reader.wait_committed("later", ["r"], timeout_s=30)
            assert reader.get("later", ["r"])["r"].shape[0] == 3


def test_bad_arguments_fail_at_once(tmp_path, make_record):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("a", rows=4)])
    counting = CountingStore(tmp_path)
    with RoutingReader(counting) as reader:
        with pytest.raises(InvalidIdError, match="repeat"):
            reader.wait_committed("roll-0", ["a", "a"])
        with pytest.raises(InvalidIdError):
            reader.wait_committed("roll/0", ["a"])
        with pytest.raises(InvalidIdError, match="one string"):
            reader.wait_committed("roll-0", "a")
        with pytest.raises(ConfigError, match="timeout_s"):
            reader.wait_committed("roll-0", ["a"], timeout_s=-1)
        reader.wait_committed("roll-0", [])  # nothing to wait for
        assert counting.keys == []
        reader.wait_committed("roll-0", ["a"], timeout_s=0)  # committed: one poll, no pause
        assert counting.polls() == 1


@pytest.mark.timeout(120)
def test_store_nodes_over_http(tmp_path, make_record):
    token = new_token()
    nodes = [start_node(tmp_path / f"node{i}", token) for i in range(2)]
    try:
        records = [make_record(f"r{i}", rows=6 + i, seed=i) for i in range(8)]
        with RoutingReader([n.http_url for n in nodes], token=nodes[0].read_token) as reader:
            polled = threading.Event()
            index = reader._indexes.get

            def noting_polls(*args, **kwargs):  # the push starts once the reader has looked
                try:
                    return index(*args, **kwargs)
                finally:
                    polled.set()

            reader._indexes.get = noting_polls

            def push():  # each request on one of the two nodes
                assert polled.wait(30)
                with StoreNodesClient([n.push_url for n in nodes], secret=token, replicas=1) as client:
                    client.commit(records[:4])
                    client.commit(records[4:])

            pusher = _committing(push)
            wanted = ["r7", "r0", "r4", "r2"]
            reader.wait_committed("roll-0", wanted, timeout_s=60)
            pusher.join(60)
            got = reader.get_numpy("roll-0", wanted)
            for rid in wanted:
                np.testing.assert_array_equal(got[rid], records[int(rid[1:])].ids_TLK)
            with pytest.raises(R3TimeoutError, match=r"1 of the 2 requests .*\('never'\); the rollout has 8 committed"):
                reader.wait_committed("roll-0", ["r1", "never"], timeout_s=0.2)
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.timeout(60)
def test_unreachable_or_silent_node_is_retried_until_the_deadline():
    # Refused: every poll fails at once, and the wait goes on to its deadline.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused_url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with RoutingReader(refused_url, timeout_s=5) as reader:
        with pytest.raises(R3TimeoutError, match=r"not committed after 0.3 s \('a'\); the last poll of the index "
                                                 r"failed \(retryable\)"):
            reader.wait_committed("roll-0", ["a"], timeout_s=0.3)
    # Accepts and never answers: the poll in flight is cut off about a second past the deadline,
    # not at the reader's 30 s bound on each wait.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        with RoutingReader(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=30) as reader:
            started = time.monotonic()
            with pytest.raises(R3TimeoutError, match=r"not committed after 0.3 s .*not fetched .* within"):
                reader.wait_committed("roll-0", ["a"], timeout_s=0.3)
            assert time.monotonic() - started < 5
