"""Copies of a request on several store nodes are judged by their rows (issue #50), as the store
judges a record: the same bytes for the same rows, however they are split, are the same; only
different bytes for the same rows are a disagreement.

Beyond copies of the same rows cut differently (tests/test_replica_segments.py), copies may hold
different rows: a later turn of a conversation is visible on the node that published it first
while another still holds the earlier turns only (or, after a failover, never gets it). The
shorter copy holds the same bytes for the rows it has, so a read takes the copy holding the
most rows, from either source order, and fails over only to copies holding all of them. The
two store nodes here are two local store directories, read as two sources.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from r3rdma.errors import CorruptDataError, StoreError
from r3rdma.read.reader import RoutingReader
from r3rdma.records import RequestRecord, SharedPrefix
from r3rdma.store.local_store import LocalRoutingStore

ROLLOUT = "grpo-0"
LAYERS = (0, 1, 2)


def _rows(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 16, size=(n, len(LAYERS), 2)).astype(np.uint8)


def _plain(request_id: str, ids: np.ndarray, start_row: int = 0, **kw) -> RequestRecord:
    return RequestRecord(ROLLOUT, request_id, ids, LAYERS, 16, start_row=start_row, **kw)


def _commit(root: Path, *batches: list[RequestRecord]) -> None:
    with LocalRoutingStore(root) as store:
        for batch in batches:
            store.commit(batch)


def _segments(reader: RoutingReader, source: int, request_id: str) -> list[tuple[int, int]]:
    """``(start_row, rows)`` of each segment of the request's copy on ``source``."""
    merged = reader._indexes.get(ROLLOUT)
    return [(s.start_row, s.rows) for s in merged.per_source[source].requests[request_id].segments]


def _both_named(first: Path, second: Path) -> str:
    return rf"'c'.*different rows on {re.escape(str(first))}.*and {re.escape(str(second))}"


def _later_turn_on_one_node(tmp_path: Path, *, by_reference: bool, differ_at: int | None = None):
    """Request ``c``: turn 1 (rows 0..19) on nodes A and B, turn 2 (rows 20..31) on A only (a
    later turn A published first). By reference: turn 2 arrives as a record sharing rows 0..7
    of request ``p`` (a prefix-cache hit), which A's store takes as an extension of ``c``.
    ``differ_at``: a row of turn 1 that B holds otherwise. Returns (A, B, c's rows on A)."""
    a, b = tmp_path / "a", tmp_path / "b"
    whole = _rows(1, 32)
    prompt = np.concatenate([whole[:8], _rows(2, 5)])
    turn2 = _plain("c", whole[8:], 8, shared_prefix=SharedPrefix("p", 8)) if by_reference else _plain("c", whole[20:], 20)
    _commit(a, [_plain("p", prompt), _plain("c", whole[:20])], [turn2])
    on_b = whole[:20].copy()
    if differ_at is not None:
        on_b[differ_at] = (on_b[differ_at] + 1) % 16
    _commit(b, [_plain("p", prompt), _plain("c", on_b)])
    return a, b, whole


@pytest.mark.parametrize("by_reference", [False, True])
def test_a_later_turn_visible_on_one_node_reads_the_longer_copy(tmp_path, by_reference):
    """Refused before as "stored with different rows" (a CorruptDataError a trainer takes for
    damaged data); the copies agree on every row both hold, so either source order reads the
    32 rows A holds, in every read form."""
    a, b, whole = _later_turn_on_one_node(tmp_path, by_reference=by_reference)
    for sources in ([a, b], [b, a]):
        with RoutingReader(sources) as reader:
            assert _segments(reader, sources.index(a), "c") == [(0, 20), (20, 12)]  # turn 1's segment, then turn 2's rows
            np.testing.assert_array_equal(reader.get_numpy(ROLLOUT, ["c"], expected_rows={"c": 32})["c"], whole)
            packed = reader.get_packed(ROLLOUT, ["c", "p"])
            np.testing.assert_array_equal(packed.ids_TLK[:32].numpy(), whole)
            np.testing.assert_array_equal(
                reader.get_numpy(ROLLOUT, ["c"], rows={"c": [(18, 25)]}, layers=[2, 0])["c"], whole[18:25][:, [2, 0]]
            )
            with reader.prefetch(ROLLOUT, [["c"], ["p"]]) as batches:
                np.testing.assert_array_equal(next(batches).ids_TLK.numpy(), whole)


@pytest.mark.parametrize("by_reference", [False, True])
@pytest.mark.parametrize("differ_at", [0, 19])
def test_other_bytes_in_the_rows_both_copies_hold_are_refused(tmp_path, by_reference, differ_at):
    """One row of turn 1 other on B: a disagreement, from either source order, naming both
    nodes in source order."""
    a, b, _ = _later_turn_on_one_node(tmp_path, by_reference=by_reference, differ_at=differ_at)
    for sources in ([a, b], [b, a]):
        with RoutingReader(sources) as reader:
            with pytest.raises(CorruptDataError, match=_both_named(*sources)):
                reader.get_numpy(ROLLOUT, ["c"])


def _shorter_copy_cut_inside(tmp_path: Path, differ_at: int | None = None):
    """A holds ``c`` whole in one segment (rows 0..29, re-pushed whole after a failover); B
    holds its first 17 rows, one segment ending inside A's: the segments' CRC-32Cs cannot
    tell whether rows 0..16 agree, so they are read. Returns (A, B, c's rows)."""
    a, b = tmp_path / "a", tmp_path / "b"
    whole = _rows(3, 30)
    _commit(a, [_plain("c", whole)])
    on_b = whole[:17].copy()
    if differ_at is not None:
        on_b[differ_at, 1, 0] ^= 1
    _commit(b, [_plain("c", on_b)])
    return a, b, whole


def test_a_shorter_copy_cut_inside_a_segment_is_compared_by_its_rows(tmp_path):
    """The rows both hold are read from both copies and agree: the longer copy is read."""
    a, b, whole = _shorter_copy_cut_inside(tmp_path)
    for sources in ([a, b], [b, a]):
        with RoutingReader(sources) as reader:
            np.testing.assert_array_equal(reader.get_numpy(ROLLOUT, ["c"])["c"], whole)
            assert reader.get(ROLLOUT, ["c"])["c"].shape[0] == 30  # the copies compared once, the choice kept


@pytest.mark.parametrize("differ_at", [0, 9, 16])
def test_rows_read_to_compare_name_the_first_that_differs(tmp_path, differ_at):
    a, b, _ = _shorter_copy_cut_inside(tmp_path, differ_at=differ_at)
    for sources in ([a, b], [b, a]):
        with RoutingReader(sources) as reader:
            with pytest.raises(CorruptDataError, match=_both_named(*sources) + rf".*: row {differ_at} differs$"):
                reader.get_numpy(ROLLOUT, ["c"])


def _failing_data(reader: RoutingReader, source: int) -> None:
    """Reads of array chunks from ``source`` fail with an I/O error (a disk gone bad)."""
    store = reader._sources[source].store
    original = store.get

    async def get(key, *args, **kwargs):
        if "/c/" in key:
            raise OSError(5, "Input/output error", key)
        return await original(key, *args, **kwargs)

    store.get = get


def test_a_read_fails_over_only_to_a_copy_holding_all_its_rows(tmp_path):
    """Sources B (turn 1 only), A (both turns), C (both turns, one segment): the read takes A;
    A's disk failing, it goes on to C, cut otherwise, not to B, which lacks turn 2. Without C
    there is no copy to go on to: A's own error."""
    a, b, whole = _later_turn_on_one_node(tmp_path, by_reference=False)
    c = tmp_path / "c"
    _commit(c, [_plain("p", np.concatenate([whole[:8], _rows(2, 5)])), _plain("c", whole)])
    with RoutingReader([b, a, c]) as reader:
        _failing_data(reader, 1)
        np.testing.assert_array_equal(reader.get_numpy(ROLLOUT, ["c"])["c"], whole)
        assert reader.read_failovers == 1
    with RoutingReader([b, a]) as reader:
        _failing_data(reader, 1)
        with pytest.raises(StoreError, match="Input/output error"):
            reader.get_numpy(ROLLOUT, ["c"])
