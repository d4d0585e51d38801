"""CRC-32C of row ranges of an array that is filled in pieces, computed while it fills.

The rollout index holds each request's CRC-32C over its rows (records.checksum). A reader
that fetched a whole batch array used to hash every request in a second pass once the array
was complete: one more trip over the whole array through memory, after the transfer. Here each
row is hashed once every row before it is final (a CRC runs in order), which on a streamed
read is right after its chunk landed or decoded, while it is still in cache and while the
socket keeps receiving the next bytes.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Sequence

import crc32c
import numpy as np

__all__ = ["RowRangeChecksums"]


class RowRangeChecksums:
    """CRC-32C of ``ranges`` (``[lo, hi)`` row ranges of ``array``, any order, may overlap).

    ``unfinished`` are the row ranges whose contents are not final yet (chunks still to
    arrive); every other row is final from the start. Call :meth:`final` as each of them
    becomes final, in any order; :attr:`values` is complete once all have. Not thread-safe:
    one thread feeds it.
    """

    def __init__(self, array: np.ndarray, ranges: Sequence[tuple[int, int]], unfinished: Iterable[tuple[int, int]]) -> None:
        if not array.flags.c_contiguous:
            raise ValueError("RowRangeChecksums needs a C-contiguous array")
        self._rows = array.shape[0]
        self._row_bytes = array[:1].nbytes if self._rows else 0
        self._bytes = array.reshape(-1).view(np.uint8)
        for lo, hi in ranges:
            if not 0 <= lo <= hi <= self._rows:
                raise ValueError(f"row range {lo}..{hi} is outside the array's {self._rows} rows")
        self._ranges = sorted(range(len(ranges)), key=lambda i: ranges[i][0])  # range numbers by start
        self._covered: list[tuple[int, int]] = []  # the union of the ranges, as disjoint sorted runs
        for r in self._ranges:
            lo, hi = ranges[r]
            if self._covered and lo <= self._covered[-1][1]:
                self._covered[-1] = (self._covered[-1][0], max(hi, self._covered[-1][1]))
            elif hi > lo:
                self._covered.append((lo, hi))
        self._covered_starts = [lo for lo, _ in self._covered]
        self._bounds = list(ranges)
        self.values = [0] * len(ranges)
        self._frontier = 0  # rows [0, frontier) are final and hashed
        self._first_open = 0  # position in self._ranges of the first range not wholly hashed
        self._final: dict[int, int] = {}  # final pieces beyond the frontier: lo -> hi
        at = 0
        for lo, hi in sorted(unfinished):
            if lo > at:
                self._final[at] = lo
            at = max(at, hi)
        if at < self._rows:
            self._final[at] = self._rows
        self._advance()

    @property
    def complete(self) -> bool:
        return self._frontier >= self._rows

    def covers(self, lo: int, hi: int) -> bool:
        """Whether every row of ``[lo, hi)`` lies in some range: its bytes are then checked by
        these CRCs, and a caller that compares all of them needs no other check of those rows."""
        i = bisect.bisect_right(self._covered_starts, lo) - 1
        return i >= 0 and self._covered[i][1] >= hi

    def final(self, lo: int, hi: int) -> None:
        """Rows ``[lo, hi)`` (one of the unfinished ranges, or several that follow one another
        with no row between them) are final now."""
        if hi > lo:
            self._final[lo] = hi
            self._advance()

    def _advance(self) -> None:
        start = self._frontier
        while self._frontier in self._final:
            self._frontier = self._final.pop(self._frontier)
        if self._frontier > start:
            self._hash(start, self._frontier)

    def _hash(self, lo: int, hi: int) -> None:
        """Feed rows ``[lo, hi)`` (all rows before ``lo`` are hashed) to the ranges they touch."""
        order, bounds, rb = self._ranges, self._bounds, self._row_bytes
        i = self._first_open
        while i < len(order):
            r = order[i]
            a, b = bounds[r]
            if a >= hi:
                break
            s, e = max(a, lo), min(b, hi)
            if s < e:
                self.values[r] = crc32c.crc32c(self._bytes[s * rb : e * rb], self.values[r])
            i += 1
        while self._first_open < len(order) and bounds[order[self._first_open]][1] <= hi:
            self._first_open += 1
