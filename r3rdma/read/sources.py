"""One store root a reader reads: a zarr store and its batch arrays (async).

Stores and metadata go through zarr-python's async API: a local root through ``LocalStore``, a store
node's ``/zarr/`` tree through :class:`~r3rdma.read.node_http.NodeHTTPStore` (``https://``:
obstore's ``HTTPStore``; the bearer token as a header; :func:`~r3rdma.read.locations.http_store`),
or any zarr ``StoreLike`` a caller passes. Batch arrays are opened once per reader (their
metadata is immutable) and read by row ranges straight into the caller's arrays: r3rdma's own
layout through :mod:`r3rdma.read.shard_ranges` (shard indexes kept, chunks fetched in few ranged
GETs, decoded by worker threads), any other layout through zarr's ``getitem``. The rollout
index's files are fetched through :meth:`Source.get` by :mod:`r3rdma.read.indexes`.

Errors say what happened (:meth:`Source.failure`): a refused token is
:class:`AuthenticationError`; a connection refused, reset or dropped is :class:`TransportError`
and a wait past ``timeout_s`` :class:`R3TimeoutError` (both retryable); a disk or 5xx failure is
:class:`StoreError`; bytes that arrived whole but fail their checksum or format are
:class:`CorruptDataError`.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np
import zarr
import zarr.errors
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import LocalStore

from r3rdma.errors import ConfigError, CorruptDataError, R3Error, StoreError, UnknownRolloutError
from r3rdma.read.awaiting import all_or_first_error
from r3rdma.read.http_errors import read_error
from r3rdma.read.locations import check_local_root, check_url, http_store
from r3rdma.read.node_http import NodeHTTPStore
from r3rdma.read.shard_layout import ShardLayout, shard_index_of, shard_indexes
from r3rdma.read.shard_ranges import ArrayRead, Piece, plan_read
from r3rdma.store.rollout_index import RolloutIndex, part_name

# http_store is imported from here too (r3rdma.bench's trainer-layout bench).
__all__ = ["Source", "http_store"]


class Source:
    """One store root: a zarr store plus how to name it in messages."""

    def __init__(self, name: str, store: Any, remote: bool, *, token_sent: bool = False, owned: bool = False) -> None:
        self.name = name
        self.store = store
        self._owned = owned  # made here from a URL: closed with the reader
        self.remote = remote
        self.token_sent = token_sent  # a 401 without a token means "send one", not "wrong token"
        # Immutable once written, so kept for the reader's life: batch arrays (metadata) and
        # their layouts by (rollout, uid, name), shard indexes by (shard key, shard number).
        self._arrays: dict[tuple[str, str, str], zarr.AsyncArray] = {}
        self._layouts: dict[tuple[str, str, str], ShardLayout | None] = {}
        self._shard_indexes: dict[tuple[str, int], np.ndarray] = {}

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
            check_local_root(path)
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
        """Drop what is kept about a rollout's arrays (it was deleted, perhaps created again)."""
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
        sizes = await all_or_first_error(self._size(rollout_id, key) for key in keys)
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
    """:meth:`Source.read_other` of an array that is not r3rdma's layout, through zarr: pieces
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


def _shard_keys(array: zarr.AsyncArray) -> list[str]:
    """Storage keys of every shard (or chunk, when unsharded) of ``array``."""
    outer = array.shards or array.chunks
    grid = [-(-n // c) for n, c in zip(array.shape, outer)]
    return [array.metadata.encode_chunk_key(coords) for coords in itertools.product(*(range(g) for g in grid))]
