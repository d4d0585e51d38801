"""Writing a batch array's single shard: zarr's own bytes, its chunks compressed in parallel.

A batch array is ``[rows, L, K]`` in one shard of inner chunks of ``chunk_rows`` rows by
``layers_per_chunk`` layers (format 3: a pipeline stage reads its layers without its
neighbours'; the last layer group is padded with the fill value, the shard spans
``ceil(L / layers_per_chunk) * layers_per_chunk`` layers), each zstd then CRC-32C
(:func:`zarr_codecs`), the shard index first (``index_location: start``), chunks back to back
in the index's order (row chunk, then layer group). zarr writes the array's ``zarr.json`` here;
the shard file ``c/0/0/0`` is assembled by hand.

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
# zarr.json of each (dtype, layers, top_k, chunk rows, layers per chunk, zstd level), as zarr
# writes it; a batch's own differs only in its row counts (see _metadata).
_metadata_templates: dict[tuple[str, int, int, int, int, int], dict[str, Any]] = {}


def zarr_codecs(zstd_level: int) -> list[Any]:
    """Chunk codecs of batch arrays: zstd, then a CRC-32C so zarr itself detects corrupt chunks."""
    codecs: list[Any] = [ZstdCodec(level=zstd_level)] if zstd_level > 0 else []
    return codecs + [Crc32cCodec()]


@dataclass(frozen=True, slots=True)
class EncodedArray:
    """A batch array's files, encoded and not yet written: ``metadata`` (its ``zarr.json``),
    ``shard`` (the pieces of its shard file, in order: the index, then each chunk),
    ``places`` (the shard index as ``[offset, nbytes, ...]`` per chunk) and ``sizes`` (each
    chunk's bytes, in the index's order)."""

    rows: int
    chunk_rows: int
    layers_per_chunk: int
    metadata: bytes
    shard: list[bytes]
    places: list[int]
    sizes: np.ndarray


def encode_batch_array(
    pieces: Sequence[tuple[int, np.ndarray]],
    rows: int,
    *,
    chunk_rows: int,
    zstd_level: int,
    layers_per_chunk: int | None = None,
) -> EncodedArray:
    """Encode an array of ``rows`` rows ``[rows, L, K]`` whose rows are ``pieces``: ``(offset,
    rows)`` in row order, not overlapping; rows no piece covers hold the fill value 0.
    ``layers_per_chunk``: layers per inner chunk (None: all, the layout before format 3).

    Each chunk is gathered from its pieces in the encoding thread that compresses it (a chunk
    inside one piece is a view of it): no whole-batch copy on the caller's thread.
    """
    first = pieces[0][1]
    _, layers, top_k = first.shape
    chunk = max(1, min(chunk_rows, rows))
    count = -(-rows // chunk)
    per = layers if layers_per_chunk is None else max(1, min(layers_per_chunk, layers))
    groups = -(-layers // per)
    codec = Zstd(level=zstd_level) if zstd_level > 0 else None
    # The pieces each chunk overlaps (pieces are in row order).
    spans: list[list[int]] = [[] for _ in range(count)]
    for k, (offset, data) in enumerate(pieces):
        for i in range(offset // chunk, min(count, -(-(offset + len(data)) // chunk))):
            spans[i].append(k)

    def encode(i: int) -> list[bytes]:
        """Row chunk ``i``'s inner chunks, one per layer group."""
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
        if groups > 1:
            # Each group's layers contiguous, in one buffer per row chunk (the last group
            # padded with the fill value to a whole chunk).
            grouped = np.empty((groups, chunk, per, top_k), dtype=block.dtype)
            if groups * per > layers:
                grouped[-1, :, layers - (groups - 1) * per :] = 0
            for g in range(groups):
                width = min(per, layers - g * per)
                grouped[g, :, :width] = block[:, g * per : g * per + width]
        else:
            grouped = block[None]
        out = []
        for part in grouped:
            raw = part.tobytes() if codec is None else codec.encode(part)
            out.append(raw + crc32c(raw).to_bytes(4, "little"))
        return out

    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 4, thread_name_prefix="r3rdma-encode")
    by_row = list(_pool.map(encode, range(count))) if count > 1 else [encode(0)]
    encoded = [piece for pieces_of_row in by_row for piece in pieces_of_row]
    # The shard index (zarr's default index codecs: little-endian uint64 pairs, then CRC-32C),
    # over the inner chunk grid (count, groups, 1) in C order: the order the chunks are written.
    sizes = np.fromiter(map(len, encoded), dtype="<u8", count=len(encoded))
    index = np.empty((len(encoded), 2), dtype="<u8")
    index[:, 1] = sizes
    index[0, 0] = 16 * len(encoded) + 4
    np.cumsum(sizes[:-1], out=index[1:, 0])
    index[1:, 0] += index[0, 0]
    index_bytes = index.tobytes()
    metadata = _metadata(first.dtype, rows, layers, top_k, chunk, count, zstd_level, per)
    places = index.astype(np.int64).reshape(-1).tolist()
    return EncodedArray(
        rows,
        chunk,
        per,
        metadata,
        [index_bytes + crc32c(index_bytes).to_bytes(4, "little"), *encoded],
        places,
        sizes.astype("<u4"),
    )


def write_encoded(path: Path, encoded: EncodedArray) -> None:
    """Write an encoded array at ``path`` (its ``zarr.json`` and its shard file; not fsynced)."""
    shard = path.joinpath(*SHARD_KEY)
    shard.parent.mkdir(parents=True, exist_ok=True)
    (path / "zarr.json").write_bytes(encoded.metadata)
    with open(shard, "wb") as f:
        f.writelines(encoded.shard)


def write_batch_array(
    path: Path, data: np.ndarray, *, chunk_rows: int, zstd_level: int, layers_per_chunk: int | None = None
) -> list[int]:
    """Write ``data`` ``[rows, L, K]`` as a Zarr v3 array at ``path`` (one shard of
    ``chunk_rows`` x ``layers_per_chunk`` chunks); return the shard index as ``[offset, nbytes,
    ...]`` per chunk."""
    encoded = encode_batch_array(
        [(0, data)], data.shape[0], chunk_rows=chunk_rows, zstd_level=zstd_level, layers_per_chunk=layers_per_chunk
    )
    write_encoded(path, encoded)
    return encoded.places


def _metadata(dtype: np.dtype, rows: int, layers: int, top_k: int, chunk: int, count: int, zstd_level: int, per: int) -> bytes:
    """The array's ``zarr.json``, byte for byte zarr's.

    Why not ``zarr.create_array`` per batch: it cost ~3 ms of each commit (on the CPU VM),
    serial work between two batches' compressions. zarr writes the document once per
    geometry here (into memory); a batch's own differs in its row count and its shard's
    (``count * chunk``) rows, set in the same document and serialized as zarr does.
    """
    key = (np.dtype(dtype).str, layers, top_k, chunk, per, zstd_level)
    template = _metadata_templates.get(key)
    if template is None:
        array = zarr.create_array(
            MemoryStore(),
            shape=(chunk, layers, top_k),
            dtype=dtype,
            chunks=(chunk, per, top_k),
            # Index first: a partial read gets the shard index with the shard's first bytes (one
            # ranged GET from offset 0), and a streaming reader knows every chunk's place early.
            # One shard spans every layer: whole layer groups (the last padded past L).
            shards={"shape": (chunk, -(-layers // per) * per, top_k), "index_location": ShardingCodecIndexLocation.start},
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
