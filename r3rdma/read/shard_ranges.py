"""Row ranges of r3rdma's batch arrays, read as few ranged GETs per shard and decoded in a pool.

Why not ``zarr.AsyncArray.getitem`` for this layout: zarr-python 3.1 reads part of a shard as
one awaited GET per inner chunk, one after another, re-reads the shard index on every call,
and runs each chunk through its single event-loop thread. On a data-parallel rank's scattered
share (a few requests from every batch array) it read 0.19-0.21 GB/s on a 16-core H100 host,
and 0.44-0.56 GB/s on contiguous reads, whatever its ``async.concurrency``; plain GETs of the
same files ran at 2.5-2.8 GB/s (BENCHMARKS.md "Read at scale" has the A/B). Here, per array:
the shard index is fetched once per reader (arrays are immutable), every inner chunk the
ranges need is planned first, chunks that lie close together in the file are fetched as one
ranged GET (``store.get`` with a byte range: obstore, local files, any zarr store), all GETs
at once, and chunks are checked (CRC-32C) and decoded (zstd) in a thread pool: both release the
GIL. Exactly the layout r3rdma writes (sharded on tokens, ``bytes`` [+ ``zstd``] + ``crc32c``
inner codecs, index at the start or end); anything else goes through zarr.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from numcodecs import Zstd
from zarr.abc.store import RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype

from r3rdma.errors import CorruptDataError
from r3rdma.read.gather import gather
from r3rdma.records import buffer_checksum

__all__ = ["ShardLayout", "read_ranges", "shard_indexes", "shard_index_of"]

_EMPTY = 2**64 - 1  # (offset, nbytes) of an inner chunk zarr left out: every value the fill value
_CRC = struct.Struct("<I")
_DTYPES = {"uint8": "<u1", "uint16": "<u2", "int32": "<i4"}
_GAP = 1 << 20  # chunks closer than this in the file are fetched in one GET (fewer requests win)
_ZSTD = Zstd()
_pool: ThreadPoolExecutor | None = None


def _decode_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="r3rdma-decode")
    return _pool


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What a batch array's ``zarr.json`` says about its shards, when it is r3rdma's layout."""

    rows: int
    dtype: np.dtype
    row_shape: tuple[int, int]
    shard_rows: int
    chunk_rows: int
    zstd: bool
    fill: int
    index_at_start: bool

    @classmethod
    def of(cls, metadata: dict[str, Any]) -> ShardLayout | None:
        """The layout an array's ``zarr.json`` (as a dict) describes, or None when it is not r3rdma's
        (the reader then reads the array through zarr)."""
        try:
            shape = tuple(metadata["shape"])
            outer = tuple(metadata["chunk_grid"]["configuration"]["chunk_shape"])
            (sharding,) = metadata["codecs"]
            config = sharding["configuration"]
            inner = tuple(config["chunk_shape"])
            names = [c["name"] for c in config["codecs"]]
            ok = (
                metadata.get("zarr_format") == 3
                and metadata["chunk_grid"].get("name") == "regular"
                and metadata.get("chunk_key_encoding") == {"name": "default", "configuration": {"separator": "/"}}
                and sharding.get("name") == "sharding_indexed"
                and config.get("index_location", "end") in ("start", "end")
                and metadata.get("data_type") in _DTYPES
                and len(shape) == 3
                and outer[1:] == shape[1:]
                and inner[1:] == shape[1:]
                and outer[0] % inner[0] == 0
                and names in (["bytes", "crc32c"], ["bytes", "zstd", "crc32c"])
                and config["codecs"][0].get("configuration", {}).get("endian", "little") == "little"
                and [c["name"] for c in config["index_codecs"]] == ["bytes", "crc32c"]
                and isinstance(metadata.get("fill_value"), int)
                and not metadata.get("storage_transformers")
            )
        except (KeyError, TypeError, ValueError):
            return None
        if not ok:
            return None
        return cls(
            shape[0],
            np.dtype(_DTYPES[metadata["data_type"]]),
            shape[1:],
            outer[0],
            inner[0],
            "zstd" in names,
            metadata["fill_value"],
            config.get("index_location", "end") == "start",
        )

    @classmethod
    def from_index(cls, shard: dict[str, Any], dtype: str, row_shape: tuple[int, int]) -> ShardLayout:
        """The layout an index part's ``shards`` entry describes (r3rdma's writer: one shard of
        whole chunks, index first, fill value 0); see :func:`shard_index_of`."""
        rows, chunk_rows = shard["rows"], shard["chunk_rows"]
        return cls(
            rows, np.dtype(_DTYPES[dtype]), row_shape, -(-rows // chunk_rows) * chunk_rows, chunk_rows, shard["zstd"], 0, True
        )

    @property
    def chunks_per_shard(self) -> int:
        """Inner chunks per shard."""
        return self.shard_rows // self.chunk_rows

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one decoded inner chunk (edge chunks are stored padded to this size)."""
        return self.chunk_rows * int(np.prod(self.row_shape)) * self.dtype.itemsize


async def read_ranges(
    store: Any,
    path: str,
    layout: ShardLayout,
    ranges: Sequence[tuple[int, int]],
    indexes: dict[tuple[str, int], np.ndarray],
    where: str,
) -> list[np.ndarray]:
    """Rows ``lo:hi`` of each of ``ranges`` of the array at ``path`` in ``store``. ``indexes``
    caches shard indexes (by path and shard number) across calls. Store errors propagate (the
    caller says what they mean); damage raises :class:`CorruptDataError` naming ``where``."""
    outs = [np.empty((hi - lo, *layout.row_shape), dtype=layout.dtype) for lo, hi in ranges]
    wanted: dict[int, list[int]] = {}  # chunk number -> ranges that need rows of it
    for i, (lo, hi) in enumerate(ranges):
        for chunk in range(lo // layout.chunk_rows, -(-hi // layout.chunk_rows)):
            wanted.setdefault(chunk, []).append(i)
    by_shard: dict[int, list[int]] = {}
    for chunk in sorted(wanted):
        by_shard.setdefault(chunk // layout.chunks_per_shard, []).append(chunk)

    async def shard(shard_no: int, chunks: list[int]) -> None:
        key = f"{path}/c/{shard_no}/0/0"
        index = await _index(store, key, layout, shard_no, indexes, where)
        stored = []
        for chunk in chunks:
            offset, nbytes = (int(v) for v in index[chunk % layout.chunks_per_shard])
            if offset == _EMPTY and nbytes == _EMPTY:
                _place(layout, chunk, None, ranges, wanted[chunk], outs)
            else:
                stored.append((offset, offset + nbytes, chunk))
        stored.sort()
        groups: list[list[tuple[int, int, int]]] = []
        for item in stored:  # chunks near each other in the file: one GET
            if groups and item[0] - groups[-1][-1][1] <= _GAP:
                groups[-1].append(item)
            else:
                groups.append([item])
        loop = asyncio.get_running_loop()

        async def group(items: list[tuple[int, int, int]]) -> None:
            start, end = items[0][0], max(e for _, e, _ in items)
            buffer = await store.get(key, prototype=default_buffer_prototype(), byte_range=RangeByteRequest(start, end))
            data = np.empty(0, dtype=np.uint8) if buffer is None else buffer.as_numpy_array()
            if len(data) != end - start:
                raise CorruptDataError(
                    f"{where}: shard {shard_no} holds {start + len(data)} bytes; its index lists chunks up to byte {end}"
                )
            # A task per chunk or two: the chunks of one GET decode on all cores at once.
            await asyncio.gather(
                *(
                    loop.run_in_executor(
                        _decode_pool(), _decode_group, layout, data, start, items[i : i + 2], ranges, wanted, outs, where
                    )
                    for i in range(0, len(items), 2)
                )
            )

        await gather(group(g) for g in groups)

    await gather(shard(s, chunks) for s, chunks in by_shard.items())
    return outs


def shard_index_of(shard: dict[str, Any]) -> np.ndarray:
    """The shard index an index part's ``shards`` entry carries (-1 marks a chunk left out)."""
    return np.asarray(shard["chunks"], dtype=np.int64).reshape(-1, 2).astype("<u8")


async def shard_indexes(store: Any, path: str, layout: ShardLayout, cache: dict[tuple[str, int], np.ndarray], where: str) -> None:
    """Fetch (into ``cache``) the index of every shard of the array at ``path``: a reader does
    this for all arrays of a read at once, so each array's data GET does not wait behind it."""
    shards = -(-layout.rows // layout.shard_rows)
    await gather(_index(store, f"{path}/c/{s}/0/0", layout, s, cache, where) for s in range(shards))


async def _index(
    store: Any, key: str, layout: ShardLayout, shard_no: int, cache: dict[tuple[str, int], np.ndarray], where: str
) -> np.ndarray:
    index = cache.get((key, shard_no))
    if index is not None:
        return index
    size = 16 * layout.chunks_per_shard + 4  # (offset, nbytes) per inner chunk, then a CRC-32C
    byte_range = RangeByteRequest(0, size) if layout.index_at_start else SuffixByteRequest(size)
    buffer = await store.get(key, prototype=default_buffer_prototype(), byte_range=byte_range)
    if buffer is None:  # no shard file: zarr left out a shard whose every value is the fill value
        index = np.full((layout.chunks_per_shard, 2), _EMPTY, dtype="<u8")
    else:
        raw = buffer.to_bytes()
        if len(raw) != size or buffer_checksum(raw[:-4]) != _CRC.unpack(raw[-4:])[0]:
            raise CorruptDataError(
                f"{where}: the index of shard {shard_no} is damaged ({len(raw)} bytes, expected {size} with a valid crc32c)"
            )
        index = np.frombuffer(raw[:-4], dtype="<u8").reshape(layout.chunks_per_shard, 2)
    cache[(key, shard_no)] = index
    return index


def _decode_group(
    layout: ShardLayout,
    data: np.ndarray,
    start: int,
    items: list[tuple[int, int, int]],
    ranges: Sequence[tuple[int, int]],
    wanted: dict[int, list[int]],
    outs: list[np.ndarray],
    where: str,
) -> None:
    """Check and decode each chunk of one fetched byte span, copying its rows where they go."""
    for offset, end, chunk in items:
        body = data[offset - start : end - start - 4]
        what = f"{where}: chunk {chunk}"
        if end - offset < 4 or buffer_checksum(body) != _CRC.unpack(data[end - start - 4 : end - start].tobytes())[0]:
            raise CorruptDataError(f"{what} fails its crc32c")
        if layout.zstd:
            try:
                raw = _ZSTD.decode(body)
            except (RuntimeError, ValueError) as e:  # numcodecs: "Zstd decompression error: ..."
                raise CorruptDataError(f"{what} is not a valid zstd frame: {e}") from e
        else:
            raw = body
        if len(raw) != layout.chunk_bytes:  # edge chunks are stored padded to full size
            raise CorruptDataError(f"{what} decodes to {len(raw)} bytes, expected {layout.chunk_bytes}")
        _place(
            layout,
            chunk,
            np.frombuffer(raw, dtype=layout.dtype).reshape(layout.chunk_rows, *layout.row_shape),
            ranges,
            wanted[chunk],
            outs,
        )


def _place(
    layout: ShardLayout,
    chunk: int,
    rows: np.ndarray | None,
    ranges: Sequence[tuple[int, int]],
    which: list[int],
    outs: list[np.ndarray],
) -> None:
    first = chunk * layout.chunk_rows
    for i in which:
        lo, hi = ranges[i]
        a, b = max(lo, first), min(hi, first + layout.chunk_rows)
        if rows is None:
            outs[i][a - lo : b - lo] = layout.fill
        else:
            outs[i][a - lo : b - lo] = rows[a - first : b - first]
