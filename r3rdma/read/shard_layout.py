"""What a batch array's shards look like: r3rdma's layout of them, and where each inner chunk lies.

r3rdma writes a batch array sharded on tokens: one shard spans every layer, its inner chunks
hold ``chunk_rows`` rows of a group of layers (format 3; every layer before), encoded by
``bytes`` [+ ``zstd``] + ``crc32c``, the shard index (``(offset, nbytes)`` per inner chunk,
then a CRC-32C) at the start or the end. :class:`ShardLayout` is that layout, read from an
array's ``zarr.json`` or from the index part that added the array (no GET); the shard index is
read from the shard's file or, for format 3 and later, computed from the chunk sizes the index
part lists. :mod:`r3rdma.read.shard_ranges` plans and makes reads of row ranges from them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from zarr.abc.store import RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype

from r3rdma.errors import CorruptDataError
from r3rdma.read.awaiting import all_or_first_error
from r3rdma.records import buffer_checksum
from r3rdma.store.index_entries import chunk_sizes_of, is_group_major

__all__ = ["ShardLayout", "EMPTY_CHUNK", "shard_index", "shard_indexes", "shard_index_of"]

EMPTY_CHUNK = 2**64 - 1  # (offset, nbytes) of an inner chunk zarr left out: every value the fill value
_CRC = struct.Struct("<I")
_DTYPES = {"uint8": "<u1", "uint16": "<u2", "int32": "<i4"}


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
    layer_chunk: int = 0  # layers per inner chunk; 0: every layer (format 2 and earlier)
    group_major: bool = False  # chunks lie layer group major in the shard (format 4's chunk_sizes_group_major)

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
                and len(outer) == len(inner) == 3
                and outer[2] == inner[2] == shape[2]
                # one shard spans every layer: whole layer groups, the last one maybe padded
                and 1 <= inner[1] <= outer[1]
                and outer[1] % inner[1] == 0
                and shape[1] <= outer[1] < shape[1] + inner[1]
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
            inner[1],
        )

    @classmethod
    def from_index(cls, shard: dict[str, Any], dtype: str, row_shape: tuple[int, int]) -> ShardLayout:
        """The layout an index part's ``shards`` entry describes (r3rdma's writer: one shard of
        whole chunks, index first, fill value 0); see :func:`shard_index_of`."""
        rows, chunk_rows = shard["rows"], shard["chunk_rows"]
        return cls(
            rows,
            np.dtype(_DTYPES[dtype]),
            row_shape,
            -(-rows // chunk_rows) * chunk_rows,
            chunk_rows,
            shard["zstd"],
            0,
            True,
            shard.get("layers_per_chunk", row_shape[0]),
            is_group_major(shard),
        )

    @property
    def layers_per_chunk(self) -> int:
        """Layers per inner chunk (every layer in stores written before format 3)."""
        return self.layer_chunk or self.row_shape[0]

    @property
    def layer_chunks(self) -> int:
        """Layer groups: inner chunks per row chunk."""
        return -(-self.row_shape[0] // self.layers_per_chunk)

    @property
    def chunks_per_shard(self) -> int:
        """Inner chunks per shard."""
        return self.shard_rows // self.chunk_rows * self.layer_chunks

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one decoded inner chunk (edge chunks are stored padded to this size)."""
        return self.chunk_rows * self.layers_per_chunk * self.row_shape[1] * self.dtype.itemsize


def shard_index_of(shard: dict[str, Any]) -> np.ndarray:
    """The shard index an index part's ``shards`` entry carries, in the index's order (row
    chunk, then layer group): from format 3's and 4's chunk sizes
    (:func:`r3rdma.store.index_entries.chunk_sizes_of`: chunks back to back after the shard
    index, in the index's order or layer group major), or format 2's ``chunks`` list of
    ``[offset, nbytes]`` (-1 marks a chunk left out)."""
    if "chunks" in shard:
        return np.asarray(shard["chunks"], dtype=np.int64).reshape(-1, 2).astype("<u8")
    sizes = chunk_sizes_of(shard).astype("<u8")
    starts = np.empty_like(sizes)
    starts[0] = 16 * len(sizes) + 4  # the shard index itself: (offset, nbytes) per chunk, then a CRC-32C
    np.cumsum(sizes[:-1], out=starts[1:])
    starts[1:] += starts[0]
    index = np.empty((len(sizes), 2), dtype="<u8")
    if is_group_major(shard):  # sizes of group 0's row chunks, then group 1's, ...: to (row chunk, group)
        row_chunks = -(-shard["rows"] // shard["chunk_rows"])
        groups = len(sizes) // row_chunks
        index[:, 0] = starts.reshape(groups, row_chunks).T.reshape(-1)
        index[:, 1] = sizes.reshape(groups, row_chunks).T.reshape(-1)
    else:
        index[:, 0] = starts
        index[:, 1] = sizes
    return index


async def shard_indexes(store: Any, path: str, layout: ShardLayout, cache: dict[tuple[str, int], np.ndarray], where: str) -> None:
    """Fetch (into ``cache``) the index of every shard of the array at ``path``: a reader does
    this for all arrays of a read at once, so each array's data GET does not wait behind it."""
    shards = -(-layout.rows // layout.shard_rows)
    await all_or_first_error(shard_index(store, f"{path}/c/{s}/0/0", layout, s, cache, where) for s in range(shards))


async def shard_index(
    store: Any, key: str, layout: ShardLayout, shard_no: int, cache: dict[tuple[str, int], np.ndarray], where: str
) -> np.ndarray:
    """The index of shard ``shard_no`` (file ``key``): from ``cache``, else fetched and kept
    there; :class:`CorruptDataError` naming ``where`` when it is damaged."""
    index = cache.get((key, shard_no))
    if index is not None:
        return index
    size = 16 * layout.chunks_per_shard + 4  # (offset, nbytes) per inner chunk, then a CRC-32C
    byte_range = RangeByteRequest(0, size) if layout.index_at_start else SuffixByteRequest(size)
    buffer = await store.get(key, prototype=default_buffer_prototype(), byte_range=byte_range)
    if buffer is None:  # no shard file: zarr left out a shard whose every value is the fill value
        index = np.full((layout.chunks_per_shard, 2), EMPTY_CHUNK, dtype="<u8")
    else:
        raw = buffer.to_bytes()
        if len(raw) != size or buffer_checksum(raw[:-4]) != _CRC.unpack(raw[-4:])[0]:
            raise CorruptDataError(
                f"{where}: the index of shard {shard_no} is damaged ({len(raw)} bytes, expected {size} with a valid crc32c)"
            )
        index = np.frombuffer(raw[:-4], dtype="<u8").reshape(layout.chunks_per_shard, 2)
    cache[(key, shard_no)] = index
    return index
