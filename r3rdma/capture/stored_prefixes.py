"""Stored prefixes: which rows a finishing request shares with a request already stored.

A request whose first positions were not computed for it but reused from KV another request
computed (a prefix-cache hit, :meth:`~r3rdma.capture.capturer.RoutingCapturer.attach_cached`;
a fork of n > 1 samples, :meth:`~r3rdma.capture.capturer.RoutingCapturer.fork_request`) holds
for those positions the very ``(slot, generation)`` pairs the computing request holds: the
same write of the same slot, hence the same routing rows, by construction. Two computations of
the same prefix (two prefills) have different generations and are never matched, so nothing is
shared by content alone: each sample replays what its own forward used (issue #35).

:class:`StoredPrefixes` remembers, for the last ``capacity`` requests this capturer stored from
row 0, their prompt rows' ``(slot, generation)`` pairs, keyed by those of row 0; :meth:`match` finds
the longest prefix a finishing request shares with one of them. The capturer then sends only
the request's own rows with a :class:`~r3rdma.records.SharedPrefix` naming the stored one, and
the store points the shared rows at the bytes it already holds.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

__all__ = ["StoredPrefixes"]


class StoredPrefixes:
    """The ``(slot, generation)`` pairs of recently stored requests' rows, by their row 0.

    Args:
        capacity: requests remembered (the oldest is dropped first); a request is worth
            remembering while its prompt's KV may still be hit, which an engine's cache bounds.
        min_rows: the fewest shared rows worth a reference (shorter prefixes are sent inline).
    """

    def __init__(self, *, capacity: int = 1024, min_rows: int = 16) -> None:
        self.capacity = capacity
        self.min_rows = max(1, min_rows)
        # (rollout, slot of row 0, generation of row 0) -> [(stored id, slots, gens)], oldest
        # first: the requests of one group all start with their source's row 0.
        self._by_first: OrderedDict[tuple[str, int, int], list[tuple[str, np.ndarray, np.ndarray]]] = OrderedDict()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def remember(self, rollout_id: str, request_id: str, slots: np.ndarray, gens: np.ndarray) -> None:
        """``request_id`` was stored with rows ``0 .. len(slots) - 1`` at these slots and generations."""
        if self.capacity <= 0 or slots.size < self.min_rows:
            return
        key = (rollout_id, int(slots[0]), int(gens[0]))
        self._by_first.setdefault(key, []).append((request_id, slots, gens))
        self._by_first.move_to_end(key)
        self._count += 1
        while self._count > self.capacity:
            oldest_key, oldest = next(iter(self._by_first.items()))
            oldest.pop(0)
            self._count -= 1
            if not oldest:
                del self._by_first[oldest_key]

    def match(self, rollout_id: str, slots: np.ndarray, gens: np.ndarray) -> tuple[str, int] | None:
        """(stored id, rows) of the longest stored prefix of a request with rows 0.. at ``slots``
        and ``gens`` (the earliest stored of equally long ones); None below ``min_rows`` or when
        no stored request starts the same way.

        The rows also leave the request at least one row of its own: a request that is all
        shared is stored with its last row inline (a record holds at least one row)."""
        if slots.size <= self.min_rows:
            return None
        best: tuple[str, int] | None = None
        for source_id, src_slots, src_gens in self._by_first.get((rollout_id, int(slots[0]), int(gens[0])), ()):
            n = min(src_slots.size, slots.size - 1)
            same = (src_slots[:n] == slots[:n]) & (src_gens[:n] == gens[:n])
            rows = n if same.all() else int(np.argmin(same))
            if rows >= self.min_rows and (best is None or rows > best[1]):
                best = (source_id, rows)
        return best
