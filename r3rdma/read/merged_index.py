"""One rollout's index as a reader sees it: every source's index of it, merged.

A rollout's requests are spread over store nodes, each batch on ``replicas`` of them, and a
request may also sit on a node it was re-pushed to after a failover. The merged index says
which requests are committed anywhere, the first source holding each (``owner``), and where
its other copies are (:meth:`MergedIndex.holders`), found per read from the per-source indexes
it keeps; once a read has compared a request's copies (:mod:`r3rdma.read.replicas`), which
copy its reads take (``read_from``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from r3rdma.errors import CorruptDataError, UnknownRolloutError
from r3rdma.store.index_entries import RequestEntry
from r3rdma.store.rollout_index import ColumnRequests, RolloutIndex

__all__ = ["MergedIndex"]


@dataclass
class MergedIndex:
    """The sources' indexes of one rollout, merged: which sources hold each request.

    Why ``owner`` maps ids to source numbers alone (entries stay in the per-source indexes, and
    every replica's holders are found when a read needs them): at 16k requests on 4 nodes with
    2 replicas, building ``(source, entry)`` tuples and holder lists for every request was ~20%
    of a fresh reader's index open, and the ~80k objects it made were walked again by the
    cyclic GC; a dict of ints is neither."""

    geometry: dict[str, Any]
    owner: dict[str, int]  # request id -> first source (in source order) holding it
    pending: set[str]
    per_source: dict[int, RolloutIndex]
    skipped: dict[str, str] = field(default_factory=dict)  # sources that could not be reached -> why
    owned: dict[int, list[str]] = field(default_factory=dict)  # source -> the ids it owns (merge's order)
    # Request -> the source its reads take, once its copies are compared
    # (r3rdma.read.replicas.choose_copies: the copy holding the most rows); else its owner.
    read_from: dict[str, int] = field(default_factory=dict)

    def source_of(self, rid: str) -> int:
        """The source the request is read from: the copy chosen for reads, else its owner."""
        return self.read_from.get(rid, self.owner[rid])

    def entry(self, rid: str) -> RequestEntry:
        """The request's index entry in the copy it is read from (:meth:`source_of`)."""
        return self.per_source[self.read_from.get(rid, self.owner[rid])].requests[rid]

    def total_rows(self) -> int:
        """Rows of every visible request (each counted once, on its owner).

        Per owning source, from its columns (:meth:`ColumnRequests.rows_of`): a Python call per
        request was ~18 ms of a fresh reader's ``info()`` at 16k requests (CPU VM, ~40%)."""
        total = 0
        for i, rids in self.owned.items():
            requests = self.per_source[i].requests
            if isinstance(requests, ColumnRequests):
                total += requests.rows_of(rids)
            else:
                total += sum(requests[rid].rows for rid in rids)
        return total

    def holders(self, rid: str) -> list[tuple[int, RequestEntry]]:
        """``(source, entry)`` of every copy of the request, in source order (its owner first)."""
        return [(i, index.requests[rid]) for i, index in self.per_source.items() if rid in index.requests]

    def same(self, indexes: list[RolloutIndex | None]) -> bool:
        """Whether ``indexes`` (one per source) are the ones this was merged from."""
        return {i: x for i, x in enumerate(indexes) if x is not None}.keys() == self.per_source.keys() and all(
            self.per_source[i] is x for i, x in enumerate(indexes) if x is not None
        )

    @classmethod
    def merge(cls, rollout_id: str, source_names: list[str], indexes: list[RolloutIndex | None]) -> MergedIndex:
        """The merged index of ``indexes`` (one per source, None where the source has no such
        rollout or was skipped); :class:`UnknownRolloutError` when no source has it, and
        :class:`CorruptDataError` when two sources store it with other geometries."""
        present = {i: index for i, index in enumerate(indexes) if index is not None}
        if not present:
            where = source_names[0] if len(source_names) == 1 else f"any of {len(source_names)} sources"
            raise UnknownRolloutError(f"rollout {rollout_id!r} not found in {where}")
        geometry: dict[str, Any] | None = None
        owner: dict[str, int] = {}
        owned: dict[int, list[str]] = {}
        pending: set[str] = set()
        for i, index in present.items():
            if not index.requests and not index.geometry:
                continue
            if geometry is None:
                geometry, first = index.geometry, i
            elif index.geometry != geometry:
                raise CorruptDataError(
                    f"rollout {rollout_id!r}: {source_names[first]} stores {geometry}, {source_names[i]} stores {index.geometry}"
                )
            # New ids in bulk (C-level loops), in the source's commit order. Replicas are
            # compared when they are read (r3rdma.read.replicas): comparing every replica here
            # was ~40% of a fresh reader's index open at 16k requests on 4 nodes, 2 replicas.
            if owner:
                owned[i] = [rid for rid in index.requests if rid not in owner]
                owner.update(dict.fromkeys(owned[i], i))
            else:
                owner = dict.fromkeys(index.requests, i)
                owned[i] = list(owner)
            pending.update(index.pending)
        if geometry is None:  # no source lists a request yet
            geometry = {"num_layers": 0, "top_k": 0, "num_experts": 0, "dtype": "uint8", "layer_map": []}
        return cls(geometry, owner, pending - owner.keys(), present, owned=owned)
