"""A read's row selection: some rows of each request (a context-parallel rank's chunks of it).

``rows`` maps a request id to the spans ``(lo, hi)`` of its rows wanted, in the order wanted;
row 0 is the request's first stored row (what ``get_numpy`` returns as row 0). A request not in
the mapping is read whole; one mapped to no span gets no row. A span becomes a piece of the request's stored segments, so a read
fetches and decodes only the row chunks holding those rows (:mod:`r3rdma.read.shard_ranges`
plans by row chunk).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from r3rdma.errors import ConfigError, ShapeMismatchError
from r3rdma.store.index_entries import RequestEntry, Segment

__all__ = ["row_spans", "check_named", "check_rows", "select_segments", "rows_wanted", "cp_row_spans"]

Spans = dict[str, list[tuple[int, int]]]


def row_spans(rows: Mapping[str, Iterable[Any]] | None) -> Spans | None:
    """``rows`` as ``{request id: [(lo, hi), ...]}``, checked for shape (ints, ``0 <= lo < hi``);
    None: every row of every request."""
    if rows is None:
        return None
    if not isinstance(rows, Mapping):
        raise ConfigError(f"rows must map request ids to (lo, hi) row spans, got {type(rows).__name__}")
    out: Spans = {}
    for rid, spans in rows.items():
        if isinstance(spans, range) and spans.step == 1:
            spans = [(spans.start, spans.stop)]
        items: list[tuple[int, int]] = []
        for span in spans:
            try:
                lo, hi = span
            except (TypeError, ValueError):
                raise ConfigError(f"rows[{rid!r}]: each span must be a pair (lo, hi), got {span!r}") from None
            if type(lo) is not int or type(hi) is not int:  # plain ints (the usual case) need no more look
                if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (lo, hi)):
                    raise ConfigError(f"rows[{rid!r}]: a span must be ints with 0 <= lo < hi, got {span!r}")
                lo, hi = int(lo), int(hi)
            if not 0 <= lo < hi:
                raise ConfigError(f"rows[{rid!r}]: a span must be ints with 0 <= lo < hi, got {span!r}")
            items.append((lo, hi))
        out[rid] = items  # none: no row of it (a context-parallel rank holding only padding of a short one)
    return out


def check_named(spans: Spans | None, request_ids: list[str]) -> None:
    """Every request ``spans`` names is among ``request_ids``, else :class:`ConfigError` (the
    part of :func:`check_rows` that needs no index: a collection checks it up front)."""
    if spans is None:
        return
    asked = set(request_ids)
    stray = [rid for rid in spans if rid not in asked]
    if stray:
        raise ConfigError(f"rows names requests not read: {stray[:5]!r}; nothing was read")


def check_rows(rollout_id: str, spans: Spans | None, request_ids: list[str], entry_of: Any) -> None:
    """Every request ``spans`` names is among ``request_ids`` (:func:`check_named`) and every
    span lies within its stored rows, else :class:`ConfigError` / :class:`ShapeMismatchError` (nothing is read)."""
    if spans is None:
        return
    check_named(spans, request_ids)
    for rid, items in spans.items():
        stored = entry_of(rid).rows
        past = [(lo, hi) for lo, hi in items if hi > stored]
        if past:
            raise ShapeMismatchError(
                f"rollout {rollout_id!r} request {rid!r} stores {stored} rows (0..{stored - 1}); rows asked past its end: "
                f"{', '.join(f'{lo}..{hi - 1}' for lo, hi in past[:5])}; nothing was read"
            )


def select_segments(entry: RequestEntry, spans: list[tuple[int, int]]) -> tuple[Segment, ...]:
    """The pieces of ``entry``'s segments holding ``spans`` (checked by :func:`check_rows`), in
    span order: their rows concatenated are the rows asked for. A piece's ``crc32c`` is its
    segment's (it covers more rows): a read of pieces relies on the chunks' own CRC-32C."""
    out: list[Segment] = []
    first = entry.start_row
    for lo, hi in spans:
        for seg in entry.segments:
            a, b = max(lo, seg.start_row - first), min(hi, seg.end_row - first)
            if a < b:
                skip = a - (seg.start_row - first)
                out.append(Segment(seg.array, seg.offset + skip, b - a, first + a, seg.crc32c))
    return tuple(out)


def cp_row_spans(stored_rows: int, padded_length: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """The stored rows of one sequence that context-parallel rank ``cp_rank`` replays, as row
    spans for ``RoutingReader.get_numpy(rows=...)``: the sequence padded to ``padded_length``
    (a multiple of ``2 * cp_size``) is cut in ``2 * cp_size`` chunks, the rank keeping chunks
    ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` (Megatron's load-balanced split, as
    ``r3rdma.integrations.megatron`` replays it); rows past ``stored_rows`` (padding, the
    unrecorded tail) are left out, so a short sequence may give none."""
    if cp_size == 1:
        return [(0, stored_rows)] if stored_rows else []
    if padded_length % (2 * cp_size) or padded_length < stored_rows:
        raise ShapeMismatchError(
            f"context parallel {cp_size} needs a padded length divisible by {2 * cp_size} and >= the "
            f"{stored_rows} stored rows, got {padded_length}"
        )
    c = padded_length // (2 * cp_size)
    spans = [(cp_rank * c, (cp_rank + 1) * c), ((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)]
    return [(lo, min(hi, stored_rows)) for lo, hi in spans if lo < stored_rows]


def rows_wanted(entries: list[RequestEntry], request_ids: list[str], spans: Spans | None) -> list[int]:
    """Rows a read returns of each request (``entries[i]``: ``request_ids[i]``'s): all its rows,
    or those of its spans."""
    if spans is None:
        return [entry.rows for entry in entries]
    return [entry.rows if rid not in spans else sum(hi - lo for lo, hi in spans[rid]) for rid, entry in zip(request_ids, entries)]
