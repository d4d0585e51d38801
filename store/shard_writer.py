"""Writing a batch array's single shard: zarr's own bytes, its chunks compressed in parallel.

A batch array is ``[rows, L, K]`` in one shard of ``chunk_rows``-row inner chunks, each zstd
then CRC-32C (:func:`zarr_codecs`), the shard index first (``index_location: start``). zarr
writes the array's ``zarr.json`` here; the shard file ``c/0/0/0`` is assembled by hand.

Why by hand: zarr-python 3.1's sharded write encodes a shard's inner chunks one after another
in effect (measured on the CPU VM, one 16 MB batch: 0.09 GB/s with zstd-3, 0.36 GB/s with no
compression at all, against 0.13 GB/s for zstd-3 on one core and 0.26 on both), and a store
node commits its batches one at a time, so a node ingested at one core's zstd rate whatever
the host (0.18 GB/s on the 16-core H100 host). numcodecs' Zstd releases the GIL, so inner
chunks compressed in a thread pool scale with the cores. The bytes are the ones zarr writes
for the same data and codecs (tests/test_shard_writer.py compares them byte for byte), so
zarr, and any Zarr v3 reader, reads the array as before.

Encoding (:func:`encode_batch_array`: the chunks compressed, the shard's bytes and the array's
``zarr.json`` built) and writing (:func:`write_encoded`) are apart so that a store encodes a
batch before taking its lock (:meth:`~r3rdma.store.local_store.LocalRoutingStore.prepare`): the
encoding needs nothing of the index, and holding the lock through it serialized every commit
behind the one being compressed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from crc32c import crc32c
from numcodecs import Zstd
from zarr.codecs import Crc32cCodec, ShardingCodecIndexLocation, ZstdCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

__all__ = ["zarr_codecs", "EncodedArray", "encode_batch_array", "write_encoded", "write_batch_array", "SHARD_KEY"]

SHARD_KEY = ("c", "0", "0", "0")  # the one shard of a [rows, L, K] array: chunk grid (0, 0, 0)

_pool: ThreadPoolExecutor | None = None
# zarr.json of each (dtype, layers, top_k, chunk rows, zstd level), as zarr writes it; a batch's
# own differs only in its row counts (see _metadata).
_metadata_templates: dict[tuple[str, int, int, int, int], dict[str, Any]] = {}


def zarr_codecs(zstd_level: int) -> list[Any]:
    """Chunk codecs of batch arrays: zstd, then a CRC-32C so zarr itself detects corrupt chunks."""
    codecs: list[Any] = [ZstdCodec(level=zstd_level)] if zstd_level > 0 else []
    return codecs + [Crc32cCodec()]


@dataclass(frozen=True, slots=True)
class EncodedArray:
    """A batch array's files, encoded and not yet written: ``metadata`` (its ``zarr.json``),
    ``shard`` (the pieces of its shard file, in order: the index, then each chunk) and
    ``places`` (the shard index as ``[offset, nbytes, ...]`` per chunk)."""

    rows: int
    chunk_rows: int
    metadata: bytes
    shard: list[bytes]
    places: list[int]


def encode_batch_array(pieces: Sequence[tuple[int, np.ndarray]], rows: int, *, chunk_rows: int, zstd_level: int) -> EncodedArray:
    """Encode an array of ``rows`` rows ``[rows, L, K]`` whose rows are ``pieces``: ``(offset,
    rows)`` in row order, not overlapping; rows no piece covers hold the fill value 0.

    Each chunk is gathered from its pieces in the encoding thread that compresses it (a chunk
    inside one piece is a view of it): no whole-batch copy on the caller's thread.
    """
    first = pieces[0][1]
    _, layers, top_k = first.shape
    chunk = max(1, min(chunk_rows, rows))
    count = -(-rows // chunk)
    codec = Zstd(level=zstd_level) if zstd_level > 0 else None
    # The pieces each chunk overlaps (pieces are in row order).
    spans: list[list[int]] = [[] for _ in range(count)]
    for k, (offset, data) in enumerate(pieces):
        for i in range(offset // chunk, min(count, -(-(offset + len(data)) // chunk))):
            spans[i].append(k)

    def encode(i: int) -> bytes:
        lo, hi = i * chunk, (i + 1) * chunk
        block: np.ndarray | None = None
        if len(spans[i]) == 1:
            offset, data = pieces[spans[i][0]]
            if offset <= lo and hi <= offset + len(data):
                block = np.ascontiguousarray(data[lo - offset : hi - offset])
        if block is None:  # rows of several pieces, or fill rows: the chunk stored whole
            block = np.zeros((chunk, layers, top_k), dtype=first.dtype)
            for k in spans[i]:
                offset, data = pieces[k]
                a, b = max(lo, offset), min(hi, offset + len(data))
                block[a - lo : b - lo] = data[a - offset : b - offset]
        raw = block.tobytes() if codec is None else codec.encode(block)
        return raw + crc32c(raw).to_bytes(4, "little")

    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 4, thread_name_prefix="r3rdma-encode")
    encoded = list(_pool.map(encode, range(count))) if count > 1 else [encode(0)]
    # The shard index (zarr's default index codecs: little-endian uint64 pairs, then CRC-32C).
    index = np.empty((count, 2), dtype="<u8")
    offset = 16 * count + 4
    for i, piece in enumerate(encoded):
        index[i] = (offset, len(piece))
        offset += len(piece)
    index_bytes = index.tobytes()
    metadata = _metadata(first.dtype, rows, layers, top_k, chunk, count, zstd_level)
    places = index.astype(np.int64).reshape(-1).tolist()
    return EncodedArray(rows, chunk, metadata, [index_bytes + crc32c(index_bytes).to_bytes(4, "little"), *encoded], places)


def write_encoded(path: Path, encoded: EncodedArray) -> None:
    """Write an encoded array at ``path`` (its ``zarr.json`` and its shard file; not fsynced)."""
    shard = path.joinpath(*SHARD_KEY)
    shard.parent.mkdir(parents=True, exist_ok=True)
    (path / "zarr.json").write_bytes(encoded.metadata)
    with open(shard, "wb") as f:
        f.writelines(encoded.shard)


def write_batch_array(path: Path, data: np.ndarray, *, chunk_rows: int, zstd_level: int) -> list[int]:
    """Write ``data`` ``[rows, L, K]`` as a Zarr v3 array at ``path`` (one shard of
    ``chunk_rows``-row chunks); return the shard index as ``[offset, nbytes, ...]`` per chunk."""
    encoded = encode_batch_array([(0, data)], data.shape[0], chunk_rows=chunk_rows, zstd_level=zstd_level)
    write_encoded(path, encoded)
    return encoded.places


def _metadata(dtype: np.dtype, rows: int, layers: int, top_k: int, chunk: int, count: int, zstd_level: int) -> bytes:
    """The array's ``zarr.json``, byte for byte zarr's.

    Why not ``zarr.create_array`` per batch: it cost ~3 ms of each commit (on the CPU VM),
    serial work between two batches' compressions. zarr writes the document once per
    geometry here (into memory); a batch's own differs in its row count and its shard's
    (``count * chunk``) rows, set in the same document and serialized as zarr does.
    """
    key = (np.dtype(dtype).str, layers, top_k, chunk, zstd_level)
    template = _metadata_templates.get(key)
    if template is None:
        array = zarr.create_array(
            MemoryStore(),
            shape=(chunk, layers, top_k),
            dtype=dtype,
            chunks=(chunk, layers, top_k),
            # Index first: a partial read gets the shard index with the shard's first bytes (one
            # ranged GET from offset 0), and a streaming reader knows every chunk's place early.
            shards={"shape": (chunk, layers, top_k), "index_location": ShardingCodecIndexLocation.start},
            compressors=zarr_codecs(zstd_level),
            dimension_names=("token", "layer", "k"),
            fill_value=0,
        )
        template = json.loads(array.metadata.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes())
        _metadata_templates[key] = template
    doc = json.loads(json.dumps(template))  # a fresh copy: the template is shared
    doc["shape"][0] = rows
    doc["chunk_grid"]["configuration"]["chunk_shape"][0] = count * chunk
    return json.dumps(doc, allow_nan=True, indent=zarr.config.get("json_indent")).encode()
