"""Copies of one request on several sources: whether they agree, and which one a read takes.

A record is judged by its rows, not by how they are split (docs/ENGINE_SEMANTICS.md): a store
takes the same bytes for the same rows as the same, however they are cut into segments, by
reference or inline. Copies of a request on several store nodes are judged alike. They may be
cut differently (a shared prefix stored by reference on one node and inline on another, a
request re-pushed whole after a failover, turns committed apart on one node and together on
another: issue #35), and they may hold different rows: a later turn of a conversation is
visible on the node that published it first while another still holds the earlier turns
(or, after a failover, never receives it). Only different bytes for the same rows are a
disagreement (:class:`CorruptDataError` naming both nodes); otherwise a read takes the copy
holding the most rows (the first, in source order, whose rows cover every other copy's) and
fails over only to copies holding all of its rows.

Copies are compared on the rows both hold, cheapest way first:

- the same rows in the same segments: their segments' CRC-32Cs (the usual case: replicas of
  one commit);
- segment boundaries at both ends of the shared rows in both copies: one CRC-32C of those
  rows per copy, combined from its segments' (:func:`~r3rdma.read.checksums.crc32c_concat`);
- else (a segment of one copy runs across an end of the shared rows): the shared rows of both
  copies are read and compared, as the store reads stored rows back (rare).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from r3rdma.errors import CorruptDataError
from r3rdma.read.checksums import crc32c_concat
from r3rdma.read.merged_index import MergedIndex
from r3rdma.store.index_entries import RequestEntry, Segment

__all__ = ["choose_copies", "RowsOfCopy", "ReadRows"]

RowsOfCopy = tuple[str, int, int, int]
"""``(request id, source, lo, hi)``: rows ``lo .. hi - 1`` (the request's own row numbers) of
the request's copy on that source."""

ReadRows = Callable[[Sequence[RowsOfCopy]], list[np.ndarray]]
"""Reads the rows of each :data:`RowsOfCopy` (``[hi - lo, L, K]`` each), in order."""


def choose_copies(
    merged: MergedIndex, rollout_id: str, source_names: Sequence[str], request_ids: Sequence[str], read_rows: ReadRows
) -> None:
    """Compare the copies of each of ``request_ids`` (those not compared before on ``merged``)
    and note the copy each is read from (:attr:`MergedIndex.read_from`); raises
    :class:`CorruptDataError` naming both nodes when two copies hold different bytes for the
    same rows. ``read_rows`` reads rows the index cannot decide on."""
    if len(merged.per_source) < 2:
        return  # one copy of everything
    g = merged.geometry
    row_bytes = g["num_layers"] * g["top_k"] * np.dtype(g["dtype"]).itemsize
    undecided: list[tuple[str, int, int, int, int]] = []  # (request, read copy's source, other's, lo, hi)
    chosen, holders = merged.read_from, merged.holders  # looked up once: a read may name 16k requests
    for rid in request_ids:
        if rid in chosen:
            continue
        copies = holders(rid)
        if len(copies) > 1 and not _alike(copies):
            read_src, read = _widest(copies)
            for src, entry in copies:
                if src == read_src:
                    continue
                same = _same_by_checksums(read, entry, row_bytes)
                if same is None:
                    lo, hi = max(read.start_row, entry.start_row), min(read.end_row, entry.end_row)
                    undecided.append((rid, read_src, src, lo, hi))
                elif not same:
                    raise _disagreement(rollout_id, rid, source_names, (read_src, read), (src, entry))
            chosen[rid] = read_src
        else:
            chosen[rid] = copies[0][0]
    if undecided:
        _compare_rows(merged, rollout_id, source_names, undecided, read_rows)


def _alike(copies: list[tuple[int, RequestEntry]]) -> bool:
    """Whether every copy holds the rows of the first in segments of the same checksums (the
    usual case, replicas of one commit: as cheap to tell as before copies were compared by rows)."""
    first = copies[0][1]
    span, crcs = (first.start_row, first.rows), [s.crc32c for s in first.segments]
    for _, entry in copies[1:]:
        if (entry.start_row, entry.rows) != span or [s.crc32c for s in entry.segments] != crcs:
            return False
    return True


def _widest(copies: list[tuple[int, RequestEntry]]) -> tuple[int, RequestEntry]:
    """The copy a read takes: the first whose rows cover every other copy's, else the first."""
    lo = min(entry.start_row for _, entry in copies)
    hi = max(entry.end_row for _, entry in copies)
    for src, entry in copies:
        if entry.start_row == lo and entry.end_row == hi:
            return src, entry
    return copies[0]


def _same_cuts(a: RequestEntry, b: RequestEntry) -> bool:
    """Whether two copies hold the same rows in the same segments (their checksums aside)."""
    return (a.start_row, a.rows) == (b.start_row, b.rows) and [s.rows for s in a.segments] == [s.rows for s in b.segments]


def _same_by_checksums(a: RequestEntry, b: RequestEntry, row_bytes: int) -> bool | None:
    """Whether two copies hold the same bytes in the rows both hold, from their segments'
    CRC-32Cs; None when those cannot tell (a segment of one runs across an end of the shared
    rows: the rows are to be read)."""
    if _same_cuts(a, b):
        return [s.crc32c for s in a.segments] == [s.crc32c for s in b.segments]
    lo, hi = max(a.start_row, b.start_row), min(a.end_row, b.end_row)
    if lo >= hi:
        return True  # no row in common: nothing to disagree on
    pieces_a, pieces_b = _within(a, lo, hi), _within(b, lo, hi)
    if pieces_a is None or pieces_b is None:
        return None
    if [s.rows for s in pieces_a] == [s.rows for s in pieces_b]:  # a later turn's copy and an earlier one's
        return [s.crc32c for s in pieces_a] == [s.crc32c for s in pieces_b]
    # Cut otherwise: one CRC-32C of the shared rows each (hashes zeros as long as those rows).
    whole_a = crc32c_concat((s.crc32c, s.rows * row_bytes) for s in pieces_a)
    return whole_a == crc32c_concat((s.crc32c, s.rows * row_bytes) for s in pieces_b)


def _within(entry: RequestEntry, lo: int, hi: int) -> list[Segment] | None:
    """The copy's segments holding rows ``lo .. hi - 1`` exactly, or None when a segment runs
    across ``lo`` or ``hi`` (its CRC-32C covers other rows too)."""
    inside = [s for s in entry.segments if s.start_row < hi and s.end_row > lo]
    if inside[0].start_row != lo or inside[-1].end_row != hi:
        return None
    return inside


def _compare_rows(
    merged: MergedIndex,
    rollout_id: str,
    source_names: Sequence[str],
    undecided: list[tuple[str, int, int, int, int]],
    read_rows: ReadRows,
) -> None:
    """Read the shared rows of each undecided pair of copies and compare them."""
    asks: list[RowsOfCopy] = []
    for rid, read_src, src, lo, hi in undecided:
        asks += [(rid, read_src, lo, hi), (rid, src, lo, hi)]
    rows = read_rows(asks)
    for k, (rid, read_src, src, lo, _hi) in enumerate(undecided):
        mine, theirs = rows[2 * k], rows[2 * k + 1]
        differ = np.flatnonzero((mine != theirs).reshape(len(mine), -1).any(axis=1))
        if len(differ):
            copies = dict(merged.holders(rid))
            raise _disagreement(
                rollout_id, rid, source_names, (read_src, copies[read_src]), (src, copies[src]), row=lo + int(differ[0])
            )


def _disagreement(
    rollout_id: str,
    rid: str,
    source_names: Sequence[str],
    one: tuple[int, RequestEntry],
    other: tuple[int, RequestEntry],
    row: int | None = None,
) -> CorruptDataError:
    """The error for two copies of a request that hold different bytes for the same rows,
    naming both nodes in source order (and, where the rows were read, the first that differs)."""
    (a, first), (b, second) = sorted([one, other], key=lambda copy: copy[0])
    where = "" if row is None else f": row {row} differs"
    return CorruptDataError(
        f"request {rid!r} of rollout {rollout_id!r} is stored with different rows on "
        f"{source_names[a]} ({_copy_of(first)}) and {source_names[b]} ({_copy_of(second)}){where}"
    )


def _copy_of(entry: RequestEntry) -> str:
    """A copy of a request, as a message about copies that differ shows it."""
    return (
        f"rows {entry.start_row}..{entry.end_row - 1} in segments of {[s.rows for s in entry.segments]} rows, "
        f"crc32c {[s.crc32c for s in entry.segments]}"
    )
