"""A reader's rollout indexes: fetched from every source, merged, and kept.

Per source, a rollout's index is an entry point (how many parts it has, the newest snapshot)
and immutable parts, one per commit (:mod:`r3rdma.store.rollout_index`): a refresh reads the
entry point and fetches only the parts not seen before (or one snapshot instead of many), so a
reader polling a running rollout pays for what is new. Across sources the indexes are fetched
at once and merged (:class:`~r3rdma.read.merged_index.MergedIndex`); with several sources, one
that cannot be reached is skipped, and a request that only it could hold fails when it is
asked for. Which requests are committed, waiting until some are, and whether a read that
failed met a deletion are all answered here, from the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

from zarr.core.sync import sync

from r3rdma.errors import (
    AuthenticationError,
    R3TimeoutError,
    StoreError,
    TransportError,
    UnknownRequestError,
    UnknownRolloutError,
)
from r3rdma.ids import validate_id
from r3rdma.read.awaiting import all_or_first_error
from r3rdma.read.merged_index import MergedIndex
from r3rdma.read.sources import Source
from r3rdma.store.rollout_index import (
    GEOMETRY_KEYS,
    IndexPart,
    RolloutIndex,
    StalePartError,
    check_entry,
    check_part,
    check_snapshot,
    parse_attrs,
    part_name,
    snapshot_name,
)

__all__ = ["RolloutIndexes"]

_log = logging.getLogger("r3rdma.read.reader")  # the reader's log, as users filter it

# wait_listed polls the index after 10 ms, then backs off by 2x to one poll per 200 ms: a
# commit lands tens to hundreds of ms after the response that names it, and each poll of an
# unchanged index is one small GET per source.
_WAIT_FIRST_S, _WAIT_MAX_S = 0.01, 0.2
# The least time a poll gets, even at the deadline: a final look, bounded, at what was committed
# during the last pause (a hung node holds the wait at most this long past its timeout).
_WAIT_LAST_POLL_S = 1.0


class RolloutIndexes:
    """The rollouts' indexes on ``sources``, merged per rollout and kept for the reader's life.

    ``concurrency``: the reader's bound on GETs in flight; index parts, small and many (one
    per commit), are fetched 8 times as many at once."""

    def __init__(self, sources: list[Source], concurrency: int) -> None:
        self._sources = sources
        self._names = [source.name for source in sources]
        self._per_source = [_SourceIndexes(source, 8 * concurrency) for source in sources]
        self._merged: dict[str, MergedIndex] = {}
        #: Sources skipped by the last index fetch (name -> why).
        self.last_skipped: dict[str, str] = {}

    def get(self, rollout_id: str, *, refresh: bool = False, within_s: float | None = None) -> MergedIndex:
        """The rollout's merged index: the kept one, or with ``refresh`` each source's entry
        point and the parts it has not seen. ``within_s``: the fetch as a whole ends within
        this many seconds (else :class:`R3TimeoutError`), not only each wait on a node."""
        validate_id(rollout_id, "rollout_id")
        cached = self._merged.get(rollout_id)
        if cached is not None and not refresh:
            return cached
        with _gc_paused():
            return self._merge(rollout_id, cached, sync(self._fetch_all(rollout_id, within_s)))

    def require(self, rollout_id: str, request_ids: list[str]) -> MergedIndex:
        """The merged index, refreshed if some of ``request_ids`` are not in it; raises naming
        the missing ones (and why: pending, or on a node that could not be reached)."""
        merged = self.get(rollout_id)
        if any(rid not in merged.owner for rid in request_ids):
            merged = self.get(rollout_id, refresh=True)  # committed since we last looked?
        missing = [rid for rid in request_ids if rid not in merged.owner]
        if not missing:
            return merged
        shown = _shown(missing)
        if merged.skipped:
            raise TransportError(
                f"rollout {rollout_id!r}: requests {shown} are on none of the reachable store nodes; "
                f"{len(merged.skipped)} could not be reached and may hold them (retryable): " + _why(merged.skipped)
            )
        pending = [rid for rid in missing if rid in merged.pending]
        note = (
            f"; {', '.join(repr(p) for p in pending[:5])} pending: stored segments do not cover every row yet" if pending else ""
        )
        raise UnknownRequestError(
            f"rollout {rollout_id!r} has no committed request {shown} ({len(missing)} of the {len(request_ids)} "
            f"asked for are missing; {len(merged.owner)} requests committed){note}; nothing was read"
        )

    def wait_listed(self, rollout_id: str, request_ids: list[str], timeout_s: float) -> None:
        """Return once the index lists every one of ``request_ids`` (checked by the caller);
        past ``timeout_s``, :class:`R3TimeoutError` (``RoutingReader.wait_committed`` says how
        it polls, and what counts as "not yet")."""
        missing = request_ids
        deadline = time.monotonic() + timeout_s
        pause = _WAIT_FIRST_S
        merged: MergedIndex | None = None
        not_yet: Exception | None = None  # why the last poll saw no index (unknown rollout, node down)
        while missing:
            try:
                merged = self.get(rollout_id, refresh=True, within_s=max(deadline - time.monotonic(), _WAIT_LAST_POLL_S))
                not_yet = None
            except (UnknownRolloutError, TransportError, R3TimeoutError, StoreError) as e:
                not_yet = e  # not created yet, or a node restarting: look again
            if not_yet is None:
                assert merged is not None
                missing = [rid for rid in missing if rid not in merged.owner]
                if not missing:
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                raise R3TimeoutError(_not_committed(rollout_id, missing, len(request_ids), timeout_s, merged, not_yet))
            time.sleep(min(pause, left))
            pause = min(2 * pause, _WAIT_MAX_S)

    def raise_if_deleted(self, rollout_id: str, request_ids: list[str], cause: Exception) -> None:
        """Raise what a read's failure (``cause``) means when the rollout, or some of
        ``request_ids``, were deleted meanwhile (retention): an array the kept index lists is
        then gone, which is no damage. Returns when nothing was deleted."""
        try:
            merged = self.get(rollout_id, refresh=True)
        except UnknownRolloutError as e:
            raise UnknownRolloutError(f"rollout {rollout_id!r} was deleted while it was being read ({e})") from cause
        gone = [rid for rid in request_ids if rid not in merged.owner]
        if gone:
            raise UnknownRequestError(f"rollout {rollout_id!r}: requests {gone[:5]!r} were deleted while being read") from cause

    async def _fetch_all(self, rollout_id: str, within_s: float | None) -> list[Any]:
        """Every source's index of the rollout at once: per source the index, None (no such
        rollout there) or the exception its fetch raised."""
        work = asyncio.gather(*(s.fetch(rollout_id) for s in self._per_source), return_exceptions=True)
        if within_s is None:
            return await work
        try:
            return await asyncio.wait_for(work, within_s)
        except TimeoutError as e:
            raise R3TimeoutError(
                f"the index of rollout {rollout_id!r} was not fetched from {', '.join(self._names)} within {within_s:.2f} s"
            ) from e

    def _merge(self, rollout_id: str, cached: MergedIndex | None, loaded: list[Any]) -> MergedIndex:
        """The merged index of what the sources answered (``loaded``, one per source), kept;
        ``cached`` itself when nothing changed. Sources that could not be reached are skipped
        when others answered (several sources), and said why."""
        results: list[RolloutIndex | None] = []
        skipped: dict[str, str] = {}
        errors: list[BaseException] = []
        for source, result in zip(self._sources, loaded):
            if isinstance(result, (TransportError, R3TimeoutError, StoreError)):
                if isinstance(result, AuthenticationError) or len(self._sources) == 1:
                    raise result
                # Replicas elsewhere may cover it: skip this node, say so, decide per request.
                _log.warning("store source %s skipped for rollout %r: %s", source.name, rollout_id, result)
                skipped[source.name] = str(result)
                errors.append(result)
                results.append(None)
            elif isinstance(result, BaseException):
                raise result
            else:
                results.append(result)
        self.last_skipped = skipped
        if len(errors) == len(self._sources):
            raise errors[0]
        if cached is not None and not skipped and not cached.skipped and cached.same(results):
            return cached  # nothing new anywhere
        try:
            merged = MergedIndex.merge(rollout_id, self._names, results)
        except UnknownRolloutError:
            if skipped:  # the rollout may live on the nodes that did not answer
                raise TransportError(
                    f"rollout {rollout_id!r} is on none of the reachable store nodes; {len(skipped)} could not "
                    "be reached and may hold it (retryable): " + _why(skipped)
                ) from errors[0]
            raise
        merged.skipped = skipped
        self._merged[rollout_id] = merged
        return merged


class _SourceIndexes:
    """One source's rollout indexes, each kept with the parts fetched so far."""

    def __init__(self, source: Source, concurrency: int) -> None:
        self._source = source
        self._concurrency = concurrency
        self._kept: dict[str, RolloutIndex] = {}

    async def fetch(self, rollout_id: str) -> RolloutIndex | None:
        """The rollout's index here (None when this root has no such rollout), fetching only
        the parts not seen before; a rollout deleted and created again is read afresh."""
        for attempt in (0, 1):
            try:
                return await self._refresh(rollout_id)
            except StalePartError:
                self._kept.pop(rollout_id, None)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _refresh(self, rollout_id: str) -> RolloutIndex | None:
        source = self._source
        raw = await source.get(f"{rollout_id}/zarr.json", f"reading the index of rollout {rollout_id!r}")
        entry = check_entry(rollout_id, parse_attrs(raw, rollout_id, source.name), source.name)
        if entry is None:
            self._kept.pop(rollout_id, None)
            return None
        if entry.get("format_version", 1) == 1:
            return RolloutIndex.from_format_1(rollout_id, entry, source.name)
        cached = self._kept.get(rollout_id)
        if cached is not None and (cached.uid != entry["uid"] or cached.parts > entry["parts"]):
            # Deleted and created again: its arrays are new ones.
            self._kept.pop(rollout_id, None)
            source.forget(rollout_id)
            cached = None
        if cached is None:
            cached = RolloutIndex(uid=entry["uid"], geometry={k: entry[k] for k in GEOMETRY_KEYS})
        if cached.parts == entry["parts"]:
            return cached
        limit = asyncio.Semaphore(self._concurrency)
        snapshot = entry.get("snapshot", 0)
        if snapshot > cached.parts:
            # One snapshot instead of the parts up to it (rollout_index.py, "Snapshots").
            key = f"{rollout_id}/{snapshot_name(snapshot)}/zarr.json"
            raw = await source.get(key, f"reading index snapshot {snapshot} of rollout {rollout_id!r}")
            if raw is None:  # replaced by a newer one since the entry point was read
                raise StalePartError(rollout_id, source.name, snapshot)
            merged = check_snapshot(rollout_id, snapshot, cached.uid, parse_attrs(raw, rollout_id, source.name), source.name)
            index = RolloutIndex.from_snapshot(merged, cached.geometry)
        else:
            # A copy gets the new parts: a read on another thread may be using the kept one.
            index = cached.copy()

        async def fetch(seq: int) -> IndexPart:
            async with limit:
                raw = await source.get(
                    f"{rollout_id}/{part_name(seq)}/zarr.json", f"reading index part {seq} of rollout {rollout_id!r}"
                )
            if raw is None:
                # Parts are written before the entry point counts them; only a deletion (and
                # perhaps a new rollout of the same id) removes one.
                raise StalePartError(rollout_id, source.name, seq)
            return check_part(rollout_id, seq, index.uid, parse_attrs(raw, rollout_id, source.name), source.name)

        parts = await all_or_first_error(fetch(seq) for seq in range(index.parts + 1, entry["parts"] + 1))
        for part in parts:
            index.apply(part)
        self._kept[rollout_id] = index
        return index


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic GC off while an index loads. Why: a load makes ~100k small objects
    (request entries, their segments) that all survive; the collections their allocation
    triggers walk them again and again: on the CPU VM a 16k-request index opened in 2x the
    time with the GC on. Concurrent pauses are safe: whoever found it on turns it back on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _shown(ids: list[str]) -> str:
    """The first few of ``ids``, and how many more, as messages name them."""
    return ", ".join(repr(m) for m in ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")


def _why(skipped: dict[str, str]) -> str:
    """Sources skipped and why, as messages list them."""
    return "; ".join(f"{name}: {why}" for name, why in skipped.items())


def _not_committed(
    rollout_id: str, missing: list[str], total: int, timeout_s: float, merged: MergedIndex | None, not_yet: Exception | None
) -> str:
    """What :meth:`RolloutIndexes.wait_listed` says when its time is up."""
    text = (
        f"rollout {rollout_id!r}: {len(missing)} of the {total} requests waited for are not committed after "
        f"{timeout_s} s ({_shown(missing)})"
    )
    if isinstance(not_yet, UnknownRolloutError):
        text += f"; the rollout does not exist yet ({not_yet})"
    elif not_yet is not None:
        text += f"; the last poll of the index failed (retryable): {not_yet}"
    elif merged is not None:
        text += f"; the rollout has {len(merged.owner)} committed request{'' if len(merged.owner) == 1 else 's'}"
        pending = [rid for rid in missing if rid in merged.pending]
        if pending:
            text += f", {', '.join(repr(p) for p in pending[:5])} pending (stored segments do not cover every row yet)"
        if merged.skipped:
            text += f"; {len(merged.skipped)} store nodes could not be reached and may hold the rest: " + _why(merged.skipped)
    return text
