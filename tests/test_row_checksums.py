"""RowRangeChecksums: the CRC-32C of row ranges, fed as pieces of the array become final in
any order, equals the checksum of each range once the array is complete."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3rdma.records import checksum
from r3rdma.store.row_checksums import RowRangeChecksums


@st.composite
def cases(draw):
    rows = draw(st.integers(0, 60))
    cuts = sorted(draw(st.sets(st.integers(1, max(rows - 1, 1)), max_size=10))) if rows > 1 else []
    pieces = list(zip([0, *cuts], [*cuts, rows])) if rows else []
    unfinished = [p for p in pieces if draw(st.booleans())]  # the rest is final from the start
    order = draw(st.permutations(unfinished))
    ranges = []
    for _ in range(draw(st.integers(0, 8))):
        lo = draw(st.integers(0, rows))
        ranges.append((lo, draw(st.integers(lo, rows))))
    return rows, unfinished, order, ranges


@settings(max_examples=300, deadline=None)
@given(cases(), st.sampled_from([np.uint8, np.uint16, np.int32]))
def test_values_match_a_checksum_of_each_range(case, dtype):
    rows, unfinished, order, ranges = case
    rng = np.random.default_rng(rows)
    want = rng.integers(0, 100, size=(rows, 3, 2)).astype(dtype)
    array = want.copy()
    for lo, hi in unfinished:
        array[lo:hi] = 0xAB  # not final yet: what a chunk still in flight leaves there
    sums = RowRangeChecksums(array, ranges, unfinished)
    for lo, hi in order:
        assert not sums.complete
        array[lo:hi] = want[lo:hi]
        sums.final(lo, hi)
    assert sums.complete
    assert sums.values == [checksum(want[lo:hi]) for lo, hi in ranges]
    for lo in range(rows):
        for hi in range(lo + 1, rows + 1):
            assert sums.covers(lo, hi) == all(any(a <= row < b for a, b in ranges) for row in range(lo, hi))


def test_rows_are_hashed_as_soon_as_every_row_before_them_is_final():
    array = np.arange(40, dtype=np.uint8).reshape(10, 4)
    sums = RowRangeChecksums(array, [(0, 3), (3, 10)], [(0, 5), (5, 10)])
    sums.final(5, 10)  # the later chunk first: nothing can be hashed yet
    assert sums.values == [0, 0]
    sums.final(0, 5)
    assert sums.complete and sums.values == [checksum(array[:3]), checksum(array[3:])]


def test_a_range_outside_the_array_is_refused():
    with pytest.raises(ValueError, match="outside"):
        RowRangeChecksums(np.zeros((4, 2), np.uint8), [(2, 5)], [])
