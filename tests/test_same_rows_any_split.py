"""Issue "Stored as said": a re-sent request is judged by its rows, not by how they are split into
segments (or whether they arrive inline or as a shared-prefix reference). The same bytes are a
no-op (or extend the request with the rows past the stored ones); different bytes are refused
naming the first differing row."""

from __future__ import annotations

import numpy as np
import pytest

from r3rdma.errors import SegmentOverlapError
from r3rdma.read.reader import RoutingReader
from r3rdma.records import RequestRecord, SharedPrefix
from r3rdma.store.local_store import LocalRoutingStore

ROLLOUT = "grpo-0"
LAYERS = (0, 1, 2)


def _rows(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 16, size=(n, len(LAYERS), 2)).astype(np.uint8)


def _plain(request_id: str, ids: np.ndarray, start_row: int = 0, **kw) -> RequestRecord:
    return RequestRecord(ROLLOUT, request_id, ids, LAYERS, 16, start_row=start_row, **kw)


def _shared(request_id: str, source: str, prefix: int, own: np.ndarray) -> RequestRecord:
    return _plain(request_id, own, start_row=prefix, shared_prefix=SharedPrefix(source, prefix))


def _read(root, request_id: str) -> np.ndarray:
    with RoutingReader(root) as reader:  # verify=True: every segment's CRC-32C is checked
        return reader.get_numpy(ROLLOUT, [request_id])[request_id]


@pytest.mark.parametrize("same_batch", [False, True])
def test_one_segment_re_sent_as_two_is_a_no_op(tmp_path, same_batch):
    """(a) Stored as one segment, re-sent as a part and a final with the same bytes."""
    whole = _rows(1, 43)
    split = [_plain("c1", whole[:16], final=False), _plain("c1", whole[16:], start_row=16, total_rows=43)]
    with LocalRoutingStore(tmp_path) as store:
        if same_batch:
            result = store.commit([_plain("c1", whole), *split])
            assert (result.committed, result.duplicates) == (1, 2)
        else:
            store.commit([_plain("c1", whole)])
            again = store.commit(split)
            assert (again.committed, again.duplicates, again.bytes_written) == (0, 2, 0)
            # and the other way round: stored in two segments, re-sent as one
            store.commit([_plain("c2", whole[:10]), _plain("c2", whole[10:], start_row=10)])
            assert store.commit([_plain("c2", whole)]).duplicates == 1
            np.testing.assert_array_equal(_read(tmp_path, "c2"), whole)
        assert store.pending(ROLLOUT) == {}
    np.testing.assert_array_equal(_read(tmp_path, "c1"), whole)


def test_stored_inline_re_sent_by_reference_is_a_no_op(tmp_path):
    """(b) Issue case 1: 'c1' stored whole; re-sent as rows 0..15 of 'c14' plus its own rows
    (the segment lists differ: [(0, 43)] against [(0, 16), (16, 27)])."""
    whole = _rows(2, 43)
    c14 = np.concatenate([whole[:16], _rows(3, 20)])
    with LocalRoutingStore(tmp_path) as store:
        store.commit([_plain("c14", c14), _plain("c1", whole)])
        again = store.commit([_shared("c1", "c14", 16, whole[16:])])
        assert (again.committed, again.duplicates) == (0, 1)
    np.testing.assert_array_equal(_read(tmp_path, "c1"), whole)


def test_a_later_turn_by_reference_extends_the_stored_rows(tmp_path):
    """Issue case 1, the later turn re-sent whole through a prefix hit: rows 0..42 are the
    stored ones, rows 43..52 are appended."""
    turn2 = _rows(4, 53)
    c14 = np.concatenate([turn2[:16], _rows(5, 8)])
    with LocalRoutingStore(tmp_path) as store:
        store.commit([_plain("c14", c14), _plain("c1", turn2[:43])])
        assert store.commit([_shared("c1", "c14", 16, turn2[16:])]).committed == 1
        assert store.commit([_shared("c1", "c14", 16, turn2[16:])]).duplicates == 1
        assert store.commit([_plain("c1", turn2)]).duplicates == 1  # inline, whole: the same rows
    np.testing.assert_array_equal(_read(tmp_path, "c1"), turn2)


def test_stored_by_reference_re_sent_inline_is_a_no_op(tmp_path):
    """(c) Issue case 2: a replica stored 's' by reference (the source in two segments, so the
    reference has three), another sends it inline in one record or in prefix_inlined's two."""
    src = _rows(6, 60)
    own = _rows(7, 6)
    whole = np.concatenate([src[:35], own])
    record = _plain("s", own, start_row=35, shared_prefix=SharedPrefix("src", 35, src[:35].copy()))
    with LocalRoutingStore(tmp_path) as store:
        store.commit([_plain("src", src[:20])])
        store.commit([_plain("src", src[20:], start_row=20)])
        assert store.commit([record]).committed == 1
        assert store.commit([_plain("s", whole)]).duplicates == 1
        assert store.commit(record.prefix_inlined()).duplicates == 2
    np.testing.assert_array_equal(_read(tmp_path, "s"), whole)


@pytest.mark.parametrize("bad_row", [0, 17, 42])
def test_one_differing_row_is_refused_naming_it(tmp_path, bad_row):
    """(d) Split otherwise, one row differs: SegmentOverlapError naming that row, nothing stored."""
    whole = _rows(8, 43)
    other = whole.copy()
    other[bad_row, 1, 0] ^= 1
    c14 = np.concatenate([other[:16], _rows(9, 4)])
    with LocalRoutingStore(tmp_path) as store:
        store.commit([_plain("c1", whole), _plain("c14", c14)])
        with pytest.raises(SegmentOverlapError, match=rf"already stored .*row {bad_row} differs"):
            store.commit([_plain("c1", other[:16], final=False), _plain("c1", other[16:], start_row=16, total_rows=43)])
        with pytest.raises(SegmentOverlapError, match=rf"already stored .*row {bad_row} differs"):
            store.commit([_shared("c1", "c14", 16, other[16:])])
        with pytest.raises(SegmentOverlapError, match=rf"appears twice in one batch .*row {bad_row} differs"):
            store.commit([_plain("c2", whole), _plain("c2", other[: bad_row + 1], final=False)])
        assert store.pending(ROLLOUT) == {}
    np.testing.assert_array_equal(_read(tmp_path, "c1"), whole)


def test_a_later_turn_still_extends(tmp_path):
    """(e) A later turn with start_row = rows stored so far appends a segment, as before; an
    earlier turn's rows re-sent inside it are duplicates."""
    whole = _rows(10, 30)
    with LocalRoutingStore(tmp_path) as store:
        store.commit([_plain("conv", whole[:12])])
        assert store.commit([_plain("conv", whole[12:], start_row=12)]).committed == 1
        assert store.commit([_plain("conv", whole[5:20], start_row=5, final=False)]).duplicates == 1
        with pytest.raises(SegmentOverlapError, match="row 7 differs"):
            store.commit([_plain("conv", whole[5:20] ^ np.eye(15, dtype=np.uint8)[2][:, None, None], start_row=5)])
    np.testing.assert_array_equal(_read(tmp_path, "conv"), whole)
