"""LocalRoutingStore: commit protocol, idempotence, conflicts, visibility, crash leftovers."""

import json
import os
import shutil
import time

import numpy as np
import pytest
import zarr

from r3rdma import LocalRoutingStore, RoutingReader, UnknownRequestError, UnknownRolloutError
from r3rdma.errors import DuplicateRequestError, InvalidIdError, ShapeMismatchError, StoreError
from r3rdma.records import RequestRecord


def test_commit_and_read_back_many_requests(tmp_path, make_record):
    recs = [make_record(f"r{i}", rows=1 + 37 * i) for i in range(20)]
    with LocalRoutingStore(tmp_path, chunk_rows=64) as store:
        result = store.commit(recs[:12])
        store.commit(recs[12:])
    assert result.committed == 12 and result.bytes_written == sum(r.nbytes for r in recs[:12])
    got = RoutingReader(tmp_path).get_numpy("roll-0", [r.request_id for r in recs])
    for r in recs:
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)
    # Few files: one shard per committed batch, not one per request or layer.
    shard_files = [f for d, _, fs in os.walk(tmp_path / "roll-0") for f in fs if f != "zarr.json"]
    assert len(shard_files) == 2


def test_resubmit_same_bytes_is_idempotent(tmp_path, make_record):
    rec = make_record("a")
    with LocalRoutingStore(tmp_path) as store:
        store.commit([rec])
        again = store.commit([rec, rec])
    assert again.committed == 0 and again.duplicates == 2
    assert RoutingReader(tmp_path).info("roll-0").request_ids == ("a",)


def test_same_id_different_bytes_refused(tmp_path, make_record):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("a", seed=1)])
        with pytest.raises(DuplicateRequestError, match="already stored"):
            store.commit([make_record("a", seed=2)])
        with pytest.raises(DuplicateRequestError, match="twice in one batch"):
            store.commit([make_record("b", seed=1), make_record("b", seed=2)])
    np.testing.assert_array_equal(RoutingReader(tmp_path).get_numpy("roll-0", ["a"])["a"], make_record("a", seed=1).ids_TLK)


def test_geometry_mismatch_refused(tmp_path, make_record):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("a", layers=3)])
        with pytest.raises(ShapeMismatchError, match="stores routing with"):
            store.commit([make_record("b", layers=4)])


def test_continuation_appends_a_segment(tmp_path, make_record):
    first = make_record("conv", rows=5, seed=1)
    second = make_record("conv", rows=4, seed=2, start_row=5)
    with LocalRoutingStore(tmp_path) as store:
        store.commit([first])
        store.commit([second])
        with pytest.raises(DuplicateRequestError, match="only start_row 9 would extend it"):
            store.commit([make_record("conv", rows=2, seed=3, start_row=7)])
    got = RoutingReader(tmp_path).get_numpy("roll-0", ["conv"])["conv"]
    np.testing.assert_array_equal(got, np.concatenate([first.ids_TLK, second.ids_TLK]))


def test_second_writer_refused(tmp_path):
    with LocalRoutingStore(tmp_path):
        with pytest.raises(StoreError, match="owned by another writer"):
            LocalRoutingStore(tmp_path)
    LocalRoutingStore(tmp_path).close()  # released on close


def test_crash_leftover_array_invisible_and_removed(tmp_path, make_record):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("a")])
    # Simulate a crash after the array and its index part were written but before the entry
    # point counted them.
    orphan = zarr.create_array(str(tmp_path / "roll-0"), name="b00000002", shape=(4, 3, 2), dtype="uint8")
    orphan[:] = 1
    shutil.copytree(tmp_path / "roll-0" / "i00000001", tmp_path / "roll-0" / "i00000002")
    reader = RoutingReader(tmp_path)
    assert reader.info("roll-0").request_ids == ("a",)
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("b")])
    assert (tmp_path / "roll-0" / "b00000002").exists()  # reused name, now referenced
    part = json.loads((tmp_path / "roll-0" / "i00000002" / "zarr.json").read_text())["attributes"]["r3rdma"]
    assert list(part["requests"]) == ["b"] and part["requests"]["b"]["segments"][0]["array"] == "b00000002"
    np.testing.assert_array_equal(RoutingReader(tmp_path).get_numpy("roll-0", ["b"])["b"], make_record("b").ids_TLK)


def test_delete_rollout(tmp_path, make_record):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("a")])
        store.delete_rollout("roll-0")
        with pytest.raises(UnknownRolloutError):
            store.delete_rollout("roll-0")
    with pytest.raises(UnknownRolloutError, match="roll-0"):
        RoutingReader(tmp_path).get("roll-0", ["a"])


def test_invalid_ids_touch_no_file(tmp_path, make_record):
    rec = make_record("a")
    with pytest.raises(InvalidIdError):
        RequestRecord("../escape", "a", rec.ids_TLK, rec.layer_map, rec.num_experts)
    with pytest.raises(InvalidIdError):
        RequestRecord("roll", "a/b", rec.ids_TLK, rec.layer_map, rec.num_experts)
    reader = RoutingReader(tmp_path)
    for bad in ["..", "x/../../etc", "", "a" * 201]:
        with pytest.raises(InvalidIdError):
            reader.get(bad, ["a"])
        with pytest.raises(InvalidIdError):
            reader.get("roll", [bad])
    assert list(tmp_path.iterdir()) == []


def test_disk_error_leaves_no_partial_data(tmp_path, make_record, monkeypatch):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("a")])
        import r3rdma.store.layout as layout

        def boom(*a, **k):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(layout, "fsync_paths", boom)
        with pytest.raises(StoreError, match="No space left"):
            store.commit([make_record("b")])
        monkeypatch.undo()
        store.commit([make_record("c")])  # recovers once the fault is gone
    reader = RoutingReader(tmp_path)
    assert reader.info("roll-0").request_ids == ("a", "c")
    with pytest.raises(UnknownRequestError, match="'b'"):
        reader.get("roll-0", ["b"])


def test_a_request_that_would_straddle_a_chunk_starts_at_its_boundary(tmp_path, make_record):
    """A data-parallel rank reads requests whose neighbours belong to other ranks, and readers
    fetch whole chunks: a request packed across a chunk it shares would drag its neighbours' rows
    along. Requests that fit in a chunk's remainder still share it (no padding for short ones)."""
    rows = [30, 150, 50, 60, 20, 100, 1]
    recs = [make_record(f"r{i}", rows=n) for i, n in enumerate(rows)]
    with LocalRoutingStore(tmp_path, chunk_rows=100, min_chunk_rows=100) as store:
        store.commit(recs)
    part = json.loads((tmp_path / "roll-0" / "i00000001" / "zarr.json").read_text())["attributes"]["r3rdma"]
    offsets = [part["requests"][r.request_id]["segments"][0]["offset"] for r in recs]
    # 30 @0 | 150 does not fit the 70 left: @100 | 50 fits the 50 left: @250 | 60 @300 | 20 fits: @360
    # | 100 does not fit the 20 left: @400 | 1 @500
    assert offsets == [0, 100, 250, 300, 360, 400, 500]
    array = zarr.open_array(str(tmp_path / "roll-0" / "b00000001"), mode="r")
    assert array.shape[0] == 501 and part["shards"]["b00000001"]["rows"] == 501
    assert not array[30:100].any() and not array[380:400].any()  # the skipped rows hold the fill value
    got = RoutingReader(tmp_path).get_numpy("roll-0", [r.request_id for r in recs])
    for r in recs:
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)


def test_chunks_follow_the_batch_median_request_length(tmp_path, make_record):
    """Short requests get short chunks (a rank decodes little of its neighbours' rows), long
    ones the configured maximum; each batch array states its own chunk shape."""
    short = [make_record(f"s{i}", rows=100 + i) for i in range(9)]  # median 104 -> 128-row chunks
    tiny = [make_record(f"t{i}", rows=5) for i in range(9)]  # -> the 64-row minimum
    long = [make_record(f"l{i}", rows=1500) for i in range(3)]  # -> the 1024-row maximum
    with LocalRoutingStore(tmp_path) as store:
        for batch in (short, tiny, long):
            store.commit(batch)
    entry = RoutingReader(tmp_path)
    shards = {}
    for n in (1, 2, 3):
        part = json.loads((tmp_path / "roll-0" / f"i0000000{n}" / "zarr.json").read_text())["attributes"]["r3rdma"]
        shards.update(part["shards"])
    assert [shards[f"b0000000{n}"]["chunk_rows"] for n in (1, 2, 3)] == [128, 45, 1024]  # 45: all 9 tiny in one chunk
    assert zarr.open_array(str(tmp_path / "roll-0" / "b00000001"), mode="r").chunks == (128, 3, 2)
    got = entry.get_numpy("roll-0", [r.request_id for r in short + tiny + long])
    for r in short + tiny + long:
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)


def test_requests_that_fit_one_chunk_are_packed_without_gaps(tmp_path, make_record):
    recs = [make_record(f"s{i}", rows=7) for i in range(40)]  # 280 rows: a single chunk
    with LocalRoutingStore(tmp_path, chunk_rows=1024, min_chunk_rows=1024) as store:
        result = store.commit(recs)
    assert result.bytes_written == sum(r.nbytes for r in recs)
    part = json.loads((tmp_path / "roll-0" / "i00000001" / "zarr.json").read_text())["attributes"]["r3rdma"]
    assert [part["requests"][r.request_id]["segments"][0]["offset"] for r in recs] == [7 * i for i in range(40)]


# -- commits in flight: written now, made durable by the publisher thread, in order -----------------


class _HeldFlush:
    """Replaces the store's fsync: the first flush waits for ``release`` and then does what
    ``outcome`` says (None: flush for real; an exception: raise it); later ones flush for real."""

    def __init__(self, monkeypatch, outcome=None):
        import threading

        import r3rdma.store.layout as layout

        self.entered, self.release, self.outcome, self.calls = threading.Event(), threading.Event(), outcome, 0
        real = layout.fsync_paths

        def fsync_paths(paths):
            self.calls += 1
            if self.calls == 1:
                self.entered.set()
                assert self.release.wait(30)
                if self.outcome is not None:
                    raise self.outcome
            real(paths)

        monkeypatch.setattr(layout, "fsync_paths", fsync_paths)


def _listing(path):
    return sorted(p.name for p in path.iterdir())


def _commit_held(store, make_record, monkeypatch, outcome=None):
    """Commit "a", then start committing "b" and hold its flush: (the held flush, b's future)."""
    store.commit([make_record("a")])
    held = _HeldFlush(monkeypatch, outcome)
    future = store.commit_async([make_record("b")])
    assert held.entered.wait(30)
    return held, future


def test_a_commit_in_flight_is_invisible_and_the_next_one_is_written_meanwhile(tmp_path, make_record, monkeypatch):
    with LocalRoutingStore(tmp_path) as store:
        held, first = _commit_held(store, make_record, monkeypatch)
        second = store.commit_async([make_record("c")])  # written while "b" is being flushed
        assert "b00000003" in _listing(tmp_path / "roll-0") and not first.done() and not second.done()
        # Readers see neither: the entry point still counts one part.
        assert RoutingReader(tmp_path).info("roll-0").request_ids == ("a",)
        held.release.set()
        assert first.result(30).committed == 1 and second.result(30).committed == 1
    assert RoutingReader(tmp_path).info("roll-0").request_ids == ("a", "b", "c")


def test_a_failed_flush_fails_the_commits_written_after_it_and_leaves_no_trace(tmp_path, make_record, monkeypatch):
    with LocalRoutingStore(tmp_path) as store:
        held, first = _commit_held(store, make_record, monkeypatch, OSError(5, "Input/output error"))
        second = store.commit_async([make_record("c")])  # planned on top of "b"
        held.release.set()
        with pytest.raises(StoreError, match="Input/output error"):
            first.result(30)
        with pytest.raises(StoreError, match="earlier commit"):
            second.result(30)
        assert RoutingReader(tmp_path).info("roll-0").request_ids == ("a",)
        # The next commit starts again from the disk: "c" again, then "d", under the numbers
        # the failed commits had used (their arrays and parts removed first).
        assert store.commit([make_record("c"), make_record("d")]).committed == 2
        assert _listing(tmp_path / "roll-0") == ["b00000001", "b00000002", "i00000001", "i00000002", "zarr.json"]
    reader = RoutingReader(tmp_path)
    assert reader.info("roll-0").request_ids == ("a", "c", "d")
    np.testing.assert_array_equal(reader.get_numpy("roll-0", ["d"])["d"], make_record("d").ids_TLK)
    with LocalRoutingStore(tmp_path) as store:  # reopening finds nothing to clean up
        assert _listing(tmp_path / "roll-0") == ["b00000001", "b00000002", "i00000001", "i00000002", "zarr.json"]


def test_a_delete_waits_for_commits_in_flight(tmp_path, make_record, monkeypatch):
    import threading

    with LocalRoutingStore(tmp_path) as store:
        held, pending = _commit_held(store, make_record, monkeypatch)
        deleter = threading.Thread(target=store.delete_rollout, args=("roll-0",))
        deleter.start()
        deleter.join(0.3)
        assert deleter.is_alive()  # waits for "b" to be durable before deleting under it
        held.release.set()
        deleter.join(30)
        assert pending.result(30).committed == 1
        assert store.rollouts() == {}


def test_a_writer_writes_the_next_batch_while_the_store_flushes_one(tmp_path, make_record, monkeypatch):
    from r3rdma.write.writer import RoutingWriter

    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("warm")])
        held = _HeldFlush(monkeypatch)
        recs = [make_record(f"r{i}", rows=50) for i in range(6)]
        with RoutingWriter(store, flush_bytes=recs[0].nbytes * 2, flush_interval_s=0) as writer:
            for r in recs[:2]:
                writer.submit(r)
            assert held.entered.wait(30)
            for r in recs[2:]:
                writer.submit(r)
            # The batches after the held one are written (not yet durable) while it waits.
            deadline = time.monotonic() + 30
            while "b00000003" not in _listing(tmp_path / "roll-0") and time.monotonic() < deadline:
                time.sleep(0.01)
            assert "b00000003" in _listing(tmp_path / "roll-0")
            assert RoutingReader(tmp_path).info("roll-0").request_ids == ("warm",)
            held.release.set()
            writer.flush(30)
        assert writer.requests_committed == 6 and writer.failed_requests() == []
    assert RoutingReader(tmp_path).info("roll-0").request_ids == ("warm", *(r.request_id for r in recs))


def test_a_prepared_batch_is_encoded_before_the_lock_and_a_duplicate_reencodes_it(tmp_path, make_record):
    """``prepare`` encodes a batch as if every record were new (no lock); a batch prepared
    before a record of it was stored skips that duplicate and is encoded again under the lock,
    its other records placed as if committed alone (same bytes on disk)."""
    recs = [make_record(f"p{i}", rows=n, num_experts=300) for i, n in enumerate([70, 150, 20, 90])]
    with LocalRoutingStore(tmp_path, chunk_rows=64, min_chunk_rows=64) as store:
        early = store.prepare(recs)  # p1 is committed between its preparation and its commit
        assert store.commit(recs[1:2]).committed == 1
        got = store.commit_async(early).result(30)
        assert (got.committed, got.duplicates) == (3, 1)
        assert store.commit_async(store.prepare([make_record("q", rows=5, num_experts=300)])).result(30).committed == 1
    with LocalRoutingStore(tmp_path / "alone", chunk_rows=64, min_chunk_rows=64) as store:
        store.commit(recs[1:2])
        store.commit([recs[0], *recs[2:]])
    assert (tmp_path / "roll-0" / "b00000002/c/0/0/0").read_bytes() == (tmp_path / "alone/roll-0/b00000002/c/0/0/0").read_bytes()
    reader = RoutingReader(tmp_path)
    got = reader.get_numpy("roll-0", [r.request_id for r in recs] + ["q"])
    for r in recs:
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)
