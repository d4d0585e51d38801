"""Trainer-side reads of committed routing, from local roots and store nodes over HTTP.

Errors say what happened, so a trainer can tell "retry" from "the data is damaged":
:class:`TransportError` (connection refused, reset or dropped mid-body) and
:class:`R3TimeoutError` are worth a retry; :class:`AuthenticationError` (the node refused the
token) and :class:`StoreError` (the node or the local disk failed the read: HTTP 5xx, I/O
error) are not the data's fault; :class:`CorruptDataError` means bytes that arrived whole fail
their checksum or the format; :class:`UnknownRolloutError` / :class:`UnknownRequestError`: not
committed (or deleted).
"""

from __future__ import annotations

import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import zarr
import zarr.errors
from tqdm.auto import tqdm
from zarr.storage import LocalStore

from r3rdma.errors import (
    AuthenticationError,
    ConfigError,
    CorruptDataError,
    R3Error,
    R3TimeoutError,
    StoreError,
    TransportError,
    UnknownRequestError,
    UnknownRolloutError,
)
from r3rdma.ids import validate_id
from r3rdma.records import checksum
from r3rdma.read.node_http import NodeHttpClient, read_error
from r3rdma.store.shard_codec import ShardDecoder, chunk_pool
from r3rdma.store.layout import INDEX_KEY, parse_array_name

__all__ = ["RoutingReader", "PackedRouting", "RolloutInfo", "to_torch"]

_log = logging.getLogger(__name__)

_PROGRESS_MIN_ARRAYS = 16  # reads touching fewer arrays finish too fast for a progress bar


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


@dataclass(frozen=True, slots=True, eq=False)
class PackedRouting:
    """Routing of several requests packed along tokens, as trainers batch packed sequences.

    Rows of request ``i`` are ``ids_TLK[cu_seqlens[i]:cu_seqlens[i + 1]]``; their first row is
    position ``start_rows[i]`` of that request (0 unless only later turns were stored). A request
    stored in segments (turns of a conversation, prefill and decode parts) comes back whole:
    its segments concatenated in row order. Requests whose segments do not yet cover every row
    are invisible (pending).
    """

    request_ids: tuple[str, ...]
    ids_TLK: torch.Tensor
    cu_seqlens: torch.Tensor  # int32 [N + 1]
    start_rows: tuple[int, ...]
    layer_map: tuple[int, ...]
    num_experts: int


def to_torch(array: np.ndarray) -> torch.Tensor:
    """Routing ids as a tensor; uint16 widens to int32 because torch's uint16 lacks most ops."""
    if array.dtype == np.uint16:
        array = array.astype(np.int32)
    return torch.from_numpy(np.ascontiguousarray(array))


class RoutingReader:
    """Reads committed requests from one or more store roots.

    ``sources`` is one source or a list: a local directory, an ``http(s)://host:port`` URL
    of a store node (its ``/zarr/`` tree is read with zarr's fsspec store; ``token`` is sent
    as a bearer header), or any zarr ``StoreLike``. With several sources (the store nodes a
    rollout's requests were spread over) their indexes are merged; a request found on several
    nodes (replicas, or re-pushed after a failover) must have the same checksum on each
    (else :class:`CorruptDataError` naming both) and is read from any of them. Reads run in
    parallel over nodes and arrays (``max_workers``). Each returned segment is verified
    against the CRC-32C in the index unless ``verify=False``. ``timeout_s`` bounds every wait
    on a store node (connect, each read of the answer): past it, :class:`R3TimeoutError`.

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
        max_workers: int = 8,
        progress: bool | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        """``progress``: show a tqdm bar on reads of many arrays (None: only when stderr is a TTY)."""
        if isinstance(sources, (list, tuple)):
            items = list(sources)
        else:
            items = [sources]
        if not items:
            raise ConfigError("RoutingReader needs at least one source")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        self._sources = [_Source.of(item, token, float(timeout_s)) for item in items]
        self._verify = verify
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="r3rdma-read")
        self._indexes: dict[str, _MergedIndex] = {}
        self._progress = progress
        #: Sources skipped by the last index fetch (name -> why): unreachable nodes whose
        #: replicas were not needed, or whose absence made a read fail with TransportError.
        self.last_skipped_nodes: dict[str, str] = {}
        #: Reads that failed on one source and were retried on another (a counter).
        self.read_failovers = 0

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for source in self._sources:
            source.close()

    def __enter__(self) -> "RoutingReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def info(self, rollout_id: str) -> RolloutInfo:
        merged = self._index(rollout_id, refresh=True)
        geometry = merged.geometry
        return RolloutInfo(
            rollout_id=rollout_id,
            num_layers=geometry["num_layers"],
            top_k=geometry["top_k"],
            num_experts=geometry["num_experts"],
            dtype=geometry["dtype"],
            layer_map=tuple(geometry["layer_map"]),
            request_ids=tuple(merged.requests),
            total_rows=sum(entry["rows"] for _, entry in merged.requests.values()),
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
            out[source.name] = 0 if index is None else source.stored_bytes(rollout_id, index["arrays"])
        return out

    def get_numpy(self, rollout_id: str, request_ids: Iterable[str]) -> dict[str, np.ndarray]:
        """Per-request routing ``[rows, L, K]`` in the stored dtype, keyed by request id."""
        request_ids = list(dict.fromkeys(request_ids))
        for rid in request_ids:
            validate_id(rid, "request_id")
        merged = self._index(rollout_id)
        if any(rid not in merged.requests for rid in request_ids):
            merged = self._index(rollout_id, refresh=True)  # committed since we last looked?
        missing = [rid for rid in request_ids if rid not in merged.requests]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            if merged.skipped:
                raise TransportError(
                    f"rollout {rollout_id!r}: requests {shown} are on none of the reachable store nodes; "
                    f"{len(merged.skipped)} could not be reached and may hold them (retryable): "
                    + "; ".join(f"{name}: {why}" for name, why in merged.skipped.items())
                )
            pending = [rid for rid in missing if rid in merged.pending]
            note = (
                f"; {', '.join(repr(p) for p in pending[:5])} pending: stored segments do not cover every row yet"
                if pending
                else ""
            )
            raise UnknownRequestError(
                f"rollout {rollout_id!r} has no committed request {shown} ({len(merged.requests)} requests committed){note}"
            )
        # Each request is read from one source holding it (the first that has not failed in
        # this call); its segments are grouped by (source, array): each array is read once,
        # over the span its segments cover when that span is dense, and arrays are read in
        # parallel. A source whose read fails (unreachable, timed out, failed I/O) is dropped
        # and its requests are read again from their other replicas.
        chosen: dict[str, tuple[int, dict[str, Any]]] = {}

        def read_array(key: tuple[int, str], wanted) -> dict[tuple[str, int], np.ndarray]:
            src, name = key
            segs = wanted[key]
            source = self._sources[src]
            lo = min(s["offset"] for _, _, s in segs)
            hi = max(s["offset"] + s["rows"] for _, _, s in segs)
            extent = merged.extent(src, name)
            parts = {}
            sums: list[int] | None = None  # the segments' CRC-32C, when the read computed them
            if hi - lo <= 2 * sum(s["rows"] for _, _, s in segs):
                ranges = [(s["offset"] - lo, s["offset"] - lo + s["rows"]) for _, _, s in segs] if self._verify else []
                span, sums = source.read_rows(rollout_id, name, lo, hi, extent, ranges)
                for rid, seg_no, seg in segs:
                    parts[(rid, seg_no)] = span[seg["offset"] - lo : seg["offset"] - lo + seg["rows"]]
            else:
                for rid, seg_no, seg in segs:
                    parts[(rid, seg_no)] = source.read_rows(rollout_id, name, seg["offset"], seg["offset"] + seg["rows"], extent)[0]
            if self._verify:
                if sums is None:  # in parallel over the array's requests: crc32c releases the GIL
                    sums = list(chunk_pool().map(lambda s: checksum(parts[(s[0], s[1])]), segs))
                for (rid, seg_no, seg), got in zip(segs, sums):
                    if got != seg["crc32c"]:
                        raise CorruptDataError(
                            f"request {rid!r} of rollout {rollout_id!r} on {source.name}, array "
                            f"{seg['array']} rows {seg['offset']}..{seg['offset'] + seg['rows'] - 1}: "
                            f"crc32c {got:#010x}, index says {seg['crc32c']:#010x}"
                        )
            return parts

        parts: dict[tuple[str, int], np.ndarray] = {}
        failed: dict[int, Exception] = {}
        todo = request_ids
        try:
            show = self._progress if self._progress is not None else sys.stderr.isatty()
            arrays = {(merged.requests[rid][0], seg["array"]) for rid in request_ids for seg in merged.requests[rid][1]["segments"]}
            with tqdm(desc=f"read {rollout_id}", unit="array", file=sys.stderr,
                      disable=not show or len(arrays) < _PROGRESS_MIN_ARRAYS) as bar:
                while todo:
                    this_round = todo
                    wanted: dict[tuple[int, str], list[tuple[str, int, dict[str, Any]]]] = {}
                    for rid in todo:
                        alive = [h for h in merged.holders[rid] if h[0] not in failed]
                        if not alive:
                            cause = failed[merged.holders[rid][0][0]]
                            if len(merged.holders[rid]) == 1 and not merged.skipped:
                                raise cause  # no replica anywhere: its own error, as with one source
                            raise TransportError(
                                f"request {rid!r} of rollout {rollout_id!r}: every store node holding it failed the read "
                                "(retryable): "
                                + "; ".join(f"{self._sources[h[0]].name}: {failed[h[0]]}" for h in merged.holders[rid])
                                + "".join(f"; {n} (could not be reached for the index): {w}" for n, w in merged.skipped.items())
                            ) from cause
                        chosen[rid] = src, entry = alive[0]
                        for seg_no, seg in enumerate(entry["segments"]):
                            wanted.setdefault((src, seg["array"]), []).append((rid, seg_no, seg))
                    bar.total = (bar.total or 0) + len(wanted)
                    futures = [(key, self._pool.submit(read_array, key, wanted)) for key in wanted]
                    todo = []
                    first_error: Exception | None = None
                    for key, future in futures:
                        try:
                            parts.update(future.result())
                        except (TransportError, R3TimeoutError, StoreError) as e:
                            if isinstance(e, AuthenticationError) or len(self._sources) == 1:
                                first_error = first_error or e
                                continue
                            if key[0] not in failed:
                                _log.warning("reading rollout %r from %s failed, trying other replicas: %s", rollout_id, self._sources[key[0]].name, e)
                                self.read_failovers += 1
                            failed.setdefault(key[0], e)
                        except Exception as e:  # not a node failure: raised once the others are done
                            first_error = first_error or e
                        bar.update()
                    if first_error is not None:
                        raise first_error
                    # This round's requests on a source that failed: read them whole from another replica.
                    todo = [rid for rid in this_round if chosen[rid][0] in failed]
                    for rid in todo:
                        for n in range(len(chosen[rid][1]["segments"])):
                            parts.pop((rid, n), None)
        except CorruptDataError as e:
            # An array the (cached) index lists is gone or unreadable: if the rollout or these
            # requests were deleted meanwhile (retention), say so instead of "corrupt".
            self._raise_if_deleted(rollout_id, request_ids, e)
            raise
        out: dict[str, np.ndarray] = {}
        for rid in request_ids:
            segments = chosen[rid][1]["segments"]
            pieces = [parts[(rid, n)] for n in range(len(segments))]
            out[rid] = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return out

    def get(self, rollout_id: str, request_ids: Iterable[str]) -> dict[str, torch.Tensor]:
        """Per-request routing tensors ``[rows, L, K]`` (uint8, or int32 for wider ids)."""
        return {rid: to_torch(a) for rid, a in self.get_numpy(rollout_id, request_ids).items()}

    def get_packed(self, rollout_id: str, request_ids: Iterable[str]) -> PackedRouting:
        """Requests concatenated along tokens in the given order, with ``cu_seqlens``."""
        request_ids = list(request_ids)  # iterated several times below: a generator only once
        arrays = self.get_numpy(rollout_id, request_ids)
        merged = self._index(rollout_id)
        geometry = merged.geometry
        ordered = [arrays[rid] for rid in request_ids]
        lengths = [a.shape[0] for a in ordered]
        cu = np.zeros(len(ordered) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        if cu[-1] >= 2**31:
            raise CorruptDataError(f"packed batch has {cu[-1]} rows; cu_seqlens is int32, split the batch")
        if ordered:
            packed = np.concatenate(ordered)
        else:
            packed = np.zeros((0, geometry["num_layers"], geometry["top_k"]), dtype=geometry["dtype"])
        return PackedRouting(
            request_ids=tuple(request_ids),
            ids_TLK=to_torch(packed),
            cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
            start_rows=tuple(merged.requests[rid][1]["start_row"] for rid in request_ids),
            layer_map=tuple(geometry["layer_map"]),
            num_experts=geometry["num_experts"],
        )

    # -- internals --------------------------------------------------------------------------

    def _raise_if_deleted(self, rollout_id: str, request_ids: list[str], cause: Exception) -> None:
        try:
            merged = self._index(rollout_id, refresh=True)
        except UnknownRolloutError as e:
            raise UnknownRolloutError(f"rollout {rollout_id!r} was deleted while it was being read ({e})") from cause
        gone = [rid for rid in request_ids if rid not in merged.requests]
        if gone:
            raise UnknownRequestError(
                f"rollout {rollout_id!r}: requests {gone[:5]!r} were deleted while being read"
            ) from cause

    def _index(self, rollout_id: str, *, refresh: bool = False) -> "_MergedIndex":
        validate_id(rollout_id, "rollout_id")
        if refresh or rollout_id not in self._indexes:
            futures = [self._pool.submit(s.index, rollout_id) for s in self._sources]
            results: list[dict[str, Any] | None] = []
            skipped: dict[str, str] = {}
            errors: list[BaseException] = []
            for source, future in zip(self._sources, futures):
                try:
                    results.append(future.result())
                except (TransportError, R3TimeoutError, StoreError) as e:
                    if isinstance(e, AuthenticationError) or len(self._sources) == 1:
                        raise
                    # Replicas elsewhere may cover it: skip this node, say so, decide per request.
                    _log.warning("store source %s skipped for rollout %r: %s", source.name, rollout_id, e)
                    skipped[source.name] = str(e)
                    errors.append(e)
                    results.append(None)
            self.last_skipped_nodes = skipped
            if len(errors) == len(self._sources):
                raise errors[0]
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
            self._indexes[rollout_id] = merged
        return self._indexes[rollout_id]


@dataclass
class _MergedIndex:
    geometry: dict[str, Any]
    requests: dict[str, tuple[int, dict[str, Any]]]  # request id -> (first source holding it, entry)
    pending: set[str]
    per_source: dict[int, dict[str, Any]]
    holders: dict[str, list[tuple[int, dict[str, Any]]]] = field(default_factory=dict)  # every replica
    skipped: dict[str, str] = field(default_factory=dict)  # sources that could not be reached -> why
    _extents: dict[int, dict[str, int]] = field(default_factory=dict)

    def extent(self, source: int, array: str) -> int:
        """Rows of ``array`` on ``source`` that its index accounts for (committed or pending)."""
        if source not in self._extents:
            index = self.per_source[source]
            ends: dict[str, int] = {}
            segments = [seg for entry in index["requests"].values() for seg in entry["segments"]]
            segments += [seg for segs in index.get("pending", {}).values() if isinstance(segs, list) for seg in segs if isinstance(seg, dict)]
            for seg in segments:
                if _is_int(seg.get("offset")) and _is_int(seg.get("rows")) and isinstance(seg.get("array"), str):
                    ends[seg["array"]] = max(ends.get(seg["array"], 0), seg["offset"] + seg["rows"])
            self._extents[source] = ends
        return self._extents[source].get(array, 0)

    @classmethod
    def merge(cls, rollout_id: str, sources: list["_Source"], indexes: list[dict[str, Any] | None]) -> "_MergedIndex":
        present = {i: index for i, index in enumerate(indexes) if index is not None}
        if not present:
            where = sources[0].name if len(sources) == 1 else f"any of {len(sources)} sources"
            raise UnknownRolloutError(f"rollout {rollout_id!r} not found in {where}")
        geometry: dict[str, Any] | None = None
        requests: dict[str, tuple[int, dict[str, Any]]] = {}
        holders: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        pending: set[str] = set()
        for i, index in present.items():
            mine = {k: index.get(k) for k in ("num_layers", "top_k", "num_experts", "dtype", "layer_map")}
            if geometry is None:
                geometry, first = mine, i
            elif mine != geometry:
                raise CorruptDataError(
                    f"rollout {rollout_id!r}: {sources[first].name} stores {geometry}, {sources[i].name} stores {mine}"
                )
            for rid, entry in index["requests"].items():
                prior = requests.get(rid)
                if prior is None:
                    requests[rid] = (i, entry)
                elif [s["crc32c"] for s in prior[1]["segments"]] != [s["crc32c"] for s in entry["segments"]]:
                    raise CorruptDataError(
                        f"request {rid!r} of rollout {rollout_id!r} is stored with different rows on "
                        f"{sources[prior[0]].name} (crc32c {[s['crc32c'] for s in prior[1]['segments']]}) and "
                        f"{sources[i].name} (crc32c {[s['crc32c'] for s in entry['segments']]})"
                    )
                holders.setdefault(rid, []).append((i, entry))
            pending.update(index.get("pending", {}))
        return cls(geometry, requests, pending - set(requests), present, holders)


class _Source:
    """One store root: a zarr store plus how to name it in messages. A store node's URL also
    gets a :class:`NodeHttpClient`, which reads indexes and whole batch arrays without zarr."""

    def __init__(self, name: str, store: Any, remote: bool, http: NodeHttpClient | None = None) -> None:
        self.name = name
        self.store = store
        self.remote = remote
        self.http = http

    @classmethod
    def of(cls, item: Any, token: str | None, timeout_s: float) -> "_Source":
        if isinstance(item, str) and item.startswith(("http://", "https://")):
            import aiohttp
            from zarr.storage import FsspecStore

            headers = {"Authorization": f"Bearer {token}"} if token else {}
            # Like NodeHttpClient's: each wait (connect, each read) is bounded, not the transfer.
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
            options = {"headers": headers, "client_kwargs": {"timeout": timeout}}
            store = FsspecStore.from_url(item.rstrip("/") + "/zarr", storage_options=options, read_only=True)
            return cls(item, store, remote=True, http=NodeHttpClient(item, token, timeout_s=timeout_s))
        if isinstance(item, (str, os.PathLike)):
            return cls(os.fspath(item), LocalStore(os.fspath(item), read_only=True), remote=False)
        return cls(str(item), item, remote=not isinstance(item, LocalStore))

    def close(self) -> None:
        if self.http is not None:
            self.http.close()

    def failure(self, what: str, error: Exception) -> R3Error | None:
        """The R3Error that says why reading ``what`` here failed, or None when ``error`` is
        no failure to reach the data (absent, garbled: the caller decides)."""
        if isinstance(error, R3Error):
            return error  # already says what happened
        if self.remote:
            return read_error(self.name, what, error)
        if isinstance(error, OSError) and not isinstance(error, FileNotFoundError):
            return StoreError(f"{self.name}: {what} failed: {type(error).__name__}: {error}")
        return None

    def index(self, rollout_id: str) -> dict[str, Any] | None:
        """The rollout's index here, or None when this root has no such rollout."""
        try:
            if self.http is not None:
                document = self.http.get_json(f"{rollout_id}/zarr.json")
                if document is None or document.get("zarr_format") != 3 or document.get("node_type") != "group":
                    return None
                index = (document.get("attributes") or {}).get(INDEX_KEY)
            else:
                group = zarr.open_group(self.store, path=rollout_id, mode="r", zarr_format=3)
                index = group.attrs.asdict().get(INDEX_KEY)
        except R3Error:
            raise
        except Exception as e:
            # A refused token, a lost connection, a disk error: say so, it is not "absent".
            failure = self.failure(f"reading the index of rollout {rollout_id!r}", e)
            if failure is not None:
                raise failure from e
            if isinstance(e, (FileNotFoundError, KeyError, zarr.errors.GroupNotFoundError, zarr.errors.NodeTypeValidationError)):
                return None
            raise CorruptDataError(f"cannot read the index of rollout {rollout_id!r} from {self.name}: {e}") from e
        if not isinstance(index, dict) or "requests" not in index:
            return None
        _check_index(rollout_id, index, self.name)
        return index

    def read_rows(
        self, rollout_id: str, name: str, lo: int, hi: int, extent: int, crc_ranges: Sequence[tuple[int, int]] = ()
    ) -> tuple[np.ndarray, list[int] | None]:
        """Rows ``lo:hi`` of a batch array the index says holds at least ``extent`` rows, and the
        CRC-32C of each of ``crc_ranges`` (row ranges of the returned rows) when the read could
        compute them as the rows arrived (else None: the caller hashes them)."""
        if self.http is not None and (hi - lo) * 2 >= extent:
            # Most of the array is wanted: fetch it whole, decoding (and hashing the wanted
            # ranges) while it streams.
            where = f"{self.name}: rollout {rollout_id!r} array {name}"
            ranges = [(lo + a, lo + b) for a, b in crc_ranges]
            whole = self.http.read_array(f"{rollout_id}/{name}", where, ranges)
            if whole is not None:
                if whole.array.shape[0] < hi:
                    raise CorruptDataError(f"{where} has {whole.array.shape[0]} rows; the index lists rows up to {hi}")
                return whole.array[lo:hi], whole.crc32c
        return self._read_rows(rollout_id, name, lo, hi), None

    def _read_rows(self, rollout_id: str, name: str, lo: int, hi: int) -> np.ndarray:
        array = self._open_array(rollout_id, name)
        try:
            if self.remote and (hi - lo) * 2 >= array.shape[0]:
                # Most of the array is wanted: fetch its shard files whole (one GET each) instead
                # of a ranged GET per inner chunk, then decode from memory, in parallel where the
                # layout is ours (r3rdma.store.shard_codec), else through zarr.
                decoder = ShardDecoder.of(array.metadata.to_dict())
                if decoder is not None:
                    return self._fetch_and_decode(rollout_id, name, decoder)[lo:hi]
                array = self._fetch_whole(rollout_id, name, array)
            return array[lo:hi]
        except R3Error:
            raise
        except Exception as e:
            failure = self.failure(f"reading rollout {rollout_id!r} array {name}", e)
            if failure is not None:
                raise failure from e
            # zarr reports a chunk checksum mismatch as ValueError
            raise CorruptDataError(f"{self.name}: rollout {rollout_id!r} array {name} rows {lo}..{hi - 1} cannot be read: {e}") from e

    def _fetch_and_decode(self, rollout_id: str, name: str, decoder: ShardDecoder) -> np.ndarray:
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        prefix = f"{rollout_id}/{name}/c/"
        keys = [f"{s}/0/0" for s in range(decoder.num_shards)]  # default key encoding, "/" separator

        async def fetch_all():
            import asyncio

            return await asyncio.gather(*(self.store.get(prefix + k, prototype=default_buffer_prototype()) for k in keys))

        out = np.empty(decoder.shape, dtype=decoder.dtype)
        where = f"{self.name}: rollout {rollout_id!r} array {name}"
        for shard_no, buffer in enumerate(sync(fetch_all())):
            decoder.decode_into(out, shard_no, None if buffer is None else buffer.as_numpy_array(), where)
        return out

    def stored_bytes(self, rollout_id: str, arrays: list[str]) -> int:
        total = self._size(rollout_id, "zarr.json")
        if total is None:
            raise UnknownRolloutError(f"rollout {rollout_id!r} is gone from {self.name} (deleted while being read?)")
        for name in arrays:
            array = self._open_array(rollout_id, name)
            for key in ["zarr.json", *_shard_keys(array)]:
                # A shard zarr left out (every chunk the fill value) stores nothing.
                total += self._size(rollout_id, f"{name}/{key}") or 0
        return total

    def _size(self, rollout_id: str, key: str) -> int | None:
        """Bytes of the file ``key`` of the rollout, or None when there is no such file."""
        from zarr.core.sync import sync

        try:
            return int(sync(self.store.getsize(f"{rollout_id}/{key}")))
        except R3Error:
            raise
        except Exception as e:
            failure = self.failure(f"reading the size of {key} of rollout {rollout_id!r}", e)
            if failure is not None:
                raise failure from e
            if isinstance(e, FileNotFoundError):
                return None
            raise CorruptDataError(f"{self.name}: the size of {key} of rollout {rollout_id!r} cannot be read: {e}") from e

    def _open_array(self, rollout_id: str, name: str) -> zarr.Array:
        try:
            return zarr.open_array(self.store, path=f"{rollout_id}/{name}", mode="r", zarr_format=3)
        except R3Error:
            raise
        except Exception as e:  # zarr raises several types for missing/garbled metadata
            failure = self.failure(f"reading the metadata of rollout {rollout_id!r} array {name}", e)
            if failure is not None:
                raise failure from e
            raise CorruptDataError(f"array {name} of rollout {rollout_id!r} listed in the index cannot be opened from {self.name}: {e}") from e

    def _fetch_whole(self, rollout_id: str, name: str, array: zarr.Array) -> zarr.Array:
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync
        from zarr.storage import MemoryStore

        prefix = f"{rollout_id}/{name}/"
        keys = ["zarr.json", *_shard_keys(array)]

        async def fetch_all():
            import asyncio

            return await asyncio.gather(*(self.store.get(prefix + k, prototype=default_buffer_prototype()) for k in keys))

        buffers = sync(fetch_all())
        memory = MemoryStore({k: b for k, b in zip(keys, buffers) if b is not None}, read_only=True)
        return zarr.open_array(memory, mode="r", zarr_format=3)


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_index(rollout_id: str, index: Any, where: str) -> None:
    """Refuse a malformed rollout index up front (CorruptDataError), so a damaged or tampered
    ``zarr.json`` never surfaces as a TypeError/KeyError deep in a read (found by fuzzing)."""

    def bad(what: str) -> CorruptDataError:
        return CorruptDataError(f"index of rollout {rollout_id!r} on {where} is malformed: {what}")

    if not isinstance(index, dict) or not isinstance(index.get("requests"), dict):
        raise bad("'requests' must be a map")
    if not isinstance(index.get("pending", {}), dict):
        raise bad("'pending' must be a map")
    arrays = index.get("arrays")
    if not isinstance(arrays, list) or not all(isinstance(a, str) and parse_array_name(a) is not None for a in arrays):
        raise bad(f"'arrays' must list batch array names, got {str(arrays)[:100]}")
    if not index["requests"]:
        return
    for key in ("num_layers", "top_k", "num_experts"):
        if not _is_int(index.get(key), 1):
            raise bad(f"{key!r} must be an int >= 1, got {index.get(key)!r}")
    if index.get("dtype") not in ("uint8", "uint16", "int32"):
        raise bad(f"dtype must be uint8/uint16/int32, got {index.get('dtype')!r}")
    layer_map = index.get("layer_map")
    if not isinstance(layer_map, list) or len(layer_map) != index["num_layers"] or not all(map(_is_int, layer_map)):
        raise bad("'layer_map' must list num_layers ints")
    listed = set(arrays)
    for rid, entry in index["requests"].items():
        segments = entry.get("segments") if isinstance(entry, dict) else None
        if not isinstance(segments, list) or not segments or not _is_int(entry.get("rows")) or not _is_int(entry.get("start_row")):
            raise bad(f"request {rid!r} needs rows, start_row and a non-empty segment list")
        for seg in segments:
            ok = (
                isinstance(seg, dict)
                and seg.get("array") in listed
                and _is_int(seg.get("offset"))
                and _is_int(seg.get("rows"), 1)
                and _is_int(seg.get("start_row"))
                and _is_int(seg.get("crc32c"))
                and seg["crc32c"] < 1 << 32
            )
            if not ok:
                raise bad(f"request {rid!r} has a segment {str(seg)[:200]}")
        if sum(seg["rows"] for seg in segments) != entry["rows"]:
            raise bad(f"request {rid!r}: segments hold {sum(seg['rows'] for seg in segments)} rows, entry says {entry['rows']}")


def _shard_keys(array: zarr.Array) -> list[str]:
    """Storage keys of every shard (or chunk, when unsharded) of ``array``."""
    import itertools

    outer = array.shards or array.chunks
    grid = [-(-n // c) for n, c in zip(array.shape, outer)]
    return [array.metadata.encode_chunk_key(coords) for coords in itertools.product(*(range(g) for g in grid))]
