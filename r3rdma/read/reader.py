"""Trainer-side reads of committed routing, from local roots and store nodes over HTTP.

Reads are shaped like training: a data-parallel rank asks for its own samples, which finished
at random times and so sit in nearly every batch array a rollout committed. A read plans every
array's inner chunks and GETs first (each request's segments, or the rows and layers of a
rank's slice), makes the GETs concurrently on one event loop (zarr's; store nodes through
:mod:`r3rdma.read.node_http`), and has worker threads check and decode each chunk straight into
the arrays it returns (the packed buffer of :meth:`RoutingReader.get_packed`, or one array per
request), then verify each segment's CRC-32C there. Where the CPU went before that design, and
what it cost: issue #34. Index parts and array metadata are immutable: they are fetched once
per reader and kept.

Errors say what happened, so a trainer can tell "retry" from "the data is damaged":
:class:`TransportError` (connection refused, reset or dropped mid-body) and
:class:`R3TimeoutError` are worth a retry; :class:`AuthenticationError` (the node refused the
token) and :class:`StoreError` (the node or the local disk failed the read: HTTP 5xx, I/O
error) are not the data's fault; :class:`CorruptDataError` means bytes that arrived whole fail
their checksum or the format; :class:`UnknownRolloutError` / :class:`UnknownRequestError`: not
committed (or deleted; right after the engine's response that names them, not committed yet:
:meth:`RoutingReader.wait_committed` waits until they are). Bad id lists (unknown or repeated
ids) fail before anything is read; so does a request whose stored row count is not the one
the caller expects (``expected_rows``: :class:`RowCountMismatchError`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import os
import sys
import time
from collections.abc import Coroutine, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from r3rdma.errors import (
    AuthenticationError,
    ConfigError,
    CorruptDataError,
    InvalidIdError,
    MissingRowsError,
    R3TimeoutError,
    RowCountMismatchError,
    StoreError,
    TransportError,
    UnknownRequestError,
    UnknownRolloutError,
)
from r3rdma.ids import validate_id
from r3rdma.read.checksums import crc32c_concat
from r3rdma.read.jobs import JobBatch
from r3rdma.read.layers import layer_list, layer_selection
from r3rdma.read.packed import PackedRouting, cu_seqlens_of, pack, packed_routing, to_torch
from r3rdma.read.rows import Spans, check_named, check_rows, row_spans, select_segments
from r3rdma.read.shard_ranges import ArrayRead, Piece, fetch_run
from r3rdma.read.sources import Source, source_items
from r3rdma.records import checksum
from r3rdma.store.index_entries import RequestEntry, Segment
from r3rdma.store.rollout_index import ColumnRequests, RolloutIndex

if TYPE_CHECKING:
    from r3rdma.read.collector import ShareCollector

__all__ = ["RoutingReader", "PackedRouting", "RolloutInfo", "Prefetcher", "to_torch", "pack"]

_log = logging.getLogger(__name__)

_PROGRESS_MIN_ARRAYS = 16  # reads touching fewer arrays finish too fast for a progress bar
# wait_committed polls the index after 10 ms, then backs off by 2x to one poll per 200 ms: a
# commit lands tens to hundreds of ms after the response that names it, and each poll of an
# unchanged index is one small GET per source.
_WAIT_FIRST_S, _WAIT_MAX_S = 0.01, 0.2
# The least time a poll gets, even at the deadline: a final look, bounded, at what was committed
# during the last pause (a hung node holds the wait at most this long past its timeout).
_WAIT_LAST_POLL_S = 1.0


@dataclass(frozen=True, slots=True)
class RolloutInfo:
    """Geometry and contents of one rollout."""

    rollout_id: str
    num_layers: int
    top_k: int
    num_experts: int
    dtype: str
    layer_map: tuple[int, ...]
    request_ids: tuple[str, ...]
    total_rows: int


class RoutingReader:
    """Reads committed requests from one or more store roots.

    ``sources`` is one source or a list: a local directory, an ``http(s)://host:port`` URL
    of a store node (its ``/zarr/`` tree is read with zarr's fsspec store; ``token`` is sent
    as a bearer header), or any zarr ``StoreLike``; a string of comma-separated URLs (as
    ``$R3_STORE_HTTP_URLS`` holds them) is several. A source that cannot be one (a malformed
    URL, ``host:port`` without ``http://``, a directory that does not exist) raises
    :class:`ConfigError` naming it. With several sources (the store nodes a
    rollout's requests were spread over) their indexes are merged; a request found on several
    nodes (replicas, or re-pushed after a failover) must have the same checksum on each
    (checked when it is read: else :class:`CorruptDataError` naming both) and is read from any
    of them. ``max_workers``
    bounds the GETs a read has in flight at once (r3rdma's HTTP client also keeps at most 8
    connections to a node per reader). Each returned
    segment is verified against the CRC-32C in the index unless ``verify=False``. ``timeout_s``
    bounds every wait on a store node (connect, each read of the answer): past it,
    :class:`R3TimeoutError`.

    Several sources: a source that cannot be reached (:class:`TransportError`,
    :class:`R3TimeoutError`, :class:`StoreError`; never a refused token) when the index is
    fetched is skipped with a warning and listed in :attr:`last_skipped_nodes`; a request
    that only skipped nodes could hold raises :class:`TransportError` naming them. A read that
    fails on one source is retried on another source holding the request.
    """

    def __init__(
        self,
        sources: str | os.PathLike[str] | Any | Sequence[Any],
        *,
        token: str | None = None,
        verify: bool = True,
        max_workers: int = 32,
        progress: bool | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        """``progress``: show a tqdm bar on reads of many ranges (None: only when stderr is a TTY)."""
        items = source_items(sources)
        if not items:
            raise ConfigError(f"RoutingReader needs at least one source, got {sources!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ConfigError(f"max_workers must be an int >= 1, got {max_workers!r}")
        self._sources = [Source.of(item, token, float(timeout_s)) for item in items]
        #: The sources' names, in order (URLs without a trailing slash, paths), as messages
        #: and :attr:`last_skipped_nodes` name them.
        self.source_names: tuple[str, ...] = tuple(source.name for source in self._sources)
        self._verify = verify
        self._concurrency = max_workers
        self._merged: dict[str, _MergedIndex] = {}
        self._progress = progress
        #: Sources skipped by the last index fetch (name -> why): unreachable nodes whose
        #: replicas were not needed, or whose absence made a read fail with TransportError.
        self.last_skipped_nodes: dict[str, str] = {}
        #: Reads that failed on one source and were retried on another (a counter).
        self.read_failovers = 0

    def close(self) -> None:
        """Close the connections to store nodes that this reader opened and kept alive (of
        sources given as URLs; a store object passed in is the caller's)."""
        for source in self._sources:
            source.close()

    def __enter__(self) -> RoutingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def info(self, rollout_id: str) -> RolloutInfo:
        """The rollout's geometry and committed requests, from a fresh index (:class:`RolloutInfo`)."""
        merged = self._index(rollout_id, refresh=True)
        geometry = merged.geometry
        return RolloutInfo(
            rollout_id=rollout_id,
            num_layers=geometry["num_layers"],
            top_k=geometry["top_k"],
            num_experts=geometry["num_experts"],
            dtype=geometry["dtype"],
            layer_map=tuple(geometry["layer_map"]),
            request_ids=tuple(merged.owner),
            total_rows=merged.total_rows(),
        )

    def stored_bytes(self, rollout_id: str) -> dict[str, int]:
        """Bytes each source stores for the rollout (index and arrays), keyed by source name."""
        merged = self._index(rollout_id, refresh=True)
        if merged.skipped:
            raise TransportError(
                f"rollout {rollout_id!r}: cannot size every source, {len(merged.skipped)} could not be reached: "
                + "; ".join(f"{n}: {w}" for n, w in merged.skipped.items())
            )
        out = {}
        for i, source in enumerate(self._sources):
            index = merged.per_source.get(i)
            out[source.name] = 0 if index is None else sync(source.stored_bytes(rollout_id, index))
        return out

    def get_numpy(
        self,
        rollout_id: str,
        request_ids: Iterable[str],
        *,
        layers: Iterable[int] | None = None,
        rows: Mapping[str, Iterable[Any]] | None = None,
        expected_rows: Mapping[str, int] | None = None,
    ) -> dict[str, np.ndarray]:
        """Per-request routing ``[rows, L, K]`` in the stored dtype, keyed by request id.

        ``layers``: the MoE layers wanted, as decoder layer ids (the rollout's ``layer_map``
        values; a sequence or a range), in the order wanted; the arrays then hold those
        layers alone (``[rows, len(layers), K]``) and only the inner chunks that hold them are
        fetched (format 3 stores; older ones are read whole and sliced). A layer the rollout
        does not have raises :class:`ShapeMismatchError` naming it. Such a read checks each
        chunk's CRC-32C, not the request's (which covers every layer). Default: every layer.

        ``rows``: some rows of some requests, ``{request id: [(lo, hi), ...]}`` (row 0: the
        request's first stored row; a ``range`` is one span), concatenated in the order given
        (a context-parallel rank's chunks: ``r3rdma.integrations.megatron.cp_row_spans``);
        only the row chunks holding them are fetched, each checked by its chunk CRC-32C.
        Requests not named are read whole. A span past a request's end raises
        :class:`ShapeMismatchError` naming it, before anything is read.

        ``expected_rows``: ``{request id: rows}``, the rows each named request must store, all
        of them (row 0 through its end, whatever ``rows`` and ``layers`` select): a sample's
        token count - 1 (prompt + generated - 1; the last sampled token is never a forward
        input). A request storing another count raises :class:`RowCountMismatchError` naming
        it, both counts and the likely cause (another request's routing under this id, or a
        failed commit); one stored from a later row on (only later turns), so that rows
        ``0..`` of the expected ones have none, raises :class:`MissingRowsError`. Checked from
        the index, before anything is read. A key not among ``request_ids``, or a count that is
        not an int >= 0: :class:`ConfigError` (a ``ValueError``). Requests not named are not
        checked; None (default): no check.
        """
        request_ids = _check_ids(request_ids)
        expected = _expected_rows(expected_rows, request_ids)
        merged = self._require(rollout_id, request_ids)
        _check_expected_rows(rollout_id, expected, merged)
        positions, _ = layer_selection(rollout_id, merged.geometry, layers)
        spans = row_spans(rows)
        check_rows(rollout_id, spans, request_ids, merged.entry)
        return self._read_arrays(rollout_id, merged, request_ids, positions, spans)

    def get(
        self,
        rollout_id: str,
        request_ids: Iterable[str],
        *,
        layers: Iterable[int] | None = None,
        rows: Mapping[str, Iterable[Any]] | None = None,
        expected_rows: Mapping[str, int] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-request routing tensors ``[rows, L, K]`` (uint8, or int32 for wider ids);
        ``layers``, ``rows`` and ``expected_rows`` as in :meth:`get_numpy`."""
        arrays = self.get_numpy(rollout_id, request_ids, layers=layers, rows=rows, expected_rows=expected_rows)
        return {rid: to_torch(a) for rid, a in arrays.items()}

    def get_packed(
        self,
        rollout_id: str,
        request_ids: Iterable[str],
        *,
        layers: Iterable[int] | None = None,
        rows: Mapping[str, Iterable[Any]] | None = None,
        expected_rows: Mapping[str, int] | None = None,
    ) -> PackedRouting:
        """Requests concatenated along tokens in the given order, with ``cu_seqlens``;
        ``layers`` as in :meth:`get_numpy` (the result's ``layer_map`` lists the layers read).
        ``rows`` as in :meth:`get_numpy`: ``cu_seqlens`` then counts the rows read of each
        request (``start_rows`` stay the requests' first stored rows). ``expected_rows`` as in
        :meth:`get_numpy` (each request's whole stored count, checked before anything is read)."""
        request_ids = _check_ids(request_ids)
        expected = _expected_rows(expected_rows, request_ids)
        merged = self._require(rollout_id, request_ids)
        _check_expected_rows(rollout_id, expected, merged)
        positions, geometry = layer_selection(rollout_id, merged.geometry, layers)
        spans = row_spans(rows)
        check_rows(rollout_id, spans, request_ids, merged.entry)
        load = _PackedLoad(merged, request_ids, geometry, spans)
        self._read(rollout_id, merged, request_ids, load.outs, positions, spans)
        return load.result()

    def prefetch(
        self,
        rollout_id: str,
        batches: Iterable[Iterable[str]],
        *,
        depth: int = 2,
        pin_memory: bool = False,
        layers: Iterable[int] | None = None,
        rows: Mapping[str, Iterable[Any]] | None = None,
    ) -> Prefetcher:
        """Iterate :class:`PackedRouting` of each batch of request ids (a trainer's micro-batches),
        in order, while the next ``depth`` batches load in the background.

        Every batch is checked against the index before anything is read, so an unknown or
        repeated id (or a layer the rollout does not have) fails here, not halfway through a
        step. ``pin_memory``: returned tensors are in page-locked memory (for
        ``.to("cuda", non_blocking=True)``; needs CUDA). ``layers``: as in :meth:`get_numpy`
        (a pipeline stage's layers). ``rows``: as in :meth:`get_numpy`, for requests of any
        batch (a context-parallel rank's rows), checked here. Use as a context manager, or
        ``close()`` it to stop loading early.
        """
        return Prefetcher(self, rollout_id, batches, depth=depth, pin_memory=pin_memory, layers=layers, rows=rows)

    def wait_committed(self, rollout_id: str, request_ids: Iterable[str], *, timeout_s: float = 60.0) -> None:
        """Return once every one of ``request_ids`` is committed and readable: a :meth:`get`,
        :meth:`get_packed` or :meth:`prefetch` of them right after reads without
        :class:`UnknownRolloutError` / :class:`UnknownRequestError`.

        When routing becomes readable: the engine side queues a finished request and its
        writer commits it in a batch within ``flush_interval_s`` (R3Config, 50 ms by default)
        or once ``flush_bytes`` are queued; a store node acknowledges a batch only once it is
        durable, and readers see it when the rollout's index counts it. The engine answers
        before that: a vLLM server's response names where the routing goes
        (``kv_transfer_params["r3_routing"]``) when the request finishes, typically a fraction
        of a second before it is readable. Offline, ``flush_routing(llm)`` waits on the engine
        side; a server client, which has no such call, waits here.

        Polls the rollout's index (per source its entry point, and only the parts not seen
        before) at once, then after 10 ms, backing off to every 200 ms. A rollout that does not exist yet,
        and a store node that cannot be reached for a moment, are "not yet"; a refused token
        or damaged data are raised. Past ``timeout_s`` seconds (a poll in flight gets up to a
        second more): :class:`R3TimeoutError` naming the rollout, how many of the requests are
        not committed and the first few. Bad or repeated ids fail at once; no ids: returns at
        once.
        """
        validate_id(rollout_id, "rollout_id")
        missing = _check_ids(request_ids)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s >= 0:
            raise ConfigError(f"timeout_s must be a number of seconds >= 0, got {timeout_s!r}")
        total = len(missing)
        deadline = time.monotonic() + timeout_s
        pause = _WAIT_FIRST_S
        merged: _MergedIndex | None = None
        not_yet: Exception | None = None  # why the last poll saw no index (unknown rollout, node down)
        while missing:
            try:
                merged = self._index(rollout_id, refresh=True, within_s=max(deadline - time.monotonic(), _WAIT_LAST_POLL_S))
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
                raise R3TimeoutError(_not_committed(rollout_id, missing, total, timeout_s, merged, not_yet))
            time.sleep(min(pause, left))
            pause = min(2 * pause, _WAIT_MAX_S)

    def collect(
        self,
        rollout_id: str,
        request_ids: Iterable[str],
        *,
        poll_s: float = 0.1,
        max_batch: int = 256,
        layers: Iterable[int] | None = None,
        rows: Mapping[str, Iterable[Any]] | None = None,
    ) -> ShareCollector:
        """Start reading ``request_ids`` as they are committed, while the rollout still runs (a
        trainer rank names its share up front); :class:`~r3rdma.read.collector.ShareCollector`
        says how. Ids need not be committed yet; bad or repeated ids fail here. ``poll_s``: how
        often the index is polled; ``max_batch``: requests read per read call.

        ``layers`` and ``rows``: a rank's slice of each request (a pipeline stage's layers, a
        context-parallel rank's row spans), as in :meth:`get_numpy`; only the chunks holding
        them are fetched, and ``result()`` / ``packed()`` hold what ``get_numpy`` /
        ``get_packed`` return with them. Checked here: malformed layers or spans, and spans of
        requests not in the share (:class:`ConfigError`). Checked once the index shows them: a
        layer the rollout does not have, and a span past a committed request's end
        (:class:`ShapeMismatchError`); either ends the collection, raised by ``result()``."""
        from r3rdma.read.collector import ShareCollector

        validate_id(rollout_id, "rollout_id")
        request_ids = _check_ids(request_ids)
        spans = row_spans(rows)
        check_named(spans, request_ids)
        return ShareCollector(
            self, rollout_id, request_ids, poll_s=poll_s, max_batch=max_batch, layers=layer_list(layers), rows=spans
        )

    # -- internals --------------------------------------------------------------------------

    def _require(self, rollout_id: str, request_ids: list[str]) -> _MergedIndex:
        """The merged index, refreshed if some of ``request_ids`` are not in it; raises naming
        the missing ones (and why: pending, or on a node that could not be reached)."""
        merged = self._index(rollout_id)
        if any(rid not in merged.owner for rid in request_ids):
            merged = self._index(rollout_id, refresh=True)  # committed since we last looked?
        missing = [rid for rid in request_ids if rid not in merged.owner]
        if not missing:
            return merged
        shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        if merged.skipped:
            raise TransportError(
                f"rollout {rollout_id!r}: requests {shown} are on none of the reachable store nodes; "
                f"{len(merged.skipped)} could not be reached and may hold them (retryable): "
                + "; ".join(f"{name}: {why}" for name, why in merged.skipped.items())
            )
        pending = [rid for rid in missing if rid in merged.pending]
        note = (
            f"; {', '.join(repr(p) for p in pending[:5])} pending: stored segments do not cover every row yet" if pending else ""
        )
        raise UnknownRequestError(
            f"rollout {rollout_id!r} has no committed request {shown} ({len(missing)} of the {len(request_ids)} "
            f"asked for are missing; {len(merged.owner)} requests committed){note}; nothing was read"
        )

    def _read_arrays(
        self,
        rollout_id: str,
        merged: _MergedIndex,
        request_ids: list[str],
        positions: np.ndarray | None = None,
        spans: Spans | None = None,
    ) -> dict[str, np.ndarray]:
        """Each request's rows (all of them, or its ``spans``), in an array of its own
        (``[rows, L, K]``, L: the layers of ``positions``); see :meth:`_read`."""
        geometry = merged.geometry
        width = geometry["num_layers"] if positions is None else len(positions)
        lengths = _rows_wanted([merged.entry(rid) for rid in request_ids], request_ids, spans)
        outs = {rid: np.empty((n, width, geometry["top_k"]), dtype=geometry["dtype"]) for rid, n in zip(request_ids, lengths)}
        self._read(rollout_id, merged, request_ids, outs, positions, spans)
        return outs

    def _read(
        self,
        rollout_id: str,
        merged: _MergedIndex,
        request_ids: list[str],
        outs: dict[str, np.ndarray],
        positions: np.ndarray | None = None,
        spans: Spans | None = None,
    ) -> None:
        """Each request's rows into ``outs[request id]`` (sized by :func:`_rows_wanted`), its
        segments in row order, read from one source holding it (the first that has not failed
        in this call); ``positions``: the MoE layer positions wanted (None: all); ``spans``: the
        rows wanted of some requests (checked by ``check_rows``). A source whose read fails
        (unreachable, timed out, failed I/O) is dropped and its requests are read again from
        their other replicas, into the same arrays."""
        merged.check_replicas(rollout_id, self._sources, request_ids)
        bar = self._progress_bar(rollout_id, merged, request_ids)
        try:
            sync(self._read_async(rollout_id, merged, request_ids, outs, positions, spans, bar))
        except CorruptDataError as e:
            # An array the (cached) index lists is gone or unreadable: if the rollout or these
            # requests were deleted meanwhile (retention), say so instead of "corrupt".
            self._raise_if_deleted(rollout_id, request_ids, e)
            raise
        finally:
            if bar is not None:
                bar.close()

    async def _read_async(
        self,
        rollout_id: str,
        merged: _MergedIndex,
        request_ids: list[str],
        outs: dict[str, np.ndarray],
        positions: np.ndarray | None = None,
        spans: Spans | None = None,
        bar: tqdm | None = None,
    ) -> None:
        """:meth:`_read` on the reader's event loop (replicas checked by the caller, and a
        :class:`CorruptDataError` is the caller's to explain)."""
        failed: dict[int, Exception] = {}
        todo = request_ids
        whole = positions is None and not spans  # a segment's CRC-32C covers all its rows and layers
        while todo:
            chosen: dict[str, int] = {}  # request -> the source it is read from
            wanted: dict[tuple[int, str], list[tuple[str, Segment, np.ndarray]]] = {}
            for rid in todo:
                holders = merged.holders(rid)
                alive = [h for h in holders if h[0] not in failed]
                if not alive:
                    cause = failed[holders[0][0]]
                    if len(holders) == 1 and not merged.skipped:
                        raise cause  # no replica anywhere: its own error, as with one source
                    raise TransportError(
                        f"request {rid!r} of rollout {rollout_id!r}: every store node holding it failed the read "
                        "(retryable): "
                        + "; ".join(f"{self._sources[h[0]].name}: {failed[h[0]]}" for h in holders)
                        + "".join(f"; {n} (could not be reached for the index): {w}" for n, w in merged.skipped.items())
                    ) from cause
                src, entry = alive[0]
                chosen[rid] = src
                segments = entry.segments if spans is None or rid not in spans else select_segments(entry, spans[rid])
                out = outs[rid]
                row = 0
                for seg in segments:  # each segment's rows land in their place in the request's array
                    wanted.setdefault((src, seg.array), []).append((rid, seg, out[row : row + seg.rows]))
                    row += seg.rows
                if row != len(out):
                    raise CorruptDataError(
                        f"request {rid!r} of rollout {rollout_id!r} on {self._sources[src].name}: its segments hold "
                        f"{row} of the {len(out)} rows its index entry asks for"
                    )
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
                            "reading rollout %r from %s failed, trying other replicas: %s",
                            rollout_id,
                            self._sources[src].name,
                            result,
                        )
                        self.read_failovers += 1
                    failed.setdefault(src, result)
                elif isinstance(result, Exception):
                    first_error = first_error or result
                else:
                    raise result
            if first_error is not None:
                raise first_error
            # Requests on a source that failed: read them whole from another replica.
            todo = [rid for rid in todo if chosen[rid] in failed]

    def _progress_bar(self, rollout_id: str, merged: _MergedIndex, request_ids: list[str]) -> tqdm | None:
        """A progress bar over the arrays a read touches, when shown (a bar not shown is not
        made: a trainer's every micro-batch read would pay for one)."""
        show = self._progress if self._progress is not None else sys.stderr.isatty()
        if not show:
            return None
        arrays = {(merged.owner[rid], seg.array) for rid in request_ids for seg in merged.entry(rid).segments}
        if len(arrays) < _PROGRESS_MIN_ARRAYS:
            return None
        return tqdm(desc=f"read {rollout_id}", unit="array", file=sys.stderr)

    async def _fetch(
        self,
        rollout_id: str,
        merged: _MergedIndex,
        wanted: dict[tuple[int, str], list[tuple[str, Segment, np.ndarray]]],
        bar: tqdm | None,
        positions: np.ndarray | None = None,
        whole: bool = True,
    ) -> list[BaseException | None]:
        """Read every array's wanted segments at once, each into its place; per array None, or
        the exception its read raised.

        Every array's GETs are planned first and made by at most ``max_workers`` coroutines
        in all; chunks are decoded by the workers of one :class:`JobBatch`, which tells this
        read once that all are done. Why not a task and a batch per array: a trainer rank's
        slice is about one GET per array, and per-array tasks, batches and wake-ups cost as
        much CPU as the GET (#34)."""
        keys = list(wanted)
        results: list[BaseException | None] = [None] * len(keys)

        # Metadata and shard indexes of arrays not read before, all at once (small GETs, many
        # in flight), so no array's data GET waits behind its own index GET. Only arrays not
        # read before need it (a task each costs more than the check).
        opening = asyncio.Semaphore(8 * self._concurrency)

        async def prepare(src: int, name: str) -> None:
            async with opening:
                await self._sources[src].prepare(rollout_id, merged.per_source[src], name)

        unprepared = [k for k in keys if not self._sources[k[0]].prepared(rollout_id, merged.per_source[k[0]], k[1])]
        failures: dict[tuple[int, str], BaseException] = {}
        if unprepared:
            prepared = await asyncio.gather(*(prepare(src, name) for src, name in unprepared), return_exceptions=True)
            failures = {key: e for key, e in zip(unprepared, prepared) if isinstance(e, BaseException)}

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
                others.append(self._read_other(results, i, source, rollout_id, index, name, pieces, positions, span))
                other_keys.append(i)
            else:
                planned.append((i, read))

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
                    checks.put(_verify_segments, results, i, rollout_id, self._sources[src].name, name, wanted[keys[i]])
            await checks.wait()
        if bar is not None:
            bar.update(len(keys))
        return results

    async def _read_other(
        self,
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

    def _raise_if_deleted(self, rollout_id: str, request_ids: list[str], cause: Exception) -> None:
        try:
            merged = self._index(rollout_id, refresh=True)
        except UnknownRolloutError as e:
            raise UnknownRolloutError(f"rollout {rollout_id!r} was deleted while it was being read ({e})") from cause
        gone = [rid for rid in request_ids if rid not in merged.owner]
        if gone:
            raise UnknownRequestError(f"rollout {rollout_id!r}: requests {gone[:5]!r} were deleted while being read") from cause

    def _index(self, rollout_id: str, *, refresh: bool = False, within_s: float | None = None) -> _MergedIndex:
        """The rollout's merged index: the cached one, or with ``refresh`` each source's entry
        point and the parts it has not seen. ``within_s``: the fetch as a whole ends within
        this many seconds (else :class:`R3TimeoutError`), not only each wait on a node."""
        validate_id(rollout_id, "rollout_id")
        cached = self._merged.get(rollout_id)
        if cached is not None and not refresh:
            return cached

        async def load_all():
            # Index parts are small and many (one per commit): fetch them well past the read bound.
            work = asyncio.gather(*(s.index(rollout_id, 8 * self._concurrency) for s in self._sources), return_exceptions=True)
            if within_s is None:
                return await work
            try:
                return await asyncio.wait_for(work, within_s)
            except TimeoutError as e:
                raise R3TimeoutError(
                    f"the index of rollout {rollout_id!r} was not fetched from "
                    f"{', '.join(s.name for s in self._sources)} within {within_s:.2f} s"
                ) from e

        with _gc_paused():
            return self._load_index(rollout_id, cached, sync(load_all()))

    def _load_index(self, rollout_id: str, cached: _MergedIndex | None, loaded: list[Any]) -> _MergedIndex:
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
        self.last_skipped_nodes = skipped
        if len(errors) == len(self._sources):
            raise errors[0]
        if cached is not None and not skipped and not cached.skipped and cached.same(results):
            return cached  # nothing new anywhere
        try:
            merged = _MergedIndex.merge(rollout_id, self._sources, results)
        except UnknownRolloutError:
            if skipped:  # the rollout may live on the nodes that did not answer
                raise TransportError(
                    f"rollout {rollout_id!r} is on none of the reachable store nodes; {len(skipped)} could not "
                    "be reached and may hold it (retryable): " + "; ".join(f"{n}: {w}" for n, w in skipped.items())
                ) from errors[0]
            raise
        merged.skipped = skipped
        self._merged[rollout_id] = merged
        return merged


class _PackedLoad:
    """The packed buffer of a batch, and where each request's rows go in it (rows are decoded
    straight into it: no per-request array, no copy)."""

    def __init__(self, merged: _MergedIndex, request_ids: list[str], geometry: dict[str, Any], spans: Spans | None) -> None:
        entries = [merged.entry(rid) for rid in request_ids]
        self.request_ids, self.geometry = request_ids, geometry
        self.start_rows = [entry.start_row for entry in entries]
        self.cu = cu_seqlens_of(_rows_wanted(entries, request_ids, spans))
        self.packed = np.empty((int(self.cu[-1]), geometry["num_layers"], geometry["top_k"]), dtype=geometry["dtype"])
        bounds = self.cu.tolist()
        self.outs = {rid: self.packed[bounds[i] : bounds[i + 1]] for i, rid in enumerate(request_ids)}

    def result(self) -> PackedRouting:
        """The :class:`PackedRouting`, once every request's rows are read."""
        return packed_routing(self.request_ids, self.packed, self.cu, self.start_rows, self.geometry)


class Prefetcher:
    """Yields :class:`PackedRouting` of each batch in order while the next ones load
    (:meth:`RoutingReader.prefetch`): up to ``depth`` batches ahead of the consumer, all of them
    loading at once (each load is itself concurrent). Why at once: one load at a time left a
    data-parallel rank's scattered micro-batches (a ranged GET per request, on every node)
    waiting on their slowest GET before the next batch's GETs started; on the H100 host its
    8 readers kept 8 of 16 cores busy at 0.61 of the contiguous rate.

    A load is a coroutine on the reader's event loop, started from ``__next__`` (no thread of
    its own: a thread per load in flight cost two more thread hand-offs per batch, #34); with
    ``pin_memory`` a thread per load in flight also pins the result, off the consumer's time."""

    def __init__(
        self,
        reader: RoutingReader,
        rollout_id: str,
        batches: Iterable[Iterable[str]],
        *,
        depth: int,
        pin_memory: bool,
        layers: Iterable[int] | None = None,
        rows: Mapping[str, Iterable[Any]] | None = None,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"depth must be an int >= 1, got {depth!r}")
        if pin_memory and not torch.cuda.is_available():
            raise ConfigError("pin_memory=True needs CUDA (page-locked memory is for copies to a GPU); none is available")
        self._batches = [_check_ids(batch) for batch in batches]
        every = [rid for batch in self._batches for rid in batch]
        merged = reader._require(rollout_id, list(dict.fromkeys(every)))  # unknown ids fail before any read
        self._layers = layer_list(layers)
        # So do layers the rollout lacks. Kept: a rollout's geometry does not change.
        self._selection = (merged.geometry, *layer_selection(rollout_id, merged.geometry, self._layers))
        self._rows = row_spans(rows)
        check_rows(rollout_id, self._rows, list(dict.fromkeys(every)), merged.entry)  # and rows past a request's end
        self._reader, self._rollout_id, self._depth, self._pin = reader, rollout_id, depth, pin_memory
        # get_packed may run in several threads: each call's reads run as one coroutine on the
        # reader's event loop, where its caches live.
        self._thread = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="r3rdma-prefetch") if pin_memory else None
        self._queue: collections.deque[tuple[list[str], Future[Any], _PackedLoad | None]] = collections.deque()
        self._next = 0

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[PackedRouting]:
        return self

    def __next__(self) -> PackedRouting:
        try:
            while len(self._queue) < self._depth and self._next < len(self._batches):
                batch = self._batches[self._next]
                try:
                    self._queue.append(self._start(batch))
                except Exception as e:  # raised when this batch's turn comes, as a failed load would be
                    failed: Future[Any] = Future()
                    failed.set_exception(e)
                    self._queue.append((batch, failed, None))
                self._next += 1
            if not self._queue:
                self.close()
                raise StopIteration
            batch, future, load = self._queue.popleft()
            if load is None:
                return future.result()  # a pinning thread's get_packed
            try:
                future.result()
            except CorruptDataError as e:
                self._reader._raise_if_deleted(self._rollout_id, batch, e)
                raise
            return load.result()
        except BaseException:
            self.close()
            raise

    def _start(self, batch: list[str]) -> tuple[list[str], Future[Any], _PackedLoad | None]:
        """Start loading ``batch``: its read on the reader's event loop (or, pinning, a thread's)."""
        if self._thread is not None:
            return batch, self._thread.submit(self._load_pinned, batch), None
        reader, rollout_id = self._reader, self._rollout_id
        merged = reader._require(rollout_id, batch)  # a request deleted since: said here, as get_packed says it
        if merged.geometry is not self._selection[0]:  # the rollout was written again
            self._selection = (merged.geometry, *layer_selection(rollout_id, merged.geometry, self._layers))
        _, positions, geometry = self._selection
        spans = None if self._rows is None else {rid: self._rows[rid] for rid in batch if rid in self._rows}
        merged.check_replicas(rollout_id, reader._sources, batch)
        load = _PackedLoad(merged, batch, geometry, spans)
        coro = reader._read_async(rollout_id, merged, batch, load.outs, positions, spans)
        return batch, asyncio.run_coroutine_threadsafe(coro, _reader_loop()), load

    def _load_pinned(self, batch: list[str]) -> PackedRouting:
        kwargs: dict[str, Any] = {}
        if self._layers is not None:
            kwargs["layers"] = self._layers
        if self._rows is not None:
            kwargs["rows"] = {rid: self._rows[rid] for rid in batch if rid in self._rows}
        packed = self._reader.get_packed(self._rollout_id, batch, **kwargs)
        import dataclasses

        return dataclasses.replace(packed, ids_TLK=packed.ids_TLK.pin_memory())

    def close(self) -> None:
        """Stop loading: batches not started are dropped, those in progress stop."""
        for _, future, _ in self._queue:
            future.cancel()
        self._queue.clear()
        self._next = len(self._batches)
        if self._thread is not None:
            self._thread.shutdown(wait=False)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reader_loop() -> asyncio.AbstractEventLoop:
    """The event loop every read runs on: zarr's (``zarr.core.sync.sync`` runs coroutines
    there), where the reader's caches and connections live."""
    from zarr.core.sync import _get_loop

    return _get_loop()


def _not_committed(
    rollout_id: str, missing: list[str], total: int, timeout_s: float, merged: _MergedIndex | None, not_yet: Exception | None
) -> str:
    """What :meth:`RoutingReader.wait_committed` says when its time is up."""
    shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    text = (
        f"rollout {rollout_id!r}: {len(missing)} of the {total} requests waited for are not committed after "
        f"{timeout_s} s ({shown})"
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
            text += f"; {len(merged.skipped)} store nodes could not be reached and may hold the rest: " + "; ".join(
                f"{name}: {why}" for name, why in merged.skipped.items()
            )
    return text


def _check_ids(request_ids: Iterable[str]) -> list[str]:
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


def _expected_rows(expected_rows: Mapping[str, int] | None, request_ids: list[str]) -> dict[str, int] | None:
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


def _check_expected_rows(rollout_id: str, expected: dict[str, int] | None, merged: _MergedIndex) -> None:
    """Every request of ``expected`` stores exactly its rows, from row 0 (its index entry says;
    nothing is read), else :class:`RowCountMismatchError` (or, where only rows from a later row
    on are stored and they end where expected, :class:`MissingRowsError`) naming the first."""
    if not expected:
        return
    wrong = []
    for rid, n in expected.items():
        entry = merged.entry(rid)
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


def _rows_wanted(entries: list[RequestEntry], request_ids: list[str], spans: Spans | None) -> list[int]:
    """Rows a read returns of each request: all its rows, or those of its spans."""
    if spans is None:
        return [entry.rows for entry in entries]
    return [entry.rows if rid not in spans else sum(hi - lo for lo, hi in spans[rid]) for rid, entry in zip(request_ids, entries)]


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


def _whole_checksum(entry: RequestEntry, row_bytes: int) -> int:
    """The CRC-32C of the request's rows, all of them in row order, from its segments'."""
    return crc32c_concat((s.crc32c, s.rows * row_bytes) for s in entry.segments)


def _copy_of(entry: RequestEntry) -> str:
    """A copy of a request, as a message about copies that differ shows it."""
    return (
        f"rows {entry.start_row}..{entry.end_row - 1} in segments of {[s.rows for s in entry.segments]} rows, "
        f"crc32c {[s.crc32c for s in entry.segments]}"
    )


@dataclass
class _MergedIndex:
    """The sources' indexes of one rollout, merged: which source a request is read from first.

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

    def entry(self, rid: str) -> RequestEntry:
        """The request's index entry on its first holder."""
        return self.per_source[self.owner[rid]].requests[rid]

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

    def check_replicas(self, rollout_id: str, sources: list[Source], request_ids: list[str]) -> None:
        """Every copy of each request must hold the same rows, else :class:`CorruptDataError`
        naming both nodes.

        Copies cut into the same segments compare their segments' CRC-32Cs (a request's copies
        with equal checksum lists are taken as equal, as before #35). Copies of the same rows
        may be cut differently (issue #35: a shared prefix stored by reference on one node,
        inline on another, or a request re-pushed whole after a failover): those compare one
        CRC-32C of the whole request each, combined from their segments' (the rare case; it
        hashes zeros as long as the request, :func:`~r3rdma.read.checksums.crc32c_concat`)."""
        if len(self.per_source) < 2:
            return
        row_bytes = 0  # bytes of one row, known once a request needs it
        for rid in request_ids:
            copies = self.holders(rid)
            if len(copies) < 2:
                continue
            first_src, first = copies[0]
            first_crcs, first_span = [s.crc32c for s in first.segments], (first.start_row, first.rows)
            first_whole: int | None = None  # first's whole CRC-32C, computed once if needed
            for src, entry in copies[1:]:
                span = (entry.start_row, entry.rows)
                if span == first_span and [s.crc32c for s in entry.segments] == first_crcs:
                    continue  # the usual case, as cheap as before #35: the same rows, the same cuts
                if span != first_span or [s.rows for s in entry.segments] == [s.rows for s in first.segments]:
                    same = False  # other rows, or the same cuts with other checksums
                else:
                    if not row_bytes:
                        g = self.geometry
                        row_bytes = g["num_layers"] * g["top_k"] * np.dtype(g["dtype"]).itemsize
                    if first_whole is None:
                        first_whole = _whole_checksum(first, row_bytes)
                    same = _whole_checksum(entry, row_bytes) == first_whole
                if not same:
                    raise CorruptDataError(
                        f"request {rid!r} of rollout {rollout_id!r} is stored with different rows on "
                        f"{sources[first_src].name} ({_copy_of(first)}) and {sources[src].name} ({_copy_of(entry)})"
                    )

    def same(self, indexes: list[RolloutIndex | None]) -> bool:
        """Whether ``indexes`` (one per source) are the ones this was merged from."""
        return {i: x for i, x in enumerate(indexes) if x is not None}.keys() == self.per_source.keys() and all(
            self.per_source[i] is x for i, x in enumerate(indexes) if x is not None
        )

    @classmethod
    def merge(cls, rollout_id: str, sources: list[Source], indexes: list[RolloutIndex | None]) -> _MergedIndex:
        present = {i: index for i, index in enumerate(indexes) if index is not None}
        if not present:
            where = sources[0].name if len(sources) == 1 else f"any of {len(sources)} sources"
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
                    f"rollout {rollout_id!r}: {sources[first].name} stores {geometry}, {sources[i].name} stores {index.geometry}"
                )
            # New ids in bulk (C-level loops), in the source's commit order. Replicas' checksums
            # are compared when they are read (check_replicas): comparing every replica here
            # was ~40% of a fresh reader's index open at 16k requests on 4 nodes, 2 replicas.
            if owner:
                owned[i] = [rid for rid in index.requests if rid not in owner]
                owner.update(dict.fromkeys(owned[i], i))
            else:
                owner = dict.fromkeys(index.requests, i)
                owned[i] = list(owner)
            pending.update(index.pending)
        if geometry is None:
            geometry = {"num_layers": 0, "top_k": 0, "num_experts": 0, "dtype": "uint8", "layer_map": []}
        return cls(geometry, owner, pending - owner.keys(), present, owned=owned)
