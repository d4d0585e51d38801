"""Segment assembly: a rollout's records applied to its visible and pending requests.

A request may arrive in several records (later turns of a conversation, the prefill and decode
engines of a disaggregated deployment). Records that do not yet complete their request are
stored durably but listed as pending, which readers ignore; the request becomes visible once
its segments cover every row of its span exactly once (docs/ENGINE_SEMANTICS.md states the
rules, :class:`Assembly` applies them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from r3rdma.errors import SegmentError, SegmentOverlapError, SharedRowsMissingError
from r3rdma.records import RequestRecord, checksum
from r3rdma.store.index_entries import PendingSegment, RequestEntry, Segment

__all__ = ["Assembly"]


class Assembly:
    """Applies records to a rollout's ``requests`` (visible) and ``pending`` (incomplete) maps.

    Rules (docs/ENGINE_SEMANTICS.md): a record identical to a stored segment is a duplicate;
    rows a record shares with another segment of its request are a conflict
    (:class:`SegmentOverlapError`); a request becomes visible once a final segment exists and
    its segments tile the span ``[start, end)`` exactly, where ``end`` is the final segment's
    end and ``start`` is ``end - total_rows`` when declared, else the end of the rows already
    visible (a continuation), else row 0.

    Several final segments are several turns of a conversation; they become visible turn by
    turn, in row order, each once the rows before it are visible. A request is never made
    visible from a row other than 0 (a later turn that arrived first waits, pending, for the
    earlier turns instead of becoming visible with only its rows, which would then refuse
    them); a later turn that leaves a gap after the visible rows waits for the gap likewise.
    Two finals whose declared spans share rows conflict (:class:`SegmentOverlapError`).

    Shared prefixes (a record with ``shared_prefix``): the source's visible segments covering
    rows ``0 .. P - 1`` become the request's first segments, pointing at the source's bytes
    (a segment cut at ``P`` gets the CRC-32C of its first rows), then the record's own segment;
    the request is visible at once. The source must be visible here already (stored, or earlier
    in the batch) with ``P`` rows or more, else :class:`SharedRowsMissingError`.

    ``stored_checksum(array, offset, rows)``: the CRC-32C of ``rows`` stored rows of an array
    of an earlier commit (a cut of a source segment stored there).

    Same rows, any split (issue "Stored as said"): a record is judged by its rows, not by how
    they are cut into segments or whether they are inline or a reference. A record identical to
    a stored segment is a duplicate at once (the fast path: no bytes read). Otherwise a record
    whose rows lie within the visible rows (default mode), or a shared-prefix record of a
    request already visible from row 0, is compared with the stored rows of the range both hold,
    read back through ``stored_rows(array, offset, rows)`` (only where the two segment lists
    differ: a segment of the same start, rows and CRC-32C on both sides is not read): the same
    bytes are a duplicate, and a shared-prefix record longer than the stored request extends it
    with its rows past the stored ones; different bytes are refused
    (:class:`SegmentOverlapError`) naming the first differing row. Without ``stored_rows`` the
    comparison is not made and such a record is refused as before.
    """

    def __init__(
        self,
        rollout_id: str,
        requests: Mapping[str, RequestEntry],
        pending: Mapping[str, tuple[PendingSegment, ...]],
        only_last_turn: bool,
        stored_checksum: Callable[[str, int, int], int] | None = None,
        stored_rows: Callable[[str, int, int], np.ndarray] | None = None,
    ) -> None:
        self.rollout_id = rollout_id
        self.only_last_turn = only_last_turn
        self._stored_checksum = stored_checksum
        self._stored_rows = stored_rows
        self._in_batch: set[str] = set()
        # Rows of this batch's records by (array, offset): a cut of a segment written by this
        # batch is hashed (or compared) from the record's rows, the very bytes the array holds.
        self._placed: dict[tuple[str, int], np.ndarray] = {}
        self._placed_arrays: set[str] = set()
        # What this batch changes, over the stored maps (read, never written here): the new
        # whole entry of each request it makes visible or extends, and the new pending list
        # of each request whose pending parts change (() once none are left).
        self._stored_requests = requests
        self._stored_pending = pending
        self.requests: dict[str, RequestEntry] = {}
        self.pending: dict[str, tuple[PendingSegment, ...]] = {}

    def add(self, record: RequestRecord, array: str, offset: int) -> bool:
        """Apply one record stored at ``array[offset:]``; False if it duplicates a stored
        segment. Raises on conflicts, having changed nothing."""
        if record.shared_prefix is not None:
            return self._add_shared(record, array, offset)
        rid = record.request_id
        entry = self.requests.get(rid) or self._stored_requests.get(rid)
        parts = list(self.pending[rid] if rid in self.pending else self._stored_pending.get(rid, ()))
        if any(_same(seg, record) for seg in (*(entry.segments if entry else ()), *parts)):
            return False
        in_batch = rid in self._in_batch
        if entry is not None and self._same_rows_as_visible(record, entry, in_batch):
            return False  # the same rows, stored split otherwise (or by reference)
        self._in_batch.add(rid)
        if entry is not None:
            self._check_against_visible(record, entry, in_batch)
        self._check_against_pending(record, parts)
        new = PendingSegment(array, offset, record.num_rows, record.start_row, record.crc32c, record.final, record.total_rows)
        group = sorted([*parts, new], key=lambda x: x.start_row)
        self._check_within_last_final(rid, group)
        group = self._promote(rid, entry, group)
        if group or rid in self._stored_pending:
            self.pending[rid] = tuple(group)
        else:
            self.pending.pop(rid, None)
        self._place(array, offset, record)
        return True

    # -- shared prefixes: rows another request of the rollout holds -------------------------

    def _add_shared(self, record: RequestRecord, array: str, offset: int) -> bool:
        """Apply a record whose rows ``0 .. P - 1`` are another request's (its ``shared_prefix``)."""
        shared = record.shared_prefix
        assert shared is not None
        rid = record.request_id
        segments = (*self._shared_segments(record), Segment(array, offset, record.num_rows, record.start_row, record.crc32c))
        entry = self.requests.get(rid) or self._stored_requests.get(rid)
        if entry is not None:
            # The same rows again (a retry, or the request stored inline by a writer's
            # fallback, which gives the same segments' rows and checksums): a duplicate.
            if entry.start_row == 0 and _layout(entry.segments) == _layout(segments):
                return False
            done = self._shared_again(record, entry, segments, array, offset)
            if done is not None:
                return done
            raise SegmentOverlapError(
                f"{self._where(rid)} is already stored (rows {entry.start_row}..{entry.end_row - 1}, segments "
                f"{_layout(entry.segments)} as (start_row, rows, crc32c)); a record sharing rows 0..{shared.rows - 1} "
                f"of {shared.request_id!r} gives other rows {_layout(segments)} ({_describe(record)})"
            )
        parts = self.pending[rid] if rid in self.pending else self._stored_pending.get(rid, ())
        if parts:
            raise SegmentOverlapError(
                f"{self._where(rid)} has pending segments (rows "
                + ", ".join(f"{x.start_row}..{x.end_row - 1}" for x in parts)
                + f"); a record sharing rows 0..{shared.rows - 1} of {shared.request_id!r} is a whole request "
                f"({_describe(record)})"
            )
        self._in_batch.add(rid)
        self.requests[rid] = RequestEntry(record.end_row, 0, segments)
        self._place(array, offset, record)
        return True

    def _shared_segments(self, record: RequestRecord) -> tuple[Segment, ...]:
        """The source's visible segments covering rows ``0 .. P - 1``, the last cut at ``P``."""
        shared = record.shared_prefix
        assert shared is not None
        source, rows = shared.request_id, shared.rows
        entry = self.requests.get(source) or self._stored_requests.get(source)
        if entry is None or entry.start_row != 0 or entry.rows < rows:
            pending = self.pending[source] if source in self.pending else self._stored_pending.get(source, ())
            if entry is not None:
                held = f"holds rows {entry.start_row}..{entry.end_row - 1}"
            elif pending:
                held = "is not complete yet (pending segments only)"
            else:
                held = "is not stored"
            raise SharedRowsMissingError(
                f"{self._where(record.request_id)} shares rows 0..{rows - 1} of request {source!r}, which {held} "
                f"on this store; nothing of the record was stored (rows 0..{rows - 1} must be sent inline)"
            )
        out = []
        for seg in entry.segments:
            if seg.start_row >= rows:
                break
            if seg.end_row <= rows:
                out.append(Segment(seg.array, seg.offset, seg.rows, seg.start_row, seg.crc32c))
            else:
                cut = rows - seg.start_row
                out.append(Segment(seg.array, seg.offset, cut, seg.start_row, self._cut_checksum(seg.array, seg.offset, cut)))
        return tuple(out)

    def _cut_checksum(self, array: str, offset: int, rows: int) -> int:
        """The CRC-32C of the first ``rows`` rows of the segment at ``array[offset:]``.

        Hashed from the bytes stored there (the batch's own record when this batch wrote the
        array, else the store reads them back), never from the referencing record's copy
        (``SharedPrefix.ids_TLK``): the index's checksum must describe the stored rows, and a
        copy that differs from them (an engine bug) would make the request fail its checksum
        on every read instead of at commit; a store node never receives the copy anyway.
        """
        placed = self._placed_rows(array, offset, rows)
        if placed is not None:
            return checksum(placed)
        if self._stored_checksum is None:
            raise SharedRowsMissingError(
                f"rollout {self.rollout_id!r}: rows {offset}..{offset + rows - 1} of array {array} cannot be read to "
                "checksum a shared prefix cut inside a stored segment"
            )
        return self._stored_checksum(array, offset, rows)

    # -- the same rows, split otherwise: compared by bytes (the slow path) --------------------

    def _place(self, array: str, offset: int, record: RequestRecord) -> None:
        self._placed[(array, offset)] = record.ids_TLK
        self._placed_arrays.add(array)

    def _placed_rows(self, array: str, offset: int, rows: int) -> np.ndarray | None:
        """Rows ``array[offset : offset + rows]`` when this batch writes them (else None)."""
        ids = self._placed.get((array, offset))
        if ids is not None:
            return ids[:rows]
        if array in self._placed_arrays:  # a cut inside a record of this batch (rare)
            for (a, o), ids in self._placed.items():
                if a == array and o <= offset and offset + rows <= o + len(ids):
                    return ids[offset - o : offset - o + rows]
        return None

    def _read(self, array: str, offset: int, rows: int) -> np.ndarray:
        """The bytes of rows ``array[offset : offset + rows]``: this batch's, else the store's;
        :class:`_Unreadable` when the store gave no way to read them."""
        placed = self._placed_rows(array, offset, rows)
        if placed is not None:
            return placed
        if self._stored_rows is None or array in self._placed_arrays:
            raise _Unreadable
        return np.asarray(self._stored_rows(array, offset, rows))

    def _segment_piece(self, seg: Segment) -> _Piece:
        return _Piece(seg.start_row, seg.rows, seg.crc32c, lambda k, n: self._read(seg.array, seg.offset + k, n))

    def _same_rows_as_visible(self, record: RequestRecord, entry: RequestEntry, in_batch: bool) -> bool:
        """Whether a record whose rows lie within the visible request's holds the very bytes
        stored there (then a duplicate). Raises :class:`SegmentOverlapError` naming the first
        differing row; False (the caller's rules apply) when the record is not within the
        visible rows, in ``only_last_turn`` mode, or when the stored rows cannot be read."""
        if self.only_last_turn or not (entry.start_row <= record.start_row and record.end_row <= entry.end_row):
            return False
        own = _Piece(record.start_row, record.num_rows, record.crc32c, _slicer(record.ids_TLK))
        try:
            row = _first_difference([own], [self._segment_piece(s) for s in entry.segments], record.start_row, record.end_row)
        except _Unreadable:
            return False
        if row is None:
            return True
        raise SegmentOverlapError(
            f"{self._where(record.request_id)} "
            + ("appears twice in one batch with different rows" if in_batch else "is already stored")
            + f" (rows {entry.start_row}..{entry.end_row - 1}, segments {_layout(entry.segments)} as (start_row, rows, "
            f"crc32c)); a record with different bytes arrived ({_describe(record)}): row {row} differs from the stored row; "
            f"only start_row {entry.end_row} would extend it"
        )

    def _shared_again(
        self, record: RequestRecord, entry: RequestEntry, segments: tuple[Segment, ...], array: str, offset: int
    ) -> bool | None:
        """A shared-prefix record of a request already visible whose segments differ from the
        stored ones: False if its rows are the stored rows (a duplicate), True once its rows past
        the stored ones extend the request (``only_last_turn``: its full view replaces it);
        raises :class:`SegmentOverlapError` naming the first differing row; None when the
        caller's refusal applies (not visible from row 0, pending parts, an older shorter view
        with ``only_last_turn``, or rows that cannot be read)."""
        rid, shared = record.request_id, record.shared_prefix
        assert shared is not None
        end, ce = record.end_row, entry.end_row
        parts = self.pending[rid] if rid in self.pending else self._stored_pending.get(rid, ())
        if entry.start_row != 0 or (end > ce and parts) or (self.only_last_turn and end < ce):
            return None
        if self.only_last_turn and end > ce:
            self._in_batch.add(rid)
            self.requests[rid] = RequestEntry(end, 0, segments)
            self._place(array, offset, record)
            return True
        own = _Piece(record.start_row, record.num_rows, record.crc32c, _slicer(record.ids_TLK))
        mine = [*(self._segment_piece(s) for s in segments[:-1]), own]
        try:
            row = _first_difference(mine, [self._segment_piece(s) for s in entry.segments], 0, min(end, ce))
            if row is None and end > ce:
                tail = self._tail(segments, record, ce)
        except _Unreadable:
            return None
        if row is not None:
            raise SegmentOverlapError(
                f"{self._where(rid)} is already stored (rows {entry.start_row}..{ce - 1}, segments "
                f"{_layout(entry.segments)} as (start_row, rows, crc32c)); a record sharing rows "
                f"0..{shared.rows - 1} of {shared.request_id!r} gives other rows "
                f"{_layout(segments)} ({_describe(record)}): row {row} differs from the stored row"
            )
        if end <= ce:
            return False
        self._in_batch.add(rid)
        self.requests[rid] = RequestEntry(entry.rows + end - ce, 0, entry.segments + tail)
        self._place(array, offset, record)
        return True

    def _tail(self, segments: tuple[Segment, ...], record: RequestRecord, first: int) -> tuple[Segment, ...]:
        """The part of ``segments`` (the last one the record's own) from row ``first`` on, a
        segment cut there re-hashed from its kept rows."""
        out = []
        for i, seg in enumerate(segments):
            if seg.end_row <= first:
                continue
            if seg.start_row >= first:
                out.append(seg)
                continue
            k = first - seg.start_row
            own = i == len(segments) - 1
            kept = record.ids_TLK[k:] if own else self._read(seg.array, seg.offset + k, seg.rows - k)
            out.append(Segment(seg.array, seg.offset + k, seg.rows - k, first, checksum(kept)))
        return tuple(out)

    # -- the conflicts a record may raise ---------------------------------------------------

    def _check_against_visible(self, record: RequestRecord, entry: RequestEntry, in_batch: bool) -> None:
        """Rows the visible request already holds, or rows before them, are refused (unless
        ``only_last_turn``, where a later turn's full view replaces the request)."""
        if self.only_last_turn:
            return
        start, end = record.start_row, record.end_row
        cs, ce = entry.start_row, entry.end_row
        if start < ce and end > cs:
            raise SegmentOverlapError(
                f"{self._where(record.request_id)} "
                + ("appears twice in one batch with different rows" if in_batch else "is already stored")
                + f" (rows {cs}..{ce - 1}, crc32c {entry.segments[-1].crc32c:#010x}); a record with different "
                f"bytes arrived ({_describe(record)}); only start_row {ce} would extend it"
            )
        if end <= cs:
            raise SegmentError(
                f"{self._where(record.request_id)} is visible from row {cs}; rows before it cannot be added "
                f"({_describe(record)}): push a request's earlier segments first, or declare total_rows on its "
                "final segment"
            )

    def _check_against_pending(self, record: RequestRecord, parts: list[PendingSegment]) -> None:
        """Rows a pending segment holds are refused, and so is a final whose declared span
        shares rows with another pending final's (several finals: several turns, a later one
        may arrive first)."""
        start, end = record.start_row, record.end_row
        for seg in parts:
            if start < seg.end_row and end > seg.start_row:
                raise SegmentOverlapError(
                    f"{self._where(record.request_id)}: a record ({_describe(record)}) overlaps its pending segment "
                    f"rows {seg.start_row}..{seg.end_row - 1} with different bytes"
                )
        if not record.final:
            return
        lo = start if record.total_rows is None else end - record.total_rows
        for f in (x for x in parts if x.final):
            if lo < f.end_row and f.span_start < end:
                raise SegmentOverlapError(
                    f"{self._where(record.request_id)}: two final segments, rows ending at {f.end_row - 1} (pending) "
                    f"and at {end - 1} ({_describe(record)}), declare spans {f.span_start}..{f.end_row - 1} and "
                    f"{lo}..{end - 1} that overlap"
                )

    def _check_within_last_final(self, rid: str, group: list[PendingSegment]) -> None:
        """No segment may extend past the last row the request's last final declares."""
        finals = [x for x in group if x.final]
        if not finals:
            return
        last = max(x.end_row for x in finals)
        beyond = [x for x in group if x.end_row > last]
        if beyond:
            x = beyond[0]
            raise SegmentOverlapError(
                f"{self._where(rid)}: segment rows {x.start_row}..{x.end_row - 1} extend past the request's "
                f"last row {last - 1} (declared by its final segment)"
            )

    # -- promotion: pending segments that complete a turn become visible --------------------

    def _promote(self, rid: str, entry: RequestEntry | None, group: list[PendingSegment]) -> list[PendingSegment]:
        """Promote turn by turn: the earliest-ending final and the segments before it become
        visible once they tile its span from where the visible rows end (row 0 for a request
        not visible yet). A later turn that arrived first waits, pending, for the earlier ones.
        Returns the segments still pending."""
        while True:
            final = min((x for x in group if x.final), key=lambda x: x.start_row, default=None)
            if final is None:
                return group
            last = final.end_row
            turn = [x for x in group if x.start_row < last]
            first = self._turn_start(rid, entry, final, turn[0].start_row)
            mode = self._mode(rid, entry, first, last)
            if mode is None or not _tiles(turn, first, last):
                return group  # earlier turns, or a gap another part may fill, have not arrived yet
            segments = tuple(x.visible() for x in turn)
            if mode == "extend":
                assert entry is not None
                entry = RequestEntry(entry.rows + last - first, entry.start_row, entry.segments + segments)
            else:
                entry = RequestEntry(last - first, first, segments)
            self.requests[rid] = entry
            group = group[len(turn) :]

    def _turn_start(self, rid: str, entry: RequestEntry | None, final: PendingSegment, lowest: int) -> int:
        """The first row of the turn ``final`` ends: ``total_rows`` before its end when
        declared, else where the visible rows end (a continuation) or its lowest segment's row
        when that lies within them, else row 0 (a request's rows start at row 0: earlier turns
        are waited for). Segments below it conflict."""
        if final.total_rows is not None:
            first = final.end_row - final.total_rows
        elif entry is not None:
            first = entry.end_row if lowest >= entry.end_row else lowest
        else:
            first = 0
        if lowest < first:
            raise SegmentOverlapError(
                f"{self._where(rid)}: segment rows from {lowest} lie before row {first}, where its final segment "
                f"(total_rows {final.total_rows}) says the request starts"
            )
        return first

    def _mode(self, rid: str, entry: RequestEntry | None, first: int, last: int) -> str | None:
        """How the turn ``first .. last - 1`` joins the visible request: "new" (none visible),
        "extend" (it starts where the visible rows end), "replace" (``only_last_turn``: a full
        view from the same first row, longer); None while rows before it have not arrived."""
        if entry is None:
            return "new" if first == 0 else None  # rows 0..first-1 (earlier turns) not arrived yet
        cs, ce = entry.start_row, entry.end_row
        if first == ce:
            return "extend"
        if self.only_last_turn and first == cs and last > ce:
            return "replace"
        if first < ce:
            raise SegmentOverlapError(
                f"{self._where(rid)} is already stored (rows {cs}..{ce - 1}); segments ending at row {last - 1} would "
                f"cover rows {first}..{ce - 1} again; only start_row {ce} would extend it"
                + ("" if not self.only_last_turn else f", or a later turn's full view starting at row {cs}")
            )
        return None  # rows ce..first-1 (an earlier turn) have not arrived yet

    def _where(self, rid: str) -> str:
        return f"request {rid!r} of rollout {self.rollout_id!r}"


def _describe(record: RequestRecord) -> str:
    return f"start_row {record.start_row}, {record.num_rows} rows, crc32c {record.crc32c:#010x}"


def _layout(segments: tuple[Segment, ...]) -> list[tuple[int, int, int]]:
    """``(start_row, rows, crc32c)`` of each segment: what two stored copies of a request's rows
    agree on (where the bytes lie may differ)."""
    return [(s.start_row, s.rows, s.crc32c) for s in segments]


def _tiles(turn: list[PendingSegment], first: int, last: int) -> bool:
    """Whether ``turn`` (in row order) covers rows ``first .. last - 1`` with no gap."""
    covered = first
    for x in turn:
        if x.start_row != covered:
            break
        covered += x.rows
    return covered == last


def _same(seg: Segment, record: RequestRecord) -> bool:
    return seg.start_row == record.start_row and seg.rows == record.num_rows and seg.crc32c == record.crc32c


class _Unreadable(Exception):
    """Stored rows a comparison needs cannot be read here (no ``stored_rows``)."""


class _Piece(NamedTuple):
    """Rows ``start .. start + rows - 1`` of a request, their CRC-32C, and how to read them:
    ``fetch(k, n)`` gives the piece's rows ``k .. k + n - 1``."""

    start: int
    rows: int
    crc32c: int
    fetch: Callable[[int, int], np.ndarray]


def _slicer(ids: np.ndarray) -> Callable[[int, int], np.ndarray]:
    return lambda k, n: ids[k : k + n]


def _gather(pieces: list[_Piece], lo: int, hi: int) -> np.ndarray:
    """Rows ``lo .. hi - 1`` of ``pieces`` (which cover them), in row order."""
    out = [p.fetch(a - p.start, b - a) for p in pieces if (a := max(lo, p.start)) < (b := min(hi, p.start + p.rows))]
    return out[0] if len(out) == 1 else np.concatenate(out)


def _first_difference(mine: list[_Piece], stored: list[_Piece], lo: int, hi: int) -> int | None:
    """The first row of ``lo .. hi - 1`` where ``mine`` and ``stored`` (each covering those
    rows) differ, None if none. A stored segment matched by one of ``mine`` (same start, rows
    and CRC-32C: the fast path's rule) is not read."""
    matched = {(p.start, p.rows, p.crc32c) for p in mine}
    for p in stored:
        a, b = max(lo, p.start), min(hi, p.start + p.rows)
        if a >= b or (p.start, p.rows, p.crc32c) in matched:
            continue
        theirs, ours = p.fetch(a - p.start, b - a), _gather(mine, a, b)
        if theirs.shape != ours.shape:
            return a
        rows = np.flatnonzero((theirs != ours).reshape(b - a, -1).any(axis=1))
        if rows.size:
            return a + int(rows[0])
    return None
