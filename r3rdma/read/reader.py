"""Trainer-side reads of committed routing, from local roots and store nodes over HTTP.

:class:`RoutingReader` is a façade over three parts: the rollouts' indexes, fetched from every
source, merged and kept (:mod:`r3rdma.read.indexes`; copies of a request on several sources
compared by :mod:`r3rdma.read.replicas`); the reads, every array's GETs planned first and made
at once, decoded into the arrays returned, failing over between replicas
(:mod:`r3rdma.read.fetching`); and reading ahead of a trainer (:mod:`r3rdma.read.prefetch`,
:mod:`r3rdma.read.collector`). Its methods check what the caller asked for
(:mod:`r3rdma.read.request_ids`, :mod:`r3rdma.read.layers`, :mod:`r3rdma.read.rows`) before
anything is read. Index parts and array metadata are immutable: they are fetched once per
reader and kept.

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

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from zarr.core.sync import sync

from r3rdma.errors import ConfigError, TransportError
from r3rdma.ids import validate_id
from r3rdma.read.collector import ShareCollector
from r3rdma.read.fetching import RowFetcher
from r3rdma.read.indexes import RolloutIndexes
from r3rdma.read.layers import layer_list, layer_selection
from r3rdma.read.locations import source_items
from r3rdma.read.packed import PackedBuffer, PackedRouting, pack, to_torch
from r3rdma.read.prefetch import Prefetcher
from r3rdma.read.request_ids import check_expected_rows, check_ids, expected_row_counts
from r3rdma.read.rows import check_named, check_rows, row_spans
from r3rdma.read.sources import Source

if TYPE_CHECKING:  # torch is imported where tensors are made (r3rdma.read.packed says why)
    import torch

__all__ = ["RoutingReader", "PackedRouting", "RolloutInfo", "Prefetcher", "to_torch", "pack"]


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
    nodes (replicas, or re-pushed after a failover) must hold the same bytes for the rows its
    copies share, however each is cut into segments (checked when it is read: else
    :class:`CorruptDataError` naming both), and is read from the copy holding the most rows
    (a later turn visible on one node before another), or any copy holding all of them
    (:mod:`r3rdma.read.replicas`). ``max_workers``
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
        self._indexes = RolloutIndexes(self._sources, max_workers)
        self._fetcher = RowFetcher(self._sources, self._indexes, verify=verify, concurrency=max_workers, progress=progress)

    @property
    def last_skipped_nodes(self) -> dict[str, str]:
        """Sources skipped by the last index fetch (name -> why): unreachable nodes whose
        replicas were not needed, or whose absence made a read fail with TransportError."""
        return self._indexes.last_skipped

    @property
    def read_failovers(self) -> int:
        """Reads that failed on one source and were retried on another (a counter)."""
        return self._fetcher.failovers

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
        merged = self._indexes.get(rollout_id, refresh=True)
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
        merged = self._indexes.get(rollout_id, refresh=True)
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
        request_ids = check_ids(request_ids)
        expected = expected_row_counts(expected_rows, request_ids)
        merged = self._indexes.require(rollout_id, request_ids)
        self._fetcher.choose_copies(rollout_id, merged, request_ids)
        check_expected_rows(rollout_id, expected, merged)
        positions, _ = layer_selection(rollout_id, merged.geometry, layers)
        spans = row_spans(rows)
        check_rows(rollout_id, spans, request_ids, merged.entry)
        return self._fetcher.read_arrays(rollout_id, merged, request_ids, positions, spans)

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
        request_ids = check_ids(request_ids)
        expected = expected_row_counts(expected_rows, request_ids)
        merged = self._indexes.require(rollout_id, request_ids)
        self._fetcher.choose_copies(rollout_id, merged, request_ids)
        check_expected_rows(rollout_id, expected, merged)
        positions, geometry = layer_selection(rollout_id, merged.geometry, layers)
        spans = row_spans(rows)
        check_rows(rollout_id, spans, request_ids, merged.entry)
        buffer = PackedBuffer(request_ids, [merged.entry(rid) for rid in request_ids], geometry, spans)
        self._fetcher.read(rollout_id, merged, request_ids, buffer.outs, positions, spans)
        return buffer.result()

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
        repeated id (or a layer the rollout does not have, or copies of a request that
        disagree) fails here, not halfway through a step. ``pin_memory``: returned tensors are in page-locked memory (for
        ``.to("cuda", non_blocking=True)``; needs CUDA). ``layers``: as in :meth:`get_numpy`
        (a pipeline stage's layers). ``rows``: as in :meth:`get_numpy`, for requests of any
        batch (a context-parallel rank's rows), checked here. Use as a context manager, or
        ``close()`` it to stop loading early.
        """
        return Prefetcher(
            rollout_id,
            batches,
            indexes=self._indexes,
            fetcher=self._fetcher,
            get_packed=self.get_packed,
            depth=depth,
            pin_memory=pin_memory,
            layers=layers,
            rows=rows,
        )

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
        request_ids = check_ids(request_ids)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s >= 0:
            raise ConfigError(f"timeout_s must be a number of seconds >= 0, got {timeout_s!r}")
        self._indexes.wait_listed(rollout_id, request_ids, timeout_s)

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
        validate_id(rollout_id, "rollout_id")
        request_ids = check_ids(request_ids)
        spans = row_spans(rows)
        check_named(spans, request_ids)
        return ShareCollector(
            rollout_id,
            request_ids,
            indexes=self._indexes,
            fetcher=self._fetcher,
            poll_s=poll_s,
            max_batch=max_batch,
            layers=layer_list(layers),
            rows=spans,
        )
