"""A snapshot's request entries in columns (docs/FORMAT.md, "Snapshots"): encoded for the
writer, decoded and checked for readers, kept as columns until an entry is looked up."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, KeysView, Mapping, MutableMapping
from typing import Any

import numpy as np

from r3rdma.store.index_entries import RequestEntry, Segment, malformed

__all__ = ["ColumnRequests", "encode_requests", "decode_requests"]

_COLUMNS = ("ids", "rows", "start_row", "segments")
_SEGMENT_COLUMNS = ("seg_array", "seg_offset", "seg_rows", "seg_start_row", "seg_crc32c")


def encode_requests(requests: Mapping[str, RequestEntry], arrays: list[str]) -> dict[str, list]:
    """Request entries as columns: a snapshot's ``requests``.

    Why columns: at 16k requests the ``{id: {"rows", "start_row", "segments": [{...}]}}`` form
    is ~50k small JSON objects, which took a fresh reader ~90 ms to parse and ~130 ms to check
    one by one on the CPU VM. Columns are flat lists of ints (``segments``: each request's
    segment count; ``seg_array``: an index into ``arrays``), parsed fast and checked with
    numpy at once.
    """
    where = {name: i for i, name in enumerate(arrays)}
    out: dict[str, list] = {key: [] for key in (*_COLUMNS, *_SEGMENT_COLUMNS)}
    ids, rows, start, count = out["ids"], out["rows"], out["start_row"], out["segments"]
    s_array, s_offset, s_rows, s_start, s_crc = (out[k] for k in _SEGMENT_COLUMNS)
    for rid, entry in requests.items():
        ids.append(rid)
        rows.append(entry.rows)
        start.append(entry.start_row)
        count.append(len(entry.segments))
        for seg in entry.segments:
            s_array.append(where[seg.array])
            s_offset.append(seg.offset)
            s_rows.append(seg.rows)
            s_start.append(seg.start_row)
            s_crc.append(seg.crc32c)
    return out


class ColumnRequests(MutableMapping[str, RequestEntry]):
    """A snapshot's request entries, kept as its columns: a :class:`RequestEntry` to whoever
    looks an id up, each entry built when it is looked up.

    Why: decoding a snapshot into entries (one entry and one tuple per request, one segment
    per segment) was half of a fresh reader's index open at 16k requests (~13 ms per
    8k-request node on the CPU VM), and those objects were walked again by the cyclic GC; a
    reader looks up only the requests it reads. Ids map to their column row (an int) until an
    entry replaces them (a later part); ``keys()`` is a plain dict's, so set operations on ids
    stay C-level.
    """

    def __init__(self, keys: dict[str, Any], columns: tuple[list, ...]) -> None:
        self._keys = keys  # request id -> its row in the columns, or an entry set since
        self._columns = columns  # rows, start_row, first segment, segments, then the segment columns

    def __getitem__(self, rid: str) -> RequestEntry:
        at = self._keys[rid]
        if at.__class__ is not int:
            return at
        rows, start, first, count, s_array, s_offset, s_rows, s_start, s_crc = self._columns
        k = first[at]
        entry = RequestEntry(
            rows[at],
            start[at],
            tuple([Segment(s_array[j], s_offset[j], s_rows[j], s_start[j], s_crc[j]) for j in range(k, k + count[at])]),
        )
        # Kept: a read looks a request up several times (plan, replicas, packing). The same
        # entry either way, so readers on other threads see no change (a race builds it twice).
        self._keys[rid] = entry
        return entry

    def rows(self, rid: str) -> int:
        """``self[rid].rows`` without building the entry."""
        at = self._keys[rid]
        return self._columns[0][at] if at.__class__ is int else at.rows

    def rows_of(self, rids: Iterable[str]) -> int:
        """The rows of ``rids`` added up, without building their entries: the lookups and the
        column reads are C-level maps (a Python call per id cost ~1 us)."""
        places = list(map(self._keys.__getitem__, rids))
        at = [p for p in places if p.__class__ is int]
        total = sum(map(self._columns[0].__getitem__, at))
        if len(at) < len(places):
            total += sum(p.rows for p in places if p.__class__ is not int)
        return total

    def __setitem__(self, rid: str, entry: RequestEntry) -> None:
        self._keys[rid] = entry

    def __delitem__(self, rid: str) -> None:
        del self._keys[rid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, rid: object) -> bool:
        return rid in self._keys

    def keys(self) -> KeysView[str]:
        """The request ids: the id dict's own view (set operations on it stay C-level)."""
        return self._keys.keys()

    def copy(self) -> ColumnRequests:
        """A copy later updates do not change (the columns are never changed)."""
        return ColumnRequests(dict(self._keys), self._columns)

    def __repr__(self) -> str:
        return f"ColumnRequests({len(self._keys)} requests)"


def decode_requests(columns: Any, arrays: list[str], rollout_id: str, where: str, what: str) -> ColumnRequests:
    """:func:`encode_requests`'s columns back to a mapping of entries (:class:`ColumnRequests`),
    every value checked first (a damaged snapshot raises :class:`CorruptDataError`, never a
    TypeError deep in a read)."""
    if not isinstance(columns, dict) or not all(isinstance(columns.get(k), list) for k in (*_COLUMNS, *_SEGMENT_COLUMNS)):
        raise malformed(rollout_id, where, what, f"'requests' must be columns {', '.join(_COLUMNS + _SEGMENT_COLUMNS)}")
    ids = columns["ids"]
    n = len(ids)
    if (n and set(map(type, ids)) != {str}) or len(set(ids)) != n:  # C-level loops
        raise malformed(rollout_id, where, what, "'ids' must list distinct request ids")
    ints: dict[str, np.ndarray] = {}
    for key in (*_COLUMNS[1:], *_SEGMENT_COLUMNS):
        try:
            col = np.asarray(columns[key]) if columns[key] else np.zeros(0, np.int64)
        except (ValueError, OverflowError):
            col = np.zeros(0, object)
        if col.ndim != 1 or col.dtype.kind not in "iu" or (col.size and col.min() < 0):
            raise malformed(rollout_id, where, what, f"{key!r} must list ints >= 0")
        ints[key] = col
    count = ints["segments"]
    if any(ints[k].size != n for k in _COLUMNS[1:]) or (n and count.min() < 1):
        raise malformed(rollout_id, where, what, f"'rows', 'start_row' and 'segments' must each list {n} values, segments >= 1")
    total = int(count.sum())
    if any(ints[k].size != total for k in _SEGMENT_COLUMNS):
        raise malformed(rollout_id, where, what, f"each segment column must list {total} values")
    if total and (ints["seg_array"].max() >= len(arrays) or ints["seg_rows"].min() < 1 or ints["seg_crc32c"].max() >= 1 << 32):
        raise malformed(rollout_id, where, what, "a segment names no listed array, has no rows, or a crc32c past 32 bits")
    if n and not np.array_equal(np.add.reduceat(ints["seg_rows"], np.cumsum(count) - count), ints["rows"]):
        raise malformed(rollout_id, where, what, "a request's segments do not hold its rows")
    first = (np.cumsum(count) - count).tolist() if n else []
    # The checked columns are kept as the lists JSON gave (Python ints already): converting the
    # arrays back with tolist() was ~1 ms of an 8k-request snapshot's ~10 ms decode.
    s_array = list(map(arrays.__getitem__, columns["seg_array"]))
    return ColumnRequests(
        dict(zip(ids, range(n))),
        (
            columns["rows"],
            columns["start_row"],
            first,
            columns["segments"],
            s_array,
            *(columns[k] for k in _SEGMENT_COLUMNS[1:]),
        ),
    )
