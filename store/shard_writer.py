"""Writing a batch array's single shard: zarr's own bytes, its chunks compressed in parallel.

A batch array is ``[rows, L, K]`` in one shard of inner chunks of ``chunk_rows`` rows by
``layers_per_chunk`` layers (format 3: a pipeline stage reads its layers without its
neighbours'; the last layer group is padded with the fill value, the shard spans
``ceil(L / layers_per_chunk) * layers_per_chunk`` layers), each zstd then CRC-32C
(:func:`zarr_codecs`), the shard index first (``index_location: start``), chunks back to back
in one of two orders: the index's (row chunk, then layer group), or layer group major (layer
group, then row chunk: format 4, where requests span several row chunks, so that a pipeline
stage's chunks over a request's rows are one byte range, one ranged GET; the index still says
where every chunk is, so any Zarr v3 reader reads either). zarr writes the array's
``zarr.json`` here; the shard file ``c/0/0/0`` is assembled by hand.

Why by hand: zarr-python 3.1's sharded write encodes a shard's inner chunks one after another
in effect (measured on the CPU VM, one 16 MB batch: 0.09 GB/s with zstd-3, 0.36 GB/s with no
compression at all, against 0.13 GB/s for zstd-3 on one core and 0.26 on both), and a store
node commits its batches one at a time, so a node ingested at one core's zstd rate whatever
the host (0.18 GB/s on the 16-core H100 host). numcodecs' Zstd releases the GIL, so inner
chunks compressed in a thread pool scale with the cores. The bytes are the ones zarr writes
for the same data and codecs (tests/test_shard_writer.py compares them byte for byte; with
several layer groups each chunk's bytes are zarr's, and zarr orders them in Morton order where
this writer keeps the index's C order or puts layer groups first), so zarr, and any Zarr v3
reader, reads the array as before: the sharding spec locates each chunk by the shard index
and leaves the order of the chunks' bytes free.

Encoding (:func:`encode_batch_array`: the chunks compressed, the shard's bytes and the array's
``zarr.json`` built) and writing (:func:`write_encoded`) are apart so that a store encodes a
batch before taking its lock (:meth:`~r3rdma.store.local_store.LocalRoutingStore.prepare`): the
encoding needs nothing of the index, and holding the lock through it serialized every commit
behind the one being compressed.

Why so few GIL hand-offs (issue #35 item 4): on a 16-core host a store node's writer thread
(the shard write, the index part) runs beside 16 encoding threads, and each time one of them
gives the GIL up (a system call, a compression) it queues to get it back. Measured there (H100
host, 8 MB batches of the short-request mix, each stage timed inside a running ingest): the
write stage took 12-14 ms per batch beside the encoders against 3.5 ms alone, and bounded the
node at ~0.5 GB/s. So the shard is written with one ``writev`` of its pieces (each chunk and
its CRC-32C as separate pieces: no copy to join them), the directories are made top down (no
failed ``mkdir`` first) and returned rather than walked; an encoding thread holds the GIL
through the CRC (a few microseconds) rather than giving it up; and each pool thread takes row
chunks until none is left (one task per thread, not a task and a future per chunk). There,
alternating with the code before: write stage 6.7-7.9 ms, ingest 0.64-0.81 GB/s against
0.48-0.55, and a batch encoded alone at the rate of its chunks compressed in one pool map
(1.2-1.4 GB/s). Left: the encoder is now the busy stage (~97% of the time), still ~30% slower
beside the write and the publisher's fsyncs than alone.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from crc32c import crc32c
from numcodecs.zstd import compress as zstd_compress
from zarr.codecs import Crc32cCodec, ShardingCodecIndexLocation, ZstdCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from r3rdma.store.pools import submit

__all__ = ["zarr_codecs", "EncodedArray", "encode_batch_array", "write_encoded", "write_batch_array", "SHARD_KEY"]

SHARD_KEY = ("c", "0", "0", "0")  # the one shard of a [rows, L, K] array: chunk grid (0, 0, 0)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()  # a store may encode two batches at once (two connections)
_POOL_THREADS = os.cpu_count() or 4
# Buffers one writev takes (POSIX guarantees 16; Linux has 1024).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16
# zarr.json of each (dtype, layers, top_k, chunk rows, layers per chunk, zstd level), as zarr
# writes it; a batch's own differs only in its row counts (see _metadata).
_metadata_templates: dict[tuple[str, int, int, int, int, int], str] = {}


def zarr_codecs(zstd_level: int) -> list[Any]:
    """Chunk codecs of batch arrays: zstd, then a CRC-32C so zarr itself detects corrupt chunks."""
    codecs: list[Any] = [ZstdCodec(level=zstd_level)] if zstd_level > 0 else []
    return codecs + [Crc32cCodec()]


@dataclass(frozen=True, slots=True)
class EncodedArray:
    """A batch array's files, encoded and not yet written: ``metadata`` (its ``zarr.json``),
    ``shard`` (the pieces of its shard file, in order: the index with its CRC-32C, then each
    chunk's compressed bytes followed by its 4-byte CRC-32C as a piece of its own),
    ``places`` (the shard index as ``[offset, nbytes, ...]`` per chunk, in the index's order)
    and ``sizes`` (each chunk's bytes, in the order they lie in the shard: the index's, or layer
    group major when ``group_major``)."""

    rows: int
    chunk_rows: int
    layers_per_chunk: int
    group_major: bool
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
    group_major: bool = False,
) -> EncodedArray:
    """Encode an array of ``rows`` rows ``[rows, L, K]`` whose rows are ``pieces``: ``(offset,
    rows)`` in row order, not overlapping; rows no piece covers hold the fill value 0.
    ``layers_per_chunk``: layers per inner chunk (None: all, the layout before format 3).
    ``group_major``: the chunks lie in the shard layer group by layer group, each group's row
    chunks in row order (format 4), else in the index's order (row chunk, then layer group).

    Each chunk is gathered from its pieces in the encoding thread that compresses it (a chunk
    inside one piece is a view of it): no whole-batch copy on the caller's thread.
    """
    first = pieces[0][1]
    _, layers, top_k = first.shape
    chunk = max(1, min(chunk_rows, rows))
    count = -(-rows // chunk)
    per = layers if layers_per_chunk is None else max(1, min(layers_per_chunk, layers))
    groups = -(-layers // per)
    padded = groups * per  # the shard's layers: whole groups, the last one padded past L
    # The pieces each chunk overlaps (pieces are in row order).
    spans: list[list[int]] = [[] for _ in range(count)]
    for k, (offset, data) in enumerate(pieces):
        for i in range(offset // chunk, min(count, -(-(offset + len(data)) // chunk))):
            spans[i].append(k)

    def gather(i: int) -> np.ndarray:
        """Row chunk ``i``, ``[chunk, padded, K]``: a view of its piece when one piece covers
        it (and no layer is padded), else a copy holding the fill value where no piece is."""
        lo, hi = i * chunk, (i + 1) * chunk
        if len(spans[i]) == 1 and padded == layers:
            offset, data = pieces[spans[i][0]]
            if offset <= lo and hi <= offset + len(data):
                return data[lo - offset : hi - offset]
        block = np.zeros((chunk, padded, top_k), dtype=first.dtype)
        for k in spans[i]:
            offset, data = pieces[k]
            a, b = max(lo, offset), min(hi, offset + len(data))
            block[a - lo : b - lo, :layers] = data[a - offset : b - offset]
        return block

    def encode(i: int) -> list[bytes]:
        """Row chunk ``i``'s inner chunks, one per layer group, each followed by its CRC-32C."""
        block = gather(i)
        # Each group's layers contiguous: [groups, chunk, per, K], one copy for all of them.
        grouped = np.ascontiguousarray(block.reshape(chunk, groups, per, top_k).transpose(1, 0, 2, 3))
        out: list[bytes] = []
        for part in grouped:
            raw = zstd_compress(part, zstd_level) if zstd_level > 0 else part.tobytes()
            # gil_release_mode=0: a ~150 KB CRC takes microseconds; giving the GIL up for it
            # costs more, in the wait to get it back beside the other encoding threads.
            out += (raw, crc32c(raw, gil_release_mode=0).to_bytes(4, "little"))
        return out

    by_row: list[list[bytes]] = [[] for _ in range(count)]
    todo = collections.deque(range(count))  # row chunks not yet taken (popleft is thread-safe)

    def work() -> None:
        """Encode row chunks until none is left: one pool task per thread, not per chunk."""
        while True:
            try:
                i = todo.popleft()
            except IndexError:
                return
            by_row[i] = encode(i)

    if count > 1:
        pool = _encode_pool()
        for future in [submit(pool, work) for _ in range(min(count, _POOL_THREADS))]:
            future.result()
    else:
        work()
    group_major = group_major and groups > 1  # one group: both orders are the same bytes
    if group_major:
        encoded = [by_row[i][k] for g in range(groups) for i in range(count) for k in (2 * g, 2 * g + 1)]
    else:
        encoded = [piece for pieces_of_row in by_row for piece in pieces_of_row]
    # Each chunk's bytes with its CRC-32C, in the order written, and where each one starts.
    sizes = np.fromiter(map(len, encoded[::2]), dtype="<u8", count=len(encoded) // 2) + 4
    starts = np.empty_like(sizes)
    starts[0] = 16 * len(sizes) + 4  # after the shard index: (offset, nbytes) per chunk, then a CRC-32C
    np.cumsum(sizes[:-1], out=starts[1:])
    starts[1:] += starts[0]
    # The shard index (zarr's default index codecs: little-endian uint64 pairs, then CRC-32C),
    # over the inner chunk grid (count, groups, 1) in C order, whatever the order written.
    index = np.empty((len(sizes), 2), dtype="<u8")
    index[:, 0] = starts.reshape(groups, count).T.reshape(-1) if group_major else starts
    index[:, 1] = sizes.reshape(groups, count).T.reshape(-1) if group_major else sizes
    index_bytes = index.tobytes()
    metadata = _metadata(first.dtype, rows, layers, top_k, chunk, count, zstd_level, per)
    places = index.astype(np.int64).reshape(-1).tolist()
    return EncodedArray(
        rows,
        chunk,
        per,
        group_major,
        metadata,
        [index_bytes + crc32c(index_bytes).to_bytes(4, "little"), *encoded],
        places,
        sizes.astype("<u4"),
    )


def _encode_pool() -> ThreadPoolExecutor:
    """The encoding threads, one per core (started with the first batch of several chunks)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_POOL_THREADS, thread_name_prefix="r3rdma-encode")
        return _pool


def write_encoded(path: Path, encoded: EncodedArray) -> list[Path]:
    """Write an encoded array at ``path`` (its ``zarr.json`` and its shard file; not fsynced);
    return the directories and files written, ``path`` first (what makes the array durable).

    The shard goes out in one ``writev`` (module docstring: each system call on the writing
    thread is a GIL hand-off that waits behind the encoding threads)."""
    path.mkdir(parents=True, exist_ok=True)  # one mkdir where its parent exists (a store's rollout)
    written = [path]
    for name in SHARD_KEY[:-1]:  # c, c/0, c/0/0: top down, no failed mkdir first
        written.append(written[-1] / name)
        try:
            os.mkdir(written[-1])
        except FileExistsError:
            pass
    shard = written[-1] / SHARD_KEY[-1]
    (path / "zarr.json").write_bytes(encoded.metadata)
    fd = os.open(shard, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, encoded.shard)
    finally:
        os.close(fd)
    return [*written, path / "zarr.json", shard]


def _write_all(fd: int, pieces: Sequence[bytes | memoryview]) -> None:
    """Write ``pieces`` to ``fd`` in order, with as few ``writev`` calls as the kernel allows
    (at most ``SC_IOV_MAX`` pieces each; a short write resumes where it stopped)."""
    left = list(pieces)
    while left:
        batch = left[:_IOV_MAX]
        written = os.writev(fd, batch)
        done = 0
        while done < len(batch) and written >= len(batch[done]):
            written -= len(batch[done])
            done += 1
        del left[:done]
        if written:  # a short write stopped inside this piece
            left[0] = memoryview(left[0])[written:]


def write_batch_array(
    path: Path,
    data: np.ndarray,
    *,
    chunk_rows: int,
    zstd_level: int,
    layers_per_chunk: int | None = None,
    group_major: bool = False,
) -> list[int]:
    """Write ``data`` ``[rows, L, K]`` as a Zarr v3 array at ``path`` (one shard of
    ``chunk_rows`` x ``layers_per_chunk`` chunks, layer group major when ``group_major``);
    return the shard index as ``[offset, nbytes, ...]`` per chunk."""
    encoded = encode_batch_array(
        [(0, data)],
        data.shape[0],
        chunk_rows=chunk_rows,
        zstd_level=zstd_level,
        layers_per_chunk=layers_per_chunk,
        group_major=group_major,
    )
    write_encoded(path, encoded)
    return encoded.places


def _metadata(dtype: np.dtype, rows: int, layers: int, top_k: int, chunk: int, count: int, zstd_level: int, per: int) -> bytes:
    """The array's ``zarr.json``, byte for byte zarr's.

    Why not ``zarr.create_array`` per batch: it cost ~3 ms of each commit (on the CPU VM),
    serial work between two batches' compressions. zarr writes the document once per
    geometry here (into memory); a batch's own differs in its row count and its shard's
    (``count * chunk``) rows only. The document is serialized as zarr does once per geometry,
    with two marker numbers in those places, and each batch's is that text with its numbers
    in place of the markers (serializing it per batch, indented as zarr writes it, took
    ~0.3 ms of Python's pure-Python JSON encoder per commit).
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
        doc = json.loads(array.metadata.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes())
        doc["shape"][0] = _ROWS_MARK
        doc["chunk_grid"]["configuration"]["chunk_shape"][0] = _SHARD_ROWS_MARK
        text = json.dumps(doc, allow_nan=True, indent=zarr.config.get("json_indent"))
        if text.count(str(_ROWS_MARK)) != 1 or text.count(str(_SHARD_ROWS_MARK)) != 1:
            raise AssertionError("zarr.json template: a marker number is not unique in the document")
        template = _metadata_templates[key] = text
    return template.replace(str(_ROWS_MARK), str(rows)).replace(str(_SHARD_ROWS_MARK), str(count * chunk)).encode()


# Numbers no zarr.json holds otherwise: where a batch's row counts go in the template.
_ROWS_MARK = 918273645546372819
_SHARD_ROWS_MARK = 918273645546372818
