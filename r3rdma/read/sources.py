"""One store root a reader reads: a zarr store, its rollout indexes, its batch arrays (async).

Stores and metadata go through zarr-python's async API: a local root through ``LocalStore``, a store
node's ``/zarr/`` tree through :class:`~r3rdma.read.node_http.NodeHTTPStore` (``https://``:
obstore's ``HTTPStore``; the bearer token as a header; :func:`http_store`), or any zarr
``StoreLike`` a caller passes. Batch arrays are opened once per reader (their metadata is
immutable) and read by row ranges straight into the caller's arrays: r3rdma's own layout through
:mod:`r3rdma.read.shard_ranges` (shard indexes kept, chunks fetched in few ranged GETs, decoded
by worker threads), any other layout through zarr's ``getitem``.

Errors say what happened (:meth:`Source.failure`): a refused token is
:class:`AuthenticationError`; a connection refused, reset or dropped is :class:`TransportError`
and a wait past ``timeout_s`` :class:`R3TimeoutError` (both retryable); a disk or 5xx failure is
:class:`StoreError`; bytes that arrived whole but fail their checksum or format are
:class:`CorruptDataError`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr
import zarr.errors
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import LocalStore

from r3rdma.errors import ConfigError, CorruptDataError, R3Error, StoreError, UnknownRolloutError
from r3rdma.read.gather import gather
from r3rdma.read.http_errors import read_error
from r3rdma.read.node_http import NodeHTTPStore
from r3rdma.read.shard_ranges import ArrayRead, Piece, ShardLayout, plan_read, shard_index_of, shard_indexes
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

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

__all__ = ["Source", "http_store", "source_items", "check_url"]

# host:port, which is what the engines' R3_STORE_URLS holds (UCX push addresses), not a URL.
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d+)$")


def source_items(sources: Any) -> list[Any]:
    """The reader's sources as a list: one source, a list or tuple of them, or a string of
    comma-separated store node URLs (the form ``$R3_STORE_HTTP_URLS`` and the commands take).

    A string is split on commas unless it names an existing directory (a path may hold one).
    """
    items = list(sources) if isinstance(sources, (list, tuple)) else [sources]
    out: list[Any] = []
    for item in items:
        if isinstance(item, str) and "," in item and not os.path.isdir(item):
            out.extend(part.strip() for part in item.split(",") if part.strip())
        else:
            out.append(item)
    return out


def check_url(url: str) -> str:
    """``url`` if it is a usable store node URL (``http(s)://host[:port][/path]``), else
    :class:`ConfigError` naming it and what is wrong."""
    from urllib.parse import urlsplit

    if any(c.isspace() for c in url):
        raise ConfigError(f"store node URL {url!r} holds whitespace; expected http://host:port")
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError for a port that is not a number in 0..65535
    except ValueError as e:
        raise ConfigError(
            f"store node URL {url!r} is not a valid URL ({e}); expected http://host:port "
            "(several: a list, or one string with commas between URLs)"
        ) from e
    if not parts.hostname:
        raise ConfigError(f"store node URL {url!r} names no host; expected http://host:port")
    if port == 0:
        raise ConfigError(f"store node URL {url!r} has port 0; expected the node's HTTP port (--http-port)")
    if parts.query or parts.fragment:
        raise ConfigError(f"store node URL {url!r} has a query or fragment; expected http://host:port")
    return url


class Source:
    """One store root: a zarr store plus how to name it in messages."""

    def __init__(self, name: str, store: Any, remote: bool, *, token_sent: bool = False, owned: bool = False) -> None:
        self.name = name
        self.store = store
        self._owned = owned  # made here from a URL: closed with the reader
        self.remote = remote
        self.token_sent = token_sent  # a 401 without a token means "send one", not "wrong token"
        # Immutable once written, so kept for the reader's life: batch arrays (metadata) by
        # (rollout, uid, name), and each rollout's index by rollout id.
        self._arrays: dict[tuple[str, str, str], zarr.AsyncArray] = {}
        self._layouts: dict[tuple[str, str, str], ShardLayout | None] = {}
        self._shard_indexes: dict[tuple[str, int], np.ndarray] = {}
        self._indexes: dict[str, RolloutIndex] = {}

    @classmethod
    def of(cls, item: Any, token: str | None, timeout_s: float) -> Source:
        """The source ``item`` names: an ``http(s)://`` URL of a store node, a local store root
        (an existing directory), or any zarr store. Anything else is a :class:`ConfigError`
        saying what is wrong with it (a malformed URL, ``host:port`` without ``http://``, a
        directory that does not exist), so a typo is not reported later as an unknown rollout."""
        if isinstance(item, str) and item.startswith(("http://", "https://")):
            url = check_url(item)
            try:
                store = http_store(url, token, timeout_s)
            except R3Error:
                raise
            except Exception as e:  # obstore refuses what urlsplit let through
                raise ConfigError(f"store node URL {url!r} cannot be used: {type(e).__name__}: {e}") from e
            return cls(url.rstrip("/"), store, remote=True, token_sent=bool(token), owned=True)
        if isinstance(item, (str, os.PathLike)):
            path = os.fspath(item)
            if isinstance(path, bytes):
                path = os.fsdecode(path)
            _check_local_root(path)
            return cls(path, LocalStore(path, read_only=True), remote=False)
        return cls(str(item), item, remote=not isinstance(item, LocalStore), token_sent=bool(token))

    def close(self) -> None:
        """Close the kept-alive connections of a store made here from a URL."""
        if self._owned and isinstance(self.store, NodeHTTPStore):
            self.store.close()

    def failure(self, what: str, error: BaseException) -> R3Error | None:
        """The R3Error that says why reading ``what`` here failed, or None when ``error`` is
        no failure to reach the data (absent, garbled: the caller decides)."""
        if isinstance(error, R3Error):
            return error
        if self.remote:
            return read_error(self.name, what, error, token_sent=self.token_sent)
        if isinstance(error, OSError) and not isinstance(error, FileNotFoundError):
            return StoreError(f"{self.name}: {what} failed: {type(error).__name__}: {error}")
        return None

    async def get(self, key: str, what: str) -> bytes | None:
        """The bytes of ``key``, or None when there is no such file."""
        try:
            buffer = await self.store.get(key, prototype=default_buffer_prototype())
        except Exception as e:
            failure = self.failure(what, e)
            if failure is not None:
                raise failure from e
            if isinstance(e, (FileNotFoundError, KeyError)):
                return None
            raise CorruptDataError(f"{self.name}: {what}: {e}") from e
        return None if buffer is None else buffer.to_bytes()

    # -- the index ------------------------------------------------------------------------

    async def index(self, rollout_id: str, concurrency: int) -> RolloutIndex | None:
        """The rollout's index here (None when this root has no such rollout), fetching only
        the parts not seen before; a rollout deleted and created again is read afresh."""
        for attempt in (0, 1):
            try:
                return await self._refresh(rollout_id, concurrency)
            except StalePartError:
                self._indexes.pop(rollout_id, None)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _refresh(self, rollout_id: str, concurrency: int) -> RolloutIndex | None:
        raw = await self.get(f"{rollout_id}/zarr.json", f"reading the index of rollout {rollout_id!r}")
        entry = check_entry(rollout_id, parse_attrs(raw, rollout_id, self.name), self.name)
        if entry is None:
            self._indexes.pop(rollout_id, None)
            return None
        if entry.get("format_version", 1) == 1:
            return RolloutIndex.from_format_1(rollout_id, entry, self.name)
        cached = self._indexes.get(rollout_id)
        if cached is not None and (cached.uid != entry["uid"] or cached.parts > entry["parts"]):
            self.forget(rollout_id)  # deleted and created again: its arrays are new ones
            cached = None
        if cached is None:
            cached = RolloutIndex(uid=entry["uid"], geometry={k: entry[k] for k in GEOMETRY_KEYS})
        if cached.parts == entry["parts"]:
            return cached
        limit = asyncio.Semaphore(concurrency)
        snapshot = entry.get("snapshot", 0)
        if snapshot > cached.parts:
            # One snapshot instead of the parts up to it (rollout_index.py, "Snapshots").
            key = f"{rollout_id}/{snapshot_name(snapshot)}/zarr.json"
            raw = await self.get(key, f"reading index snapshot {snapshot} of rollout {rollout_id!r}")
            if raw is None:  # replaced by a newer one since the entry point was read
                raise StalePartError(rollout_id, self.name, snapshot)
            merged = check_snapshot(rollout_id, snapshot, cached.uid, parse_attrs(raw, rollout_id, self.name), self.name)
            index = RolloutIndex.from_snapshot(merged, cached.geometry)
        else:
            # A copy gets the new parts: a read on another thread may be using the cached one.
            index = cached.copy()

        async def fetch(seq: int) -> IndexPart:
            async with limit:
                raw = await self.get(
                    f"{rollout_id}/{part_name(seq)}/zarr.json", f"reading index part {seq} of rollout {rollout_id!r}"
                )
            if raw is None:
                # Parts are written before the entry point counts them; only a deletion (and
                # perhaps a new rollout of the same id) removes one.
                raise StalePartError(rollout_id, self.name, seq)
            return check_part(rollout_id, seq, index.uid, parse_attrs(raw, rollout_id, self.name), self.name)

        parts = await gather(fetch(seq) for seq in range(index.parts + 1, entry["parts"] + 1))
        for part in parts:
            index.apply(part)
        self._indexes[rollout_id] = index
        return index

    # -- batch arrays ---------------------------------------------------------------------

    async def array(self, rollout_id: str, uid: str, name: str) -> zarr.AsyncArray:
        """The batch array ``name`` of the rollout, opened once and kept (by the index's ``uid``:
        a rollout deleted and written again is opened afresh); raises :class:`CorruptDataError`
        when it cannot be opened or is not ``[rows, L, K]``."""
        key = (rollout_id, uid, name)
        array = self._arrays.get(key)
        if array is None:
            what = f"reading the metadata of rollout {rollout_id!r} array {name}"
            try:
                array = await zarr.api.asynchronous.open_array(
                    store=self.store, path=f"{rollout_id}/{name}", mode="r", zarr_format=3
                )
            except Exception as e:  # zarr raises several types for missing/garbled metadata
                failure = self.failure(what, e)
                if failure is not None:
                    raise failure from e
                raise CorruptDataError(
                    f"array {name} of rollout {rollout_id!r} listed in the index cannot be opened from {self.name}: {e}"
                ) from e
            if array.ndim != 3:
                raise CorruptDataError(
                    f"{self.name}: rollout {rollout_id!r} array {name} has shape {array.shape}, not [rows, L, K]"
                )
            self._arrays[key] = array
        return array

    def prepared(self, rollout_id: str, index: RolloutIndex, name: str) -> bool:
        """Whether :meth:`prepare` of the array is done (its layout is known)."""
        return (rollout_id, index.uid, name) in self._layouts

    async def prepare(self, rollout_id: str, index: RolloutIndex, name: str) -> None:
        """Know the array's layout and shard index (kept) before :meth:`read_ranges`: from the
        index part that added it when it says (no GET), else from its ``zarr.json`` and shard."""
        key = (rollout_id, index.uid, name)
        if key in self._layouts:
            return
        hint = index.shards.get(name)
        if hint is not None:
            geometry = index.geometry
            layout = ShardLayout.from_index(hint, geometry["dtype"], (geometry["num_layers"], geometry["top_k"]))
            chunks = shard_index_of(hint)
            if len(chunks) != layout.chunks_per_shard:
                raise CorruptDataError(
                    f"{self._where(rollout_id, name)}: the index lists {len(chunks)} inner chunks, its shape "
                    f"({layout.rows} rows, {layout.chunk_rows} per chunk, {layout.layers_per_chunk} layers per chunk) "
                    f"makes {layout.chunks_per_shard}"
                )
            self._layouts[key] = layout
            self._shard_indexes[(f"{rollout_id}/{name}/c/0/0/0", 0)] = chunks
            return
        array = await self.array(rollout_id, index.uid, name)
        found = self._layouts[key] = ShardLayout.of(array.metadata.to_dict())
        if found is not None:
            await self._guard(
                rollout_id,
                name,
                shard_indexes(self.store, f"{rollout_id}/{name}", found, self._shard_indexes, self._where(rollout_id, name)),
            )

    async def plan(
        self,
        rollout_id: str,
        index: RolloutIndex,
        name: str,
        pieces: list[Piece],
        layers: np.ndarray | None = None,
        *,
        exact: bool = False,
        span: bool = False,
    ) -> ArrayRead | None:
        """The GETs of a read of rows ``lo:hi`` of a prepared batch array into ``out`` for each
        ``(lo, hi, out)`` of ``pieces`` (sorted by ``lo``), with ``layers`` (MoE layer
        positions) only those: :func:`~r3rdma.read.shard_ranges.plan_read` (``exact``,
        ``span``: which GETs), r3rdma's own chunk CRC-32C checked as they are decoded. None:
        not r3rdma's layout, read it with :meth:`read_other`."""
        layout = self._layouts[(rollout_id, index.uid, name)]
        if layout is None:
            return None
        where = self._where(rollout_id, name)
        last = max(hi for _, hi, _ in pieces)
        if last > layout.rows:
            raise CorruptDataError(f"{where} has {layout.rows} rows; the index lists rows up to {last}")
        return await plan_read(
            self.store, f"{rollout_id}/{name}", layout, pieces, self._shard_indexes, where, layers, exact=exact, span=span
        )

    async def read_other(
        self, rollout_id: str, index: RolloutIndex, name: str, pieces: list[Piece], layers: np.ndarray | None, span: bool
    ) -> None:
        """:meth:`plan`'s read of an array that is not r3rdma's layout, through zarr (its own
        chunk checksums checked); ``span``: the whole array in one read."""
        array = await self.array(rollout_id, index.uid, name)
        last = max(hi for _, hi, _ in pieces)
        if last > array.shape[0]:
            raise CorruptDataError(
                f"{self._where(rollout_id, name)} has {array.shape[0]} rows; the index lists rows up to {last}"
            )
        await self._guard(rollout_id, name, _read_through_zarr(array, pieces, layers, span))

    def rows_of(self, rollout_id: str, index: RolloutIndex, name: str) -> int:
        """Rows of a prepared array (:meth:`prepare`)."""
        layout = self._layouts[(rollout_id, index.uid, name)]
        if layout is not None:
            return layout.rows
        return int(self._arrays[(rollout_id, index.uid, name)].shape[0])

    def _where(self, rollout_id: str, name: str) -> str:
        return f"{self.name}: rollout {rollout_id!r} array {name}"

    async def _guard(self, rollout_id: str, name: str, work: Any) -> Any:
        """Await ``work`` (a read of array ``name``), saying what its failure means."""
        try:
            return await work
        except R3Error:
            raise
        except Exception as e:
            raise self.read_failure(rollout_id, name, e) from e

    def read_failure(self, rollout_id: str, name: str, error: Exception) -> R3Error:
        """What ``error``, raised reading array ``name`` of the rollout, means: itself when an
        :class:`R3Error`; else not reaching the data (:meth:`failure`) or damaged data."""
        if isinstance(error, R3Error):
            return error
        failure = self.failure(f"reading rollout {rollout_id!r} array {name}", error)
        if failure is None:  # zarr reports a chunk checksum mismatch as ValueError
            failure = CorruptDataError(f"{self._where(rollout_id, name)} cannot be read: {error}")
        if failure is not error and failure.__cause__ is None:
            failure.__cause__ = error
        return failure

    def forget(self, rollout_id: str) -> None:
        """Drop what is cached about a rollout (it was deleted)."""
        self._indexes.pop(rollout_id, None)
        for array_key in [k for k in self._arrays if k[0] == rollout_id]:
            del self._arrays[array_key]
            self._layouts.pop(array_key, None)
        for shard_key in [k for k in self._shard_indexes if k[0].startswith(f"{rollout_id}/")]:
            del self._shard_indexes[shard_key]

    async def stored_bytes(self, rollout_id: str, index: RolloutIndex) -> int:
        """Bytes this root stores for the rollout: entry point, index parts, batch arrays."""
        keys = ["zarr.json"] + [f"{part_name(seq)}/zarr.json" for seq in range(1, index.parts + 1)]
        for name in index.arrays:
            array = await self.array(rollout_id, index.uid, name)
            keys += [f"{name}/zarr.json"] + [f"{name}/{k}" for k in _shard_keys(array)]
        sizes = await gather(self._size(rollout_id, key) for key in keys)
        if sizes[0] is None:
            raise UnknownRolloutError(f"rollout {rollout_id!r} is gone from {self.name} (deleted while being read?)")
        return sum(s or 0 for s in sizes)  # a shard zarr left out (all fill value) stores nothing

    async def _size(self, rollout_id: str, key: str) -> int | None:
        try:
            return int(await self.store.getsize(f"{rollout_id}/{key}"))
        except Exception as e:
            failure = self.failure(f"reading the size of {key} of rollout {rollout_id!r}", e)
            if failure is not None:
                raise failure from e
            if isinstance(e, FileNotFoundError):
                return None
            raise CorruptDataError(f"{self.name}: the size of {key} of rollout {rollout_id!r} cannot be read: {e}") from e


async def _read_through_zarr(array: zarr.AsyncArray, pieces: list[Piece], layers: np.ndarray | None, span: bool) -> None:
    """:meth:`Source.read_into` of an array that is not r3rdma's layout, through zarr: pieces
    that touch or share a chunk read as one range (each chunk read once), or with ``span``
    the whole array at once."""
    chunk = array.chunks[0]
    ranges: list[tuple[int, int, list[Piece]]] = []
    if span:
        ranges.append((0, array.shape[0], list(pieces)))
    else:
        for piece in pieces:
            lo, hi, _ = piece
            if ranges and lo // chunk <= (ranges[-1][1] - 1) // chunk:
                ranges[-1] = (ranges[-1][0], max(ranges[-1][1], hi), [*ranges[-1][2], piece])
            else:
                ranges.append((lo, hi, [piece]))
    for first, last, members in ranges:
        block = np.asarray(await array.getitem((slice(first, last),)))
        for lo, hi, out in members:
            rows = block[lo - first : hi - first]
            out[...] = rows if layers is None else rows[:, layers]


def _check_local_root(path: str) -> None:
    """A local source must be an existing directory; else :class:`ConfigError` saying what it is."""
    if os.path.isdir(path):
        return
    if "://" in path:
        scheme = path.split("://", 1)[0]
        raise ConfigError(
            f"source {path!r}: store nodes are read over HTTP, expected http://host:port (or https://), got the scheme {scheme!r}"
        )
    match = _HOST_PORT.match(path)
    if match and not os.path.exists(path):
        raise ConfigError(
            f"source {path!r} is not a URL (and no such directory exists): did you mean http://{path}? "
            "Readers take the store nodes' HTTP URLs (--http-port; $R3_STORE_HTTP_URLS), "
            "not the UCX push addresses of R3_STORE_URLS"
        )
    if os.path.exists(path):
        raise ConfigError(f"source {path!r} is not a directory: expected a local store root or http://host:port")
    raise ConfigError(f"no such directory: {path!r} (expected a local store root, or a store node's http://host:port)")


def http_store(url: str, token: str | None, timeout_s: float) -> Any:
    """A read-only zarr store of a store node's ``/zarr/`` tree.

    ``http://``: :class:`~r3rdma.read.node_http.NodeHTTPStore`, r3rdma's own client (a ranged
    GET of an inner chunk costs 2-2.5x less CPU than through obstore; its module says why).
    ``https://``: ``ObjectStore`` over obstore's ``HTTPStore`` (Rust HTTP client and TLS; it
    moved whole shards at 2-2.5x the rate of zarr's ``FsspecStore``, BENCHMARKS.md "Read at
    scale"). Both try a failed request at most twice more within ``timeout_s``, so a dead node
    fails over in time (obstore's default retries for minutes).
    """
    from datetime import timedelta

    from r3rdma.transport.auth import coerce_token

    if token:  # e.g. open(path).read(): stripped, its trailing newline is no header value
        token = coerce_token(token, "the read token (token=)")
    if url.startswith("http://"):
        return NodeHTTPStore(url, token, timeout_s)
    try:
        from obstore.store import HTTPStore
    except ImportError:  # a declared dependency; without it (no wheel for the platform): fsspec
        return _fsspec_store(url, token, timeout_s)
    from zarr.storage import ObjectStore

    options: ClientConfig = {
        "allow_http": True,
        "connect_timeout": timedelta(seconds=timeout_s),
        "timeout": timedelta(seconds=timeout_s),
    }
    if token:
        options["default_headers"] = {"Authorization": f"Bearer {token}"}
    retry: RetryConfig = {
        "max_retries": 2,
        "retry_timeout": timedelta(seconds=timeout_s),
        "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=1), "base": 2},
    }
    return ObjectStore(HTTPStore.from_url(url.rstrip("/") + "/zarr", client_options=options, retry_config=retry), read_only=True)


def _fsspec_store(url: str, token: str | None, timeout_s: float) -> Any:
    import aiohttp
    from zarr.storage import FsspecStore

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # Each wait (connect, each read) is bounded, not the whole transfer.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
    options = {"headers": headers, "client_kwargs": {"timeout": timeout}}
    return FsspecStore.from_url(url.rstrip("/") + "/zarr", storage_options=options, read_only=True)


def _shard_keys(array: zarr.AsyncArray) -> list[str]:
    """Storage keys of every shard (or chunk, when unsharded) of ``array``."""
    outer = array.shards or array.chunks
    grid = [-(-n // c) for n, c in zip(array.shape, outer)]
    return [array.metadata.encode_chunk_key(coords) for coords in itertools.product(*(range(g) for g in grid))]
