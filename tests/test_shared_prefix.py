"""Shared prefixes (issue #35): a sample's record says "my rows 0..P-1 are rows 0..P-1 of request X
of the same rollout" and carries only its own rows; the store points the sample's index segments
at X's stored bytes. Readers (RoutingReader, zarr-python per docs/FORMAT.md) see whole requests."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from r3rdma.errors import InvalidIdError, SegmentOverlapError, SharedRowsMissingError, ShapeMismatchError, StoreError
from r3rdma.read.reader import RoutingReader
from r3rdma.records import RequestRecord, SharedPrefix, checksum
from r3rdma.store.local_store import LocalRoutingStore
from r3rdma.write.writer import RoutingWriter

ROLLOUT = "grpo-0"
LAYERS = (0, 1, 2)


def _rows(rng, n):
    return rng.integers(0, 16, size=(n, len(LAYERS), 2)).astype(np.uint8)


def _plain(request_id, ids, start_row=0, **kw):
    return RequestRecord(ROLLOUT, request_id, ids, LAYERS, 16, start_row=start_row, **kw)


def _sample(request_id, source_ids, prefix_rows, own, *, source="src", with_copy=True):
    """A sample sharing ``prefix_rows`` rows of ``source``; returns (record, its whole rows)."""
    copy = source_ids[:prefix_rows].copy() if with_copy else None
    record = _plain(request_id, own, start_row=prefix_rows, shared_prefix=SharedPrefix(source, prefix_rows, copy))
    return record, np.concatenate([source_ids[:prefix_rows], own])


def _part(root: Path, seq: int) -> dict:
    return json.loads((root / ROLLOUT / f"i{seq:08d}" / "zarr.json").read_bytes())["attributes"]["r3rdma"]


def _read_format_snippet(root, rollout_id, request_id):
    """docs/FORMAT.md's zarr-python snippet, verbatim in substance (no r3rdma involved)."""
    group = zarr.open_group(root, path=rollout_id, mode="r")
    entry = None
    for n in range(1, group.attrs["r3rdma"]["parts"] + 1):
        entry = group[f"i{n:08d}"].attrs["r3rdma"]["requests"].get(request_id, entry)
    parts = [group[s["array"]][s["offset"] : s["offset"] + s["rows"]] for s in entry["segments"]]
    return np.concatenate(parts)


# -- the record API -----------------------------------------------------------------------------


def test_record_validation_says_what_was_expected():
    rng = np.random.default_rng(0)
    own = _rows(rng, 4)
    with pytest.raises(ShapeMismatchError, match="expected start_row 5, got 0"):
        _plain("s", own, shared_prefix=SharedPrefix("src", 5))
    with pytest.raises(ShapeMismatchError, match="expected final=True"):
        _plain("s", own, start_row=5, final=False, shared_prefix=SharedPrefix("src", 5))
    with pytest.raises(InvalidIdError, match="its own id 's'"):
        _plain("s", own, start_row=5, shared_prefix=SharedPrefix("s", 5))
    with pytest.raises(ShapeMismatchError, match="total_rows None or 9, got 7"):
        _plain("s", own, start_row=5, total_rows=7, shared_prefix=SharedPrefix("src", 5))
    with pytest.raises(ShapeMismatchError, match="rows must be an int >= 1"):
        SharedPrefix("src", 0)
    with pytest.raises(InvalidIdError):
        SharedPrefix("../x", 3)
    with pytest.raises(ShapeMismatchError, match="3-D numpy array of 5 rows"):
        SharedPrefix("src", 5, _rows(rng, 4))
    with pytest.raises(ShapeMismatchError, match=r"shared_prefix.ids_TLK must be \[5, 3, 2\] uint8"):
        _plain("s", own, start_row=5, shared_prefix=SharedPrefix("src", 5, np.zeros((5, 3, 2), np.uint16)))
    record = _plain("s", own, start_row=5, total_rows=9, shared_prefix=SharedPrefix("src", 5))
    assert record.num_rows == 4 and record.nbytes == own.nbytes and record.crc32c == checksum(own)


def test_prefix_inlined_is_the_whole_request_in_two_segments():
    rng = np.random.default_rng(1)
    src, own = _rows(rng, 12), _rows(rng, 4)
    record, whole = _sample("s", src, 7, own)
    part, rest = record.prefix_inlined()
    assert (part.start_row, part.num_rows, part.final) == (0, 7, False)
    assert (rest.start_row, rest.num_rows, rest.final, rest.total_rows, rest.shared_prefix) == (7, 4, True, 11, None)
    np.testing.assert_array_equal(np.concatenate([part.ids_TLK, rest.ids_TLK]), whole)
    assert _sample("t", src, 7, own, with_copy=False)[0].prefix_inlined() is None


# -- the local store ----------------------------------------------------------------------------


@pytest.mark.parametrize("same_batch", [False, True])
def test_samples_read_back_whole_and_point_at_the_source_bytes(tmp_path, same_batch):
    rng = np.random.default_rng(2)
    src_ids = _rows(rng, 50)
    source = _plain("src", src_ids)
    samples = [_sample(f"s{i}", src_ids, 30, _rows(rng, 5 + i)) for i in range(4)]
    with LocalRoutingStore(tmp_path) as store:
        if same_batch:
            result = store.commit([source, *(r for r, _ in samples)])
            own_part = 1
        else:
            store.commit([source])
            result = store.commit([r for r, _ in samples])
            own_part = 2
        # Only the samples' own rows were written: the batch array holds no prefix row.
        own_bytes = sum(r.nbytes for r, _ in samples)
        assert result.bytes_written == own_bytes + (source.nbytes if same_batch else 0)
        array = _part(tmp_path, own_part)["arrays"][0]
        stored_rows = zarr.open_array(str(tmp_path / ROLLOUT / array), mode="r").shape[0]
        own_rows = sum(r.num_rows for r, _ in samples) + (50 if same_batch else 0)
        # (placement may leave a few fill rows before a request that does not fit a chunk's rest)
        assert own_rows <= stored_rows < own_rows + 30
    requests = _part(tmp_path, own_part)["requests"]
    src_seg = (_part(tmp_path, 1)["requests"]["src"]["segments"])[0]
    for record, whole in samples:
        entry = requests[record.request_id]
        first, own = entry["segments"]
        assert (first["array"], first["offset"], first["rows"], first["start_row"]) == (src_seg["array"], src_seg["offset"], 30, 0)
        assert first["crc32c"] == checksum(src_ids[:30])
        assert (own["rows"], own["start_row"], own["crc32c"]) == (record.num_rows, 30, record.crc32c)
        assert entry["rows"] == 30 + record.num_rows
    with RoutingReader(tmp_path) as reader:  # verify=True: every segment's CRC-32C is checked
        got = reader.get_numpy(ROLLOUT, ["src", *(r.request_id for r, _ in samples)])
    np.testing.assert_array_equal(got["src"], src_ids)
    for record, whole in samples:
        np.testing.assert_array_equal(got[record.request_id], whole)
        np.testing.assert_array_equal(_read_format_snippet(str(tmp_path), ROLLOUT, record.request_id), whole)


def test_a_cut_inside_a_later_source_segment_gets_the_cut_rows_checksum(tmp_path):
    """The source is stored in two segments (two turns); the prefix ends inside the second, in
    an array of an earlier commit: the cut's CRC-32C is hashed from the stored rows."""
    rng = np.random.default_rng(3)
    src_ids = _rows(rng, 60)
    with LocalRoutingStore(tmp_path) as store:
        store.commit([_plain("src", src_ids[:20])])
        store.commit([_plain("src", src_ids[20:], start_row=20)])
        record, whole = _sample("s", src_ids, 35, _rows(rng, 6))
        store.commit([record])
    segments = _part(tmp_path, 3)["requests"]["s"]["segments"]
    assert [(s["start_row"], s["rows"]) for s in segments] == [(0, 20), (20, 15), (35, 6)]
    assert segments[1]["crc32c"] == checksum(src_ids[20:35])
    assert segments[1]["array"] == _part(tmp_path, 2)["arrays"][0]
    with RoutingReader(tmp_path) as reader:
        np.testing.assert_array_equal(reader.get_numpy(ROLLOUT, ["s"])["s"], whole)


def test_a_sample_may_share_rows_of_a_sample(tmp_path):
    """A reference to a referencing request resolves to the first source's bytes."""
    rng = np.random.default_rng(4)
    src_ids = _rows(rng, 40)
    a, a_whole = _sample("a", src_ids, 30, _rows(rng, 8))
    b, b_whole = _sample("b", a_whole, 34, _rows(rng, 3), source="a")
    with LocalRoutingStore(tmp_path) as store:
        store.commit([_plain("src", src_ids), a, b])
    first = _part(tmp_path, 1)["requests"]["b"]["segments"]
    assert [(s["start_row"], s["rows"]) for s in first] == [(0, 30), (30, 4), (34, 3)]
    with RoutingReader(tmp_path) as reader:
        got = reader.get_numpy(ROLLOUT, ["a", "b"])
    np.testing.assert_array_equal(got["a"], a_whole)
    np.testing.assert_array_equal(got["b"], b_whole)


def test_a_missing_short_or_pending_source_is_refused_naming_it(tmp_path):
    rng = np.random.default_rng(5)
    src_ids = _rows(rng, 20)
    with LocalRoutingStore(tmp_path) as store:
        record, _ = _sample("s", src_ids, 10, _rows(rng, 3))
        with pytest.raises(SharedRowsMissingError, match=r"'s' of rollout 'grpo-0' shares rows 0..9 of request 'src', which is not stored"):
            store.commit([record])
        store.commit([_plain("src", src_ids[:8])])
        with pytest.raises(SharedRowsMissingError, match="which holds rows 0..7"):
            store.commit([record])
        store.commit([_plain("part", src_ids, final=False)])
        pending, _ = _sample("t", src_ids, 10, _rows(rng, 3), source="part")
        with pytest.raises(SharedRowsMissingError, match="'part', which is not complete yet"):
            store.commit([pending])
        with pytest.raises(SharedRowsMissingError):  # a source later in the batch is not there yet
            store.commit([_sample("u", src_ids, 10, _rows(rng, 3), source="later")[0], _plain("later", src_ids)])
        assert store.pending(ROLLOUT) == {"part": ((0, 20, False),)}
    with RoutingReader(tmp_path) as reader:
        assert sorted(reader.info(ROLLOUT).request_ids) == ["src"]
    assert issubclass(SharedRowsMissingError, ValueError)


def test_committing_again_is_a_no_op_and_other_rows_are_refused(tmp_path):
    rng = np.random.default_rng(6)
    src_ids = _rows(rng, 30)
    own = _rows(rng, 5)
    record, whole = _sample("s", src_ids, 20, own)
    with LocalRoutingStore(tmp_path) as store:
        store.commit([_plain("src", src_ids), _plain("other", _rows(rng, 30))])
        assert store.commit([record]).committed == 1
        again = store.commit([record])
        assert (again.committed, again.duplicates) == (0, 1)
        # The same request stored inline (a writer's fallback) is the same rows: a duplicate.
        inline = store.commit(record.prefix_inlined())
        assert (inline.committed, inline.duplicates) == (0, 2)
        with pytest.raises(SegmentOverlapError, match="already stored"):
            store.commit([_sample("s", src_ids, 20, own ^ 1)[0]])
        with pytest.raises(SegmentOverlapError, match="already stored"):
            store.commit([_sample("s", _rows(rng, 30), 20, own, source="other")[0]])
    with RoutingReader(tmp_path) as reader:
        np.testing.assert_array_equal(reader.get_numpy(ROLLOUT, ["s"])["s"], whole)


def test_inline_first_then_a_reference_is_a_duplicate(tmp_path):
    rng = np.random.default_rng(7)
    src_ids = _rows(rng, 30)
    record, whole = _sample("s", src_ids, 20, _rows(rng, 5))
    with LocalRoutingStore(tmp_path) as store:
        store.commit([_plain("src", src_ids)])
        store.commit(record.prefix_inlined())
        assert store.commit([record]).duplicates == 1


def test_a_failed_publish_forgets_the_cut_checksums_of_its_arrays(tmp_path, monkeypatch):
    """A commit whose flush fails leaves its array name to the next batch, with other rows: a
    cut's checksum read from the failed array must not describe the new one (it was cached)."""
    import threading

    import r3rdma.store.layout as layout

    rng = np.random.default_rng(5)
    real, gate = layout.fsync_paths, {"fail": False, "entered": threading.Event(), "release": threading.Event()}

    def fsync_paths(paths):
        if gate["fail"]:
            gate["fail"] = False
            gate["entered"].set()
            gate["release"].wait(30)
            raise OSError(28, "No space left on device")
        real(paths)

    monkeypatch.setattr(layout, "fsync_paths", fsync_paths)
    with LocalRoutingStore(tmp_path) as store:
        store.commit([_plain("first", _rows(rng, 10))])
        gate["fail"] = True
        failed = store.commit_async([_plain("srcA", _rows(rng, 40))])  # b00000002: its flush fails
        gate["entered"].wait(30)
        src_a = _rows(rng, 40)
        cut = store.commit_async([_sample("sa", src_a, 20, _rows(rng, 5), source="srcA", with_copy=False)[0]])
        gate["release"].set()
        for future in (failed, cut):
            with pytest.raises(StoreError):
                future.result()
        src_b, own = _rows(rng, 40), _rows(rng, 5)
        store.commit([_plain("srcB", src_b)])  # b00000002 again, other rows at offset 0
        store.commit([_sample("sb", src_b, 20, own, source="srcB", with_copy=False)[0]])  # the same cut
    got = RoutingReader(tmp_path).get_numpy(ROLLOUT, ["sb"])["sb"]
    np.testing.assert_array_equal(got, np.concatenate([src_b[:20], own]))


def test_snapshots_and_reopening_keep_referencing_entries(tmp_path):
    rng = np.random.default_rng(8)
    src_ids = _rows(rng, 40)
    samples = [_sample(f"s{i}", src_ids, 25, _rows(rng, 4)) for i in range(8)]
    # Snapshots once the rollout is idle with 8 parts or more after the last: parts 1..8 or 1..9.
    with LocalRoutingStore(tmp_path, snapshot_parts=64, snapshot_idle_s=0.2) as store:
        store.commit([_plain("src", src_ids)])
        for record, _ in samples:
            store.commit([record])
        entry = tmp_path / ROLLOUT / "zarr.json"
        deadline = time.monotonic() + 60
        while (snapshot := json.loads(entry.read_bytes())["attributes"]["r3rdma"].get("snapshot")) is None:
            assert time.monotonic() < deadline, "no snapshot"
            time.sleep(0.02)
    assert snapshot >= 8
    # A fresh reader opens the snapshot (the parts it merged removed here) and the parts after it.
    for seq in range(1, snapshot + 1):
        for f in (tmp_path / ROLLOUT / f"i{seq:08d}").iterdir():
            f.unlink()
        (tmp_path / ROLLOUT / f"i{seq:08d}").rmdir()
    with RoutingReader(tmp_path) as reader:
        got = reader.get_numpy(ROLLOUT, [r.request_id for r, _ in samples])
    for record, whole in samples:
        np.testing.assert_array_equal(got[record.request_id], whole)
    with LocalRoutingStore(tmp_path) as store:  # the writer reopens from the snapshot and resolves again
        more, whole = _sample("s9", src_ids, 33, _rows(rng, 2))
        store.commit([more])
    with RoutingReader(tmp_path) as reader:
        np.testing.assert_array_equal(reader.get_numpy(ROLLOUT, ["s9"])["s9"], whole)


# -- the writer's fallback ----------------------------------------------------------------------


def test_writer_stores_a_refused_reference_inline_or_counts_it(tmp_path):
    rng = np.random.default_rng(9)
    src_ids = _rows(rng, 30)
    with_copy, whole = _sample("kept", src_ids, 20, _rows(rng, 5), source="absent")
    without_copy, _ = _sample("lost", src_ids, 20, _rows(rng, 5), source="absent", with_copy=False)
    resolved, resolved_whole = _sample("ref", src_ids, 20, _rows(rng, 5))
    with LocalRoutingStore(tmp_path) as store:
        store.commit([_plain("src", src_ids)])
        writer = RoutingWriter(store, flush_bytes=1 << 20)
        for record in (with_copy, resolved, without_copy):
            writer.submit(record)
        with pytest.raises(SharedRowsMissingError, match="'lost' of rollout 'grpo-0' shares rows 0..19 of request 'absent'"):
            writer.flush(timeout=60)
        assert writer.failed_requests() == [(ROLLOUT, "lost")]
        assert writer.commit_failures == 1 and writer.requests_failed == 1
        assert writer.requests_committed == 2
        # A batch of one record takes the same path.
        alone, alone_whole = _sample("alone", src_ids, 10, _rows(rng, 2), source="absent")
        writer.submit(alone)
        writer.flush(timeout=60)
        writer.close()
    with RoutingReader(tmp_path) as reader:
        got = reader.get_numpy(ROLLOUT, ["kept", "ref", "alone"])
        assert "lost" not in reader.info(ROLLOUT).request_ids
    np.testing.assert_array_equal(got["kept"], whole)
    np.testing.assert_array_equal(got["ref"], resolved_whole)
    np.testing.assert_array_equal(got["alone"], alone_whole)
    # The resolved sample points at the source; the refused one holds its rows itself.
    parts = [_part(tmp_path, n)["requests"] for n in range(1, 4)]
    ref = next(p["ref"] for p in parts if "ref" in p)
    assert ref["segments"][0]["array"] == parts[0]["src"]["segments"][0]["array"]


# -- the wire -----------------------------------------------------------------------------------


def test_the_wire_carries_the_reference_without_the_prefix_rows():
    from r3rdma.errors import ProtocolError
    from r3rdma.transport import TransportLimits
    from r3rdma.transport.batch import check_batch_header, decode_batch, encode_records

    rng = np.random.default_rng(10)
    src_ids = _rows(rng, 30)
    plain = _plain("src", src_ids)
    record, _ = _sample("s", src_ids, 20, _rows(rng, 5))
    table, frames = encode_records([plain, record], max_frames=16)
    payload = np.concatenate([f.reshape(-1) for f in frames])
    assert payload.nbytes == plain.nbytes + record.nbytes  # no prefix row travels
    assert "shared_prefix" not in table[0]  # optional key, absent on plain records
    assert table[1]["shared_prefix"] == {"request_id": "src", "rows": 20}
    limits = TransportLimits()
    header = {"seq": 1, "frames": [payload.nbytes], "records": table}
    metas = check_batch_header(header, payload.nbytes, limits)
    decoded = decode_batch(metas, payload)
    assert decoded[0].shared_prefix is None
    shared = decoded[1].shared_prefix
    assert (shared.request_id, shared.rows, shared.ids_TLK) == ("src", 20, None)
    assert (decoded[1].start_row, decoded[1].crc32c) == (20, record.crc32c)
    np.testing.assert_array_equal(decoded[1].ids_TLK, record.ids_TLK)
    for bad, why in [
        ({"request_id": "src"}, "must be a map with keys"),
        ({"request_id": "a/b", "rows": 20}, "shared_prefix.request_id"),
        ({"request_id": "src", "rows": 0}, "shared_prefix.rows must be an int >= 1"),
        ({"request_id": "src", "rows": 19}, "must name another request and be final with start_row 19"),
        ({"request_id": "s", "rows": 20}, "must name another request"),
    ]:
        entry = dict(table[1], shared_prefix=bad)
        with pytest.raises(ProtocolError, match=why):
            check_batch_header({"seq": 1, "frames": [payload.nbytes], "records": [table[0], entry]}, payload.nbytes, limits)
    with pytest.raises(ProtocolError, match="optionally with"):
        check_batch_header(
            {"seq": 1, "frames": [payload.nbytes], "records": [table[0], dict(table[1], other=1)]}, payload.nbytes, limits
        )


def test_placement_follows_the_source():
    from r3rdma.write.push_client import StoreNodesClient, placement_key, rendezvous_order

    rng = np.random.default_rng(11)
    src_ids = _rows(rng, 10)
    urls = [f"127.0.0.1:{p}" for p in range(1001, 1007)]
    with StoreNodesClient(urls, secret="x" * 32, replicas=2) as client:
        for i in range(20):
            record, _ = _sample(f"s{i}", src_ids, 5, _rows(rng, 2), source=f"src{i}")
            assert placement_key(record) == f"{ROLLOUT}/src{i}"
            assert client.replica_set(record) == client.replica_set(_plain(f"src{i}", src_ids))
            assert client.replica_set(record) == rendezvous_order(client.nodes, f"{ROLLOUT}/src{i}")[:2]


# -- store nodes over UCX (TCP loopback) ----------------------------------------------------------


@pytest.fixture
def three_nodes(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from .store_nodes import new_token, start_node

    token = new_token()
    with ThreadPoolExecutor(3) as pool:
        nodes = list(pool.map(lambda i: start_node(tmp_path / f"node{i}", token), range(3)))
    yield nodes
    for node in nodes:
        node.kill()


def _node_requests(node) -> dict:
    """The node's own index, every part merged (read from its root on disk)."""
    group = zarr.open_group(str(node.root), path=ROLLOUT, mode="r")
    requests = {}
    for n in range(1, group.attrs["r3rdma"]["parts"] + 1):
        requests.update(group[f"i{n:08d}"].attrs["r3rdma"]["requests"])
    return requests


def test_nodes_with_replicas_resolve_on_each_replica(three_nodes):
    from r3rdma.transport import TransportLimits
    from r3rdma.write.push_client import StoreNodesClient

    rng = np.random.default_rng(12)
    src_ids = _rows(rng, 64)
    samples = [_sample(f"s{i}", src_ids, 40, _rows(rng, 3 + i), with_copy=i % 2 == 0) for i in range(6)]
    urls = [n.push_url for n in three_nodes]
    by_url = {n.push_url: n for n in three_nodes}
    with StoreNodesClient(urls, secret=three_nodes[0].token, replicas=2, limits=TransportLimits(timeout_s=5)) as client:
        with RoutingWriter(client, flush_bytes=1 << 20) as writer:
            writer.submit(_plain("src", src_ids))
            writer.flush(timeout=60)  # an earlier batch
            for record, _ in samples[:3]:
                writer.submit(record)
            writer.flush(timeout=60)
            writer.submit(_plain("src2", src_ids))  # the same batch as its samples
            for record, _ in samples[3:]:
                writer.submit(_plain(record.request_id, record.ids_TLK, 40, shared_prefix=SharedPrefix("src2", 40)))
            writer.flush(timeout=60)
            assert writer.failed_requests() == []
        replica_set = client.replica_set(_plain("src", src_ids))
        replica_set2 = client.replica_set(_plain("src2", src_ids))
        assert client.bytes_pushed == 2 * src_ids.nbytes + sum(r.nbytes for r, _ in samples)
    for urls_of, source, group in ((replica_set, "src", samples[:3]), (replica_set2, "src2", samples[3:])):
        for url in urls_of:
            requests = _node_requests(by_url[url])
            src_seg = requests[source]["segments"][0]
            for record, _ in group:
                first = requests[record.request_id]["segments"][0]
                assert (first["array"], first["offset"], first["rows"]) == (src_seg["array"], src_seg["offset"], 40)
        outside = set(urls) - set(urls_of)
        for url in outside:
            assert not {r.request_id for r, _ in group} & set(_node_requests(by_url[url]) if (by_url[url].root / ROLLOUT).exists() else {})
    # Every replica answers, over HTTP, with the whole rows (reader checks CRC-32C and replicas).
    http = [n.http_url for n in three_nodes]
    with RoutingReader(http, token=three_nodes[0].read_token, timeout_s=10) as reader:
        got = reader.get_numpy(ROLLOUT, [r.request_id for r, _ in samples])
    for record, whole in samples:
        np.testing.assert_array_equal(got[record.request_id], whole)
    for url in replica_set:  # each node alone, and zarr-python per docs/FORMAT.md
        node = by_url[url]
        with RoutingReader(node.http_url, token=node.read_token, timeout_s=10) as reader:
            got = reader.get_numpy(ROLLOUT, [r.request_id for r, _ in samples[:3]])
        for record, whole in samples[:3]:
            np.testing.assert_array_equal(got[record.request_id], whole)
            np.testing.assert_array_equal(_read_format_snippet(str(node.root), ROLLOUT, record.request_id), whole)


def test_failover_to_a_node_without_the_source_falls_back_inline(three_nodes):
    """The source's replica set loses a node after the source was stored: a sample fails over to
    the third node, which lacks the source and refuses the reference; the writer then stores it
    inline (with a copy) or counts it failed (without). Replicas of one request agree."""
    import signal

    from r3rdma.transport import TransportLimits
    from r3rdma.write.push_client import StoreNodesClient

    rng = np.random.default_rng(13)
    src_ids = _rows(rng, 50)
    urls = [n.push_url for n in three_nodes]
    by_url = {n.push_url: n for n in three_nodes}
    kept, kept_whole = _sample("kept", src_ids, 30, _rows(rng, 6))
    lost, _ = _sample("lost", src_ids, 30, _rows(rng, 6), with_copy=False)
    with StoreNodesClient(urls, secret=three_nodes[0].token, replicas=2, limits=TransportLimits(timeout_s=3), down_cooldown_s=60) as client:
        client.commit([_plain("src", src_ids)])
        first, second = client.replica_set(kept)
        by_url[second].stop(signal.SIGKILL)
        with RoutingWriter(client, flush_bytes=1 << 20) as writer:
            writer.submit(kept)
            writer.submit(lost)
            with pytest.raises(SharedRowsMissingError, match="'lost'"):
                writer.flush(timeout=120)
            assert writer.failed_requests() == [(ROLLOUT, "lost")]
            assert writer.requests_committed == 1
    live = [n for n in three_nodes if n.push_url != second]
    with RoutingReader([n.http_url for n in live], token=live[0].read_token, timeout_s=10) as reader:
        # "lost" failed (not durable on 2 nodes); the node holding the source may keep its copy,
        # as with any record a replica refused.
        np.testing.assert_array_equal(reader.get_numpy(ROLLOUT, ["kept"])["kept"], kept_whole)
    # The node that held the source resolved the reference; the one that did not holds the
    # rows inline, in segments of the same rows and checksums (readers compare replicas by them).
    layouts = []
    for node in live:
        entry = _node_requests(node).get("kept") if (node.root / ROLLOUT).exists() else None
        if entry is not None:
            layouts.append([(s["start_row"], s["rows"], s["crc32c"]) for s in entry["segments"]])
    assert len(layouts) == 2 and layouts[0] == layouts[1] == [(0, 30, checksum(src_ids[:30])), (30, 6, kept.crc32c)]


# -- property: any source segmentation, any prefix length, any batching ----------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cuts=st.lists(st.integers(1, 70), max_size=3, unique=True),
    prefixes=st.lists(st.integers(1, 72), min_size=1, max_size=4),
    same_batch=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_segmentation_and_prefix_reads_back_whole(tmp_path_factory, cuts, prefixes, same_batch, seed):
    rng = np.random.default_rng(seed)
    src_ids = _rows(rng, 72)
    bounds = [0, *sorted(cuts), 72]
    source_records = [_plain("src", src_ids[a:b], start_row=a) for a, b in zip(bounds, bounds[1:])]
    samples = [_sample(f"s{i}", src_ids, p, _rows(rng, 1 + i)) for i, p in enumerate(prefixes)]
    root = tmp_path_factory.mktemp("prop")
    with LocalRoutingStore(root) as store:
        if same_batch:
            store.commit([*source_records, *(r for r, _ in samples)])
        else:
            for record in source_records:
                store.commit([record])
            store.commit([r for r, _ in samples])
    with RoutingReader(root) as reader:  # verify=True checks every segment's CRC-32C
        got = reader.get_numpy(ROLLOUT, [r.request_id for r, _ in samples])
    for record, whole in samples:
        np.testing.assert_array_equal(got[record.request_id], whole)
