"""A read's request selection: the ids asked for, and the rows each of them must store.

Both are checked before anything is read: a bad id list (an id that is not one, or one named
twice) is the caller's bug, and a request whose stored row count is not the sample's
(``expected_rows``) is another request's routing under that id; either would otherwise be
trained on.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Protocol

import numpy as np

from r3rdma.errors import ConfigError, InvalidIdError, MissingRowsError, RowCountMismatchError
from r3rdma.ids import validate_id
from r3rdma.store.index_entries import RequestEntry

__all__ = ["check_ids", "expected_row_counts", "check_expected_rows"]


class _Entries(Protocol):
    """What :func:`check_expected_rows` needs of an index: each request's entry."""

    def entry(self, rid: str) -> RequestEntry: ...


def check_ids(request_ids: Iterable[str]) -> list[str]:
    """The ids as a list, each valid, none repeated (a repeat is a caller's bug: its rows would
    be trained on twice, or a dict would silently drop one)."""
    if isinstance(request_ids, str):
        raise InvalidIdError(f"request ids must be a list of ids, got one string {request_ids[:200]!r}")
    ids = list(request_ids)
    for rid in ids:
        validate_id(rid, "request_id")
    if len(set(ids)) != len(ids):
        counts = collections.Counter(ids)
        repeated = [(rid, n) for rid, n in counts.items() if n > 1]
        raise InvalidIdError(
            f"request ids repeat: {', '.join(f'{rid!r} x{n}' for rid, n in repeated[:5])}"
            + (f" and {len(repeated) - 5} more" if len(repeated) > 5 else "")
            + f" ({len(ids)} ids, {len(counts)} distinct); nothing was read"
        )
    return ids


def expected_row_counts(expected_rows: Mapping[str, int] | None, request_ids: list[str]) -> dict[str, int] | None:
    """``expected_rows`` checked for shape (no index needed): requests among ``request_ids``
    mapped to ints >= 0, else :class:`ConfigError` naming the first offenders; None: no check."""
    if expected_rows is None:
        return None
    if not isinstance(expected_rows, Mapping):
        raise ConfigError(f"expected_rows must map request ids to row counts, got {type(expected_rows).__name__}")
    asked = set(request_ids)
    stray = [rid for rid in expected_rows if rid not in asked]
    if stray:
        raise ConfigError(
            f"expected_rows names requests not read: {stray[:5]!r}"
            + (f" and {len(stray) - 5} more" if len(stray) > 5 else "")
            + "; nothing was read"
        )
    out: dict[str, int] = {}
    for rid, n in expected_rows.items():
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ConfigError(f"expected_rows[{rid!r}] must be an int >= 0 (the rows the request stores), got {n!r}")
        out[rid] = int(n)
    return out


def check_expected_rows(rollout_id: str, expected: dict[str, int] | None, index: _Entries) -> None:
    """Every request of ``expected`` stores exactly its rows, from row 0 (its index entry says;
    nothing is read), else :class:`RowCountMismatchError` (or, where only rows from a later row
    on are stored and they end where expected, :class:`MissingRowsError`) naming the first."""
    if not expected:
        return
    wrong = []
    for rid, n in expected.items():
        entry = index.entry(rid)
        if entry.rows != n or entry.start_row:
            wrong.append((rid, n, entry))
    if not wrong:
        return
    rid, n, entry = wrong[0]
    more = ""
    if len(wrong) > 1:
        more = f"; {len(wrong) - 1} more of the {len(expected)} requests checked differ: " + ", ".join(
            f"{r!r} (stores {e.rows}, expected {m})" for r, m, e in wrong[1:5]
        )
        more += f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""
    if entry.start_row and entry.end_row == n:
        raise MissingRowsError(
            f"rollout {rollout_id!r} request {rid!r} is stored from row {entry.start_row} on (rows "
            f"{entry.start_row}..{entry.end_row - 1}): rows 0..{entry.start_row - 1} of the {n} expected have no "
            f"routing (only later turns were stored){more}; nothing was read"
        )
    where = f" (rows {entry.start_row}..{entry.end_row - 1}, none for rows 0..{entry.start_row - 1})" if entry.start_row else ""
    raise RowCountMismatchError(
        f"rollout {rollout_id!r} request {rid!r} stores {entry.rows} routing rows{where}, the caller expects {n}: "
        f"this is not that sample's routing. Likely another request's routing stored under this id (a reused "
        f"request id, whose later commit the store refused), or a commit that failed; else the expected count "
        f"(the sample's tokens - 1) is wrong{more}; nothing was read",
        rollout_id=rollout_id,
        request_id=rid,
        expected=n,
        stored=entry.rows,
    )
