"""Requests' rows fetched into the caller's arrays: every array's GETs planned first, made at once,
checked and decoded by worker threads, a failed source's requests read again from another copy.

A read is shaped like training: a data-parallel rank asks for its own samples, which finished
at random times and so sit in nearly every batch array a rollout committed. So a read plans
every array's inner chunks and GETs first (each request's segments, or the rows and layers of
a rank's slice), makes the GETs concurrently on one event loop (zarr's), and has worker threads
check and decode each chunk straight into the arrays it returns, then verify each segment's
CRC-32C there. Where the CPU went before that design, and what it cost: issue #34.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from r3rdma.errors import AuthenticationError, CorruptDataError, R3TimeoutError, StoreError, TransportError
from r3rdma.read.indexes import RolloutIndexes
from r3rdma.read.jobs import JobBatch
from r3rdma.read.merged_index import MergedIndex
from r3rdma.read.replicas import RowsOfCopy, choose_copies
from r3rdma.read.rows import Spans, rows_wanted, select_segments
from r3rdma.read.shard_ranges import ArrayRead, Piece, fetch_run
from r3rdma.read.sources import Source
from r3rdma.records import checksum
from r3rdma.store.index_entries import RequestEntry, Segment
from r3rdma.store.rollout_index import RolloutIndex

__all__ = ["RowFetcher"]

_log = logging.getLogger("r3rdma.read.reader")  # the reader's log, as users filter it

_PROGRESS_MIN_ARRAYS = 16  # reads touching fewer arrays finish too fast for a progress bar

# Per (source, array): the segments wanted of it, each with its request and where its rows go.
_Wanted = dict[tuple[int, str], list[tuple[str, Segment, np.ndarray]]]


class RowFetcher:
    """Reads requests' rows from ``sources`` (see the module docstring).

    ``concurrency``: GETs in flight at once; ``verify``: each segment read whole is checked
    against its CRC-32C in the index; ``progress``: a tqdm bar on reads of many arrays (None:
    only when stderr is a TTY). ``indexes`` says whether a read that found data missing met a
    deletion."""

    def __init__(
        self, sources: list[Source], indexes: RolloutIndexes, *, verify: bool, concurrency: int, progress: bool | None
    ) -> None:
        self._sources = sources
        self._names = [source.name for source in sources]
        self._indexes = indexes
        self._verify = verify
        self._concurrency = concurrency
        self._progress = progress
        #: Reads that failed on one source and were retried on another (a counter).
        self.failovers = 0

    def choose_copies(self, rollout_id: str, merged: MergedIndex, request_ids: list[str]) -> None:
        """Compare the copies of each request on several sources, and choose the one its reads
        take (:func:`~r3rdma.read.replicas.choose_copies`; done once per merged index): before
        a caller looks at a request's entry (``merged.entry``), which is that copy's. Rows the
        index cannot decide on are read; :class:`CorruptDataError` when copies disagree."""
        choose_copies(merged, rollout_id, self._names, request_ids, lambda asks: self._read_copies(rollout_id, merged, asks))

    def read_arrays(
        self,
        rollout_id: str,
        merged: MergedIndex,
        request_ids: list[str],
        positions: np.ndarray | None = None,
        spans: Spans | None = None,
    ) -> dict[str, np.ndarray]:
        """Each request's rows (all of them, or its ``spans``), in an array of its own
        (``[rows, L, K]``, L: the layers of ``positions``); see :meth:`read`."""
        geometry = merged.geometry
        width = geometry["num_layers"] if positions is None else len(positions)
        lengths = rows_wanted([merged.entry(rid) for rid in request_ids], request_ids, spans)
        outs = {rid: np.empty((n, width, geometry["top_k"]), dtype=geometry["dtype"]) for rid, n in zip(request_ids, lengths)}
        self.read(rollout_id, merged, request_ids, outs, positions, spans)
        return outs

    def read(
        self,
        rollout_id: str,
        merged: MergedIndex,
        request_ids: list[str],
        outs: dict[str, np.ndarray],
        positions: np.ndarray | None = None,
        spans: Spans | None = None,
    ) -> None:
        """Each request's rows into ``outs[request id]`` (sized by
        :func:`~r3rdma.read.rows.rows_wanted`), its segments in row order, read from the copy
        chosen for reads (:meth:`choose_copies`) or, once that source failed in this call, the
        next copy holding all of its rows; ``positions``: the MoE layer positions wanted (None:
        all); ``spans``: the rows wanted of some requests (checked by ``check_rows``). A source
        whose read fails (unreachable, timed out, failed I/O) is dropped and its requests are
        read again from their other copies, into the same arrays."""
        self.choose_copies(rollout_id, merged, request_ids)
        bar = self._progress_bar(rollout_id, merged, request_ids)
        try:
            sync(self._read_async(rollout_id, merged, request_ids, outs, positions, spans, bar))
        except CorruptDataError as e:
            # An array the (kept) index lists is gone or unreadable: if the rollout or these
            # requests were deleted meanwhile (retention), say so instead of "corrupt".
            self._indexes.raise_if_deleted(rollout_id, request_ids, e)
            raise
        finally:
            if bar is not None:
                bar.close()

    def read_later(
        self,
        rollout_id: str,
        merged: MergedIndex,
        request_ids: list[str],
        outs: dict[str, np.ndarray],
        positions: np.ndarray | None = None,
        spans: Spans | None = None,
    ) -> Coroutine[Any, Any, None]:
        """:meth:`read` as a coroutine for the caller to run on the reader's event loop (a
        prefetch's load, started ahead of its turn): the copies are compared now, and a
        :class:`CorruptDataError` it raises is the caller's to explain
        (:meth:`RolloutIndexes.raise_if_deleted`)."""
        self.choose_copies(rollout_id, merged, request_ids)
        return self._read_async(rollout_id, merged, request_ids, outs, positions, spans)

    async def _read_async(
        self,
        rollout_id: str,
        merged: MergedIndex,
        request_ids: list[str],
        outs: dict[str, np.ndarray],
        positions: np.ndarray | None = None,
        spans: Spans | None = None,
        bar: tqdm | None = None,
    ) -> None:
        """:meth:`read` on the reader's event loop, once the copies are compared."""
        failed: dict[int, Exception] = {}
        todo = request_ids
        whole = positions is None and not spans  # a segment's CRC-32C covers all its rows and layers
        while todo:
            chosen, wanted = self._choose(rollout_id, merged, todo, outs, spans, failed)
            if bar is not None:
                bar.total = (bar.total or 0) + len(wanted)
            results = await self._fetch(rollout_id, merged, wanted, bar, positions, whole)
            first_error: Exception | None = None
            for (src, _name), result in zip(wanted, results):
                if result is None:
                    continue
                if isinstance(result, (TransportError, R3TimeoutError, StoreError)) and not (
                    isinstance(result, AuthenticationError) or len(self._sources) == 1
                ):
                    if src not in failed:
                        _log.warning(
                            "reading rollout %r from %s failed, trying other replicas: %s", rollout_id, self._names[src], result
                        )
                        self.failovers += 1
                    failed.setdefault(src, result)
                elif isinstance(result, Exception):
                    first_error = first_error or result
                else:
                    raise result
            if first_error is not None:
                raise first_error
            # Requests on a source that failed: read them whole from another replica.
            todo = [rid for rid in todo if chosen[rid] in failed]

    def _choose(
        self,
        rollout_id: str,
        merged: MergedIndex,
        request_ids: list[str],
        outs: dict[str, np.ndarray],
        spans: Spans | None,
        failed: dict[int, Exception],
    ) -> tuple[dict[str, int], _Wanted]:
        """Per request the source it is read from (the copy chosen for reads, else the next
        copy holding all of its rows, that has not ``failed``), and per array of a source the
        segments wanted of it, each with where its rows land in the request's array; when
        every such copy failed, the failure."""
        chosen: dict[str, int] = {}  # request -> the source it is read from
        wanted: _Wanted = {}
        for rid in request_ids:
            holders, read_src = merged.holders(rid), merged.source_of(rid)
            read = holders[0][1] if holders[0][0] == read_src else next(e for s, e in holders if s == read_src)
            # The copy chosen for reads, then (to fail over to) the others holding all of its rows.
            copies = [(read_src, read)] + [
                (src, entry)
                for src, entry in holders
                if src != read_src and entry.start_row <= read.start_row and entry.end_row >= read.end_row
            ]
            alive = [copy for copy in copies if copy[0] not in failed]
            if not alive:
                cause = failed[copies[0][0]]
                if len(copies) == 1 and not merged.skipped:
                    raise cause  # no replica anywhere: its own error, as with one source
                raise TransportError(
                    f"request {rid!r} of rollout {rollout_id!r}: every store node holding it failed the read "
                    "(retryable): "
                    + "; ".join(f"{self._names[src]}: {failed[src]}" for src, _ in copies)
                    + "".join(f"; {n} (could not be reached for the index): {w}" for n, w in merged.skipped.items())
                ) from cause
            src, entry = alive[0]
            chosen[rid] = src
            row = 0
            out = outs[rid]
            for seg in _segments(entry, read, None if spans is None else spans.get(rid)):
                # each segment's rows land in their place in the request's array
                wanted.setdefault((src, seg.array), []).append((rid, seg, out[row : row + seg.rows]))
                row += seg.rows
            if row != len(out):
                raise CorruptDataError(
                    f"request {rid!r} of rollout {rollout_id!r} on {self._names[src]}: its segments hold "
                    f"{row} of the {len(out)} rows its index entry asks for"
                )
        return chosen, wanted

    def _read_copies(self, rollout_id: str, merged: MergedIndex, asks: Sequence[RowsOfCopy]) -> list[np.ndarray]:
        """The rows each of ``asks`` names, read from that copy (to compare copies the index
        cannot decide on); a failure is raised (no failover: the copy itself is asked for)."""
        geometry = merged.geometry
        wanted: _Wanted = {}
        outs = []
        for rid, src, lo, hi in asks:
            entry = merged.per_source[src].requests[rid]
            out = np.empty((hi - lo, geometry["num_layers"], geometry["top_k"]), dtype=geometry["dtype"])
            row = 0
            for seg in select_segments(entry, [(lo - entry.start_row, hi - entry.start_row)]):
                wanted.setdefault((src, seg.array), []).append((rid, seg, out[row : row + seg.rows]))
                row += seg.rows
            outs.append(out)
        # Pieces of segments: their chunks' own CRC-32Cs are checked, not the segments'.
        results = sync(self._fetch(rollout_id, merged, wanted, None, None, whole=False))
        for error in results:
            if error is not None:
                raise error
        return outs

    def _progress_bar(self, rollout_id: str, merged: MergedIndex, request_ids: list[str]) -> tqdm | None:
        """A progress bar over the arrays a read touches, when shown (a bar not shown is not
        made: a trainer's every micro-batch read would pay for one)."""
        show = self._progress if self._progress is not None else sys.stderr.isatty()
        if not show:
            return None
        arrays = {(merged.source_of(rid), seg.array) for rid in request_ids for seg in merged.entry(rid).segments}
        if len(arrays) < _PROGRESS_MIN_ARRAYS:
            return None
        return tqdm(desc=f"read {rollout_id}", unit="array", file=sys.stderr)

    async def _fetch(
        self,
        rollout_id: str,
        merged: MergedIndex,
        wanted: _Wanted,
        bar: tqdm | None,
        positions: np.ndarray | None = None,
        whole: bool = True,
    ) -> list[BaseException | None]:
        """Read every array's wanted segments at once, each into its place; per array None, or
        the exception its read raised.

        Every array's GETs are planned first and made by at most ``concurrency`` coroutines
        in all; chunks are decoded by the workers of one :class:`JobBatch`, which tells this
        read once that all are done. Why not a task and a batch per array: a trainer rank's
        slice is about one GET per array, and per-array tasks, batches and wake-ups cost as
        much CPU as the GET (#34)."""
        keys = list(wanted)
        results: list[BaseException | None] = [None] * len(keys)
        failures = await self._prepare(rollout_id, merged, keys)

        planned: list[tuple[int, ArrayRead]] = []
        others: list[Coroutine[Any, Any, None]] = []  # arrays not in r3rdma's layout, read through zarr
        other_keys: list[int] = []
        for i, (src, name) in enumerate(keys):
            if (src, name) in failures:
                results[i] = failures[(src, name)]
                continue
            source, index = self._sources[src], merged.per_source[src]
            segs = wanted[(src, name)]
            segs.sort(key=lambda s: s[1].offset)
            pieces = [(seg.offset, seg.offset + seg.rows, out) for _, seg, out in segs]
            # Most of the array: all of it, in one ranged read. Not for a slice (some layers or
            # rows): a trainer rank's slice is its share of every array, and the rows between
            # its pieces are other ranks' (fetching them cost a DP=2 rank 2x).
            span = whole and 2 * sum(seg.rows for _, seg, _ in segs) >= source.rows_of(rollout_id, index, name)
            try:
                read = await source.plan(rollout_id, index, name, pieces, positions, exact=not whole, span=span)
            except Exception as e:
                results[i] = source.read_failure(rollout_id, name, e)
                continue
            if read is None:
                others.append(_read_other(results, i, source, rollout_id, index, name, pieces, positions, span))
                other_keys.append(i)
            else:
                planned.append((i, read))

        await self._get(planned, others)
        for i, read in planned:
            if read.error is not None:
                src, name = keys[i]
                error = read.error
                results[i] = self._sources[src].read_failure(rollout_id, name, error) if isinstance(error, Exception) else error
        if self._verify and whole:
            # A segment's CRC-32C covers every layer and row: a read of some layers or rows
            # relies on the chunks' own CRC-32C, checked as they are decoded.
            checks = JobBatch()
            for i in [i for i, _ in planned] + other_keys:
                if results[i] is None:
                    src, name = keys[i]
                    checks.put(_verify_segments, results, i, rollout_id, self._names[src], name, wanted[keys[i]])
            await checks.wait()
        if bar is not None:
            bar.update(len(keys))
        return results

    async def _prepare(
        self, rollout_id: str, merged: MergedIndex, keys: list[tuple[int, str]]
    ) -> dict[tuple[int, str], BaseException]:
        """Metadata and shard indexes of the arrays not read before, all at once (small GETs,
        many in flight), so no array's data GET waits behind its own index GET; per array that
        failed, its failure. Only arrays not read before need it (a task each costs more than
        the check)."""
        opening = asyncio.Semaphore(8 * self._concurrency)

        async def prepare(src: int, name: str) -> None:
            async with opening:
                await self._sources[src].prepare(rollout_id, merged.per_source[src], name)

        unprepared = [k for k in keys if not self._sources[k[0]].prepared(rollout_id, merged.per_source[k[0]], k[1])]
        if not unprepared:
            return {}
        prepared = await asyncio.gather(*(prepare(src, name) for src, name in unprepared), return_exceptions=True)
        return {key: e for key, e in zip(unprepared, prepared) if isinstance(e, BaseException)}

    async def _get(self, planned: list[tuple[int, ArrayRead]], others: list[Coroutine[Any, Any, None]]) -> None:
        """Make the planned arrays' GETs, at most ``concurrency`` at once, and the reads of
        ``others``; return once every chunk is decoded into its place. On a failure (or
        cancellation) of the wait itself, no job in flight writes into the outputs after."""
        batch = JobBatch()
        prototype = default_buffer_prototype()
        runs = [(read, run) for _, read in planned for run in read.runs]
        queue = iter(runs)

        async def getter() -> None:
            for read, run in queue:  # the iterator is shared: each run is fetched by one getter
                await fetch_run(read, run, batch, prototype)

        try:
            await asyncio.gather(*(getter() for _ in range(min(self._concurrency, len(runs)))), *others)
        except BaseException:
            await batch.wait(stop=True)  # no job in flight writes into the outputs once this returns
            raise
        await batch.wait()


async def _read_other(
    results: list[BaseException | None],
    i: int,
    source: Source,
    rollout_id: str,
    index: RolloutIndex,
    name: str,
    pieces: list[Piece],
    positions: np.ndarray | None,
    span: bool,
) -> None:
    """:meth:`Source.read_other`, its failure put in ``results[i]``."""
    try:
        await source.read_other(rollout_id, index, name, pieces, positions, span)
    except Exception as e:
        results[i] = e


def _verify_segments(
    results: list[BaseException | None],
    i: int,
    rollout_id: str,
    node: str,
    name: str,
    segs: list[tuple[str, Segment, np.ndarray]],
) -> None:
    """Each segment's rows as read against its CRC-32C in the index (a decode worker's job);
    the first mismatch becomes ``results[i]``."""
    for rid, seg, out in segs:
        got = checksum(out)
        if got != seg.crc32c:
            results[i] = CorruptDataError(
                f"request {rid!r} of rollout {rollout_id!r} on {node}, array {name} rows "
                f"{seg.offset}..{seg.offset + seg.rows - 1}: crc32c {got:#010x}, index says {seg.crc32c:#010x}"
            )
            return


def _segments(entry: RequestEntry, read: RequestEntry, spans: list[tuple[int, int]] | None) -> tuple[Segment, ...]:
    """The segments of a copy (``entry``) holding the rows a read takes: those of the copy it
    is read from (``read``; ``entry`` may hold more), or of its ``spans`` (rows counted from
    ``read``'s first)."""
    if (entry.start_row, entry.rows) == (read.start_row, read.rows):
        return entry.segments if spans is None else select_segments(entry, spans)
    base = read.start_row - entry.start_row
    return select_segments(entry, [(lo + base, hi + base) for lo, hi in ([(0, read.rows)] if spans is None else spans)])
