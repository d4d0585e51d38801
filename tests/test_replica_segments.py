"""Copies of one request cut into different segments on different store nodes (issue #35).

Since shared prefixes, a request may be stored by reference on one node (segments pointing at
the rows its source stored, then its own rows) and inline on another (the writer's fallback
when the source is not on that node, or a failover re-push): the same rows in other segment
boundaries. The reader compares the copies (``r3rdma.read.replicas.choose_copies``); copies holding
the same rows must pass, copies holding different rows must still fail naming both nodes.
The two store nodes here are two local store directories, read as two sources.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3rdma.errors import CorruptDataError
from r3rdma.read import checksums
from r3rdma.read.checksums import crc32c_concat
from r3rdma.read.reader import RoutingReader
from r3rdma.records import RequestRecord, SharedPrefix
from r3rdma.store.local_store import LocalRoutingStore
from r3rdma.write.writer import RoutingWriter

ROLLOUT = "grpo-0"
LAYERS = (0, 1, 2)

# -- combining CRC-32Cs ---------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_the_linearity_identity_the_combine_relies_on(a, b):
    """crc(A || B) = crc32c(zeros(len B), crc(A)) ^ crc(B) ^ crc32c(zeros(len B)): CRC-32C with
    its initial and final XOR is affine in (data, initial value) together."""
    zeros = bytes(len(b))
    assert crc32c.crc32c(a + b) == crc32c.crc32c(zeros, crc32c.crc32c(a)) ^ crc32c.crc32c(b) ^ crc32c.crc32c(zeros)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000), st.data())
def test_combined_part_crcs_are_the_crc_of_the_concatenation(data, draw):
    """Random splits of random bytes, empty parts included."""
    cuts = sorted(draw.draw(st.lists(st.integers(0, len(data)), max_size=6)))  # repeated cuts: empty parts
    bounds = [0, *cuts, len(data)]
    parts = [data[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
    assert crc32c_concat((crc32c.crc32c(p), len(p)) for p in parts) == crc32c.crc32c(data)


def test_parts_longer_than_the_zero_buffer_and_no_parts():
    """A part hashed in several pieces of the zero buffer; no parts at all."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=2 * len(checksums._ZEROS) + 123, dtype=np.uint8).tobytes()
    cut = len(checksums._ZEROS) // 3
    parts = [data[:cut], data[cut:]]
    assert crc32c_concat((crc32c.crc32c(p), len(p)) for p in parts) == crc32c.crc32c(data)
    assert crc32c_concat([]) == crc32c.crc32c(b"") == 0


# -- two store nodes, one request cut differently -------------------------------------------------


def _rows(rng, n):
    return rng.integers(0, 16, size=(n, len(LAYERS), 2)).astype(np.uint8)


def _plain(request_id, ids, start_row=0, **kw):
    return RequestRecord(ROLLOUT, request_id, ids, LAYERS, 16, start_row=start_row, **kw)


def _sample(ids, prefix_rows):
    """Request ``s`` of rows ``ids``, its first ``prefix_rows`` shared with request ``src``
    (a copy of them carried, for the writer's inline fallback)."""
    shared = SharedPrefix("src", prefix_rows, ids[:prefix_rows].copy())
    return _plain("s", ids[prefix_rows:], prefix_rows, shared_prefix=shared)


def _segment_rows(root: Path, request_id: str) -> list[int]:
    """The rows of each of the request's segments in the store directory's index."""
    found = None
    rollout = root / ROLLOUT
    for name in sorted(os.listdir(rollout)):
        if name.startswith("i"):
            requests = json.loads((rollout / name / "zarr.json").read_bytes())["attributes"]["r3rdma"]["requests"]
            found = requests.get(request_id, found)
    assert found is not None
    return [seg["rows"] for seg in found["segments"]]


def _store_by_reference(root: Path, src_ids, whole, prefix_rows, *, source_turns):
    """Node A: ``src`` (committed in turns cut at ``source_turns``), then ``s`` sharing its
    first ``prefix_rows`` rows by reference."""
    cuts = [0, *source_turns, len(src_ids)]
    with LocalRoutingStore(root) as store:
        for lo, hi in zip(cuts, cuts[1:]):
            store.commit([_plain("src", src_ids[lo:hi], lo)])
        store.commit([_sample(whole, prefix_rows)])


def _store_inline_fallback(root: Path, whole, prefix_rows):
    """Node B, without ``src``: the writer's commit of ``s`` by reference is refused, and it
    stores the shared rows inline (``RequestRecord.prefix_inlined``)."""
    with LocalRoutingStore(root) as store:
        with RoutingWriter(store, flush_bytes=1 << 20) as writer:
            writer.submit(_sample(whole, prefix_rows))
            writer.flush(timeout=60)
            assert writer.failed_requests() == []


def _store_whole(root: Path, whole):
    """Node B: ``s`` re-pushed whole as one record (one segment)."""
    with LocalRoutingStore(root) as store:
        store.commit([_plain("s", whole)])


def _store_other_cut(root: Path, src_ids, whole, prefix_rows):
    """Node B: ``src`` whole, then ``s`` sharing another number of its rows."""
    with LocalRoutingStore(root) as store:
        store.commit([_plain("src", src_ids)])
        store.commit([_sample(whole, prefix_rows)])


def _stored_twice(tmp_path, how, rng, *, differ_at=None):
    """``s`` stored by reference on node A and as ``how`` says on node B; ``differ_at``: a row
    B's copy holds differently. Returns (A, B, the request's rows as A holds them)."""
    a, b = tmp_path / "a", tmp_path / "b"
    src_ids = _rows(rng, 12)
    whole = np.concatenate([src_ids[:7], _rows(rng, 4)])
    _store_by_reference(a, src_ids, whole, 7, source_turns=[4])
    other = whole.copy()
    if differ_at is not None:
        other[differ_at] = (other[differ_at] + 1) % 16
    if how == "inline fallback":
        _store_inline_fallback(b, other, 7)
    elif how == "whole":
        _store_whole(b, other)
    else:  # "other cut": src whole on B, s sharing its first 5 rows
        other_src = src_ids.copy()
        other_src[:5] = other[:5]
        _store_other_cut(b, other_src, other, 5)
    return a, b, whole


def _names_both(first: Path, second: Path) -> str:
    """The error message's pattern: request ``s`` stored differently on both nodes."""
    return rf"'s'.*different rows on {re.escape(str(first))}.*and {re.escape(str(second))}"


CUTS = {"inline fallback": [7, 4], "whole": [11], "other cut": [5, 6]}


@pytest.mark.parametrize("how", sorted(CUTS))
def test_copies_of_the_same_rows_in_other_segments_read_back(tmp_path, how):
    """The same rows cut three other ways on node B: read back, whichever copy is read."""
    a, b, whole = _stored_twice(tmp_path, how, np.random.default_rng(1))
    assert _segment_rows(a, "s") == [4, 3, 4]  # src's two turns, cut at row 7, then s's own rows
    assert _segment_rows(b, "s") == CUTS[how]
    for sources in ([a, b], [b, a]):  # either copy first (the one read)
        with RoutingReader(sources) as reader:
            np.testing.assert_array_equal(reader.get_numpy(ROLLOUT, ["s"])["s"], whole)


@pytest.mark.parametrize("differ_at", [0, 6, 10])
@pytest.mark.parametrize("how", sorted(CUTS))
def test_copies_of_other_rows_in_other_segments_are_refused_naming_both(tmp_path, how, differ_at):
    """One row other on node B (in the shared prefix, at its cut, in the own rows): refused."""
    a, b, _ = _stored_twice(tmp_path, how, np.random.default_rng(2), differ_at=differ_at)
    for sources in ([a, b], [b, a]):
        with RoutingReader(sources) as reader:
            with pytest.raises(CorruptDataError, match=_names_both(*sources)):
                reader.get_numpy(ROLLOUT, ["s"])


def test_a_copy_of_fewer_rows_is_read_as_the_longer_one_unless_a_row_differs(tmp_path):
    """A copy holding fewer rows (the same first rows) is no disagreement (issue #50: judged by
    the rows both hold, read back here, as B's one segment ends inside A's last): the longer
    copy is read, whichever source comes first. One row other among them is refused."""
    rng = np.random.default_rng(3)
    a, b = tmp_path / "a", tmp_path / "b"
    src_ids = _rows(rng, 12)
    whole = np.concatenate([src_ids[:7], _rows(rng, 4)])
    _store_by_reference(a, src_ids, whole, 7, source_turns=[4])
    _store_whole(b, whole[:10])
    for sources in ([a, b], [b, a]):
        with RoutingReader(sources) as reader:
            np.testing.assert_array_equal(reader.get_numpy(ROLLOUT, ["s"])["s"], whole)
    other = tmp_path / "other"
    _store_whole(other, np.concatenate([whole[:8], (whole[8:10] + 1) % 16]))
    with RoutingReader([a, other]) as reader:
        with pytest.raises(CorruptDataError, match=_names_both(a, other) + ".*: row 8 differs$"):
            reader.get_numpy(ROLLOUT, ["s"])


def test_copies_cut_alike_with_other_rows_are_refused(tmp_path):
    """The fast path (same boundaries): per-segment checksums compared as before."""
    rng = np.random.default_rng(4)
    a, b = tmp_path / "a", tmp_path / "b"
    whole = _rows(rng, 9)
    other = whole.copy()
    other[3] = (other[3] + 1) % 16
    with LocalRoutingStore(a) as store:
        store.commit([_plain("s", whole)])
    with LocalRoutingStore(b) as store:
        store.commit([_plain("s", other)])
    with RoutingReader([a, b]) as reader:
        with pytest.raises(CorruptDataError, match=_names_both(a, b)):
            reader.get_numpy(ROLLOUT, ["s"])
