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
the host (0.18 GB/s on the 16-core H100 host). Each inner chunk is a standard zstd frame (the
level, the content size in the header, no checksum: what zarr's zstd codec writes) followed by
its CRC-32C, so zarr, and any Zarr v3 reader, reads the array as before (tests/test_shard_writer.py
compares the chunks with zarr's: the same bytes where both link the same libzstd; a different
libzstd version may emit a different frame for the same data, never different data). The
sharding spec locates each chunk by the shard index and leaves the order of the chunks' bytes
free: zarr writes Morton order, this writer the index's C order or layer groups first.

Encoding (:func:`encode_batch_array`: the chunks compressed, the shard's bytes and the array's
``zarr.json`` built) and writing (:func:`write_encoded`) are apart so that a store encodes a
batch before taking its lock (:meth:`~r3rdma.store.local_store.LocalRoutingStore.prepare`): the
encoding needs nothing of the index, and holding the lock through it serialized every commit
behind the one being compressed.

Why the GIL shapes this module (issue #35 item 4): a store node's encoder, its writer thread
(the shard write, the index part) and its publisher (fsyncs) share one interpreter, and each
time a thread gives the GIL up (a system call, a compression) it queues to get it back. So:

- the batch's raw chunks are laid out once, contiguous, by the calling thread
  (:func:`_raw_chunks`, into a reused buffer), and every chunk is compressed by one call of
  python-zstandard's ``multi_compress_to_buffer``, on its own threads, without the GIL. The
  previous way, numcodecs' ``compress`` per chunk from a pool of Python threads, spent ~17 ms
  per 8 MB batch on 16 cores (H100 host) against ~5 ms for the compression itself: each
  chunk's Python and a fresh zstd context per call, behind the other threads' GIL turns;
- the shard is written with one ``writev`` of its pieces (each chunk and its CRC-32C as
  separate pieces: no copy to join them), the directories made top down and returned rather
  than walked; the CRCs are computed holding the GIL (a microsecond or two each).

Measured there (H100 host, 16 cores, 1.2 GB of the short-request mix in 8 MB batches, the
whole write path, each variant in turn three times in one machine session): 0.42-0.56 GB/s
before, 0.72-0.95 after, with the writer's three batches encoding at once and commits
published in groups (:mod:`r3rdma.write.writer`, :mod:`r3rdma.store.publishing`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
import zstandard
from crc32c import crc32c
from zarr.codecs import Crc32cCodec, ShardingCodecIndexLocation, ZstdCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

__all__ = ["zarr_codecs", "EncodedArray", "encode_batch_array", "write_encoded", "write_batch_array", "SHARD_KEY"]

SHARD_KEY = ("c", "0", "0", "0")  # the one shard of a [rows, L, K] array: chunk grid (0, 0, 0)

_THREADS = os.cpu_count() or 4  # compression threads per batch
# A batch is compressed by up to one thread per this many raw bytes (a commit of one short
# request compresses on the caller's thread: starting threads would cost more than it saves).
_BYTES_PER_THREAD = 256 << 10
_compressors = threading.local()  # per thread: {level: ZstdCompressor} (an instance is not thread safe)
_empty = np.empty  # where a batch's raw chunks are allocated (a test fills it with garbage first)
# Buffers one writev takes (POSIX guarantees 16; Linux has 1024).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16
# zarr.json of each (dtype, layers, top_k, layers per chunk, zstd level), as zarr
# writes it; a batch's own differs only in its row counts and chunk rows (see _metadata).
_metadata_templates: dict[tuple[str, int, int, int, int], str] = {}


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

    The chunks' raw bytes are laid out once on the caller's thread (:func:`_raw_chunks`),
    then compressed together, without the GIL (module docstring).
    """
    first = pieces[0][1]
    _, layers, top_k = first.shape
    chunk = max(1, min(chunk_rows, rows))
    count = -(-rows // chunk)
    per = layers if layers_per_chunk is None else max(1, min(layers_per_chunk, layers))
    groups = -(-layers // per)
    group_major = group_major and groups > 1  # one group: both orders are the same bytes
    n = count * groups
    size = chunk * per * top_k * first.dtype.itemsize  # each inner chunk's raw bytes
    if zstd_level > 0:
        # The raw chunks are needed only until they are compressed: a reused buffer (see _RawBuffers).
        buffer = _raw_buffers.take(n * size)
        try:
            raw = _raw_chunks(pieces, count, chunk, groups, per, group_major, buffer)
            flat = raw.reshape(-1).view(np.uint8)
            segments = np.empty((n, 2), dtype=np.uint64)
            segments[:, 0] = np.arange(0, n * size, size, dtype=np.uint64)
            segments[:, 1] = size
            threads = min(_THREADS, n, flat.size // _BYTES_PER_THREAD)
            # One call compresses every chunk, on its own threads without the GIL: with a
            # compression per chunk from a pool of Python threads (and a fresh zstd context per
            # call, as numcodecs makes), each chunk's hand-offs of the GIL queued behind the
            # others' and the node's writer and publisher, and an 8 MB batch took 17 ms on
            # 16 cores against 5.5 ms of zstd (H100 host).
            out = _compressor(zstd_level).multi_compress_to_buffer(
                zstandard.BufferWithSegments(flat.data, segments.tobytes()), threads=threads if threads > 1 else 0
            )
        finally:
            _raw_buffers.give(buffer)
        chunks: list[Any] = [out[k] for k in range(n)]
    else:  # the raw chunks are the shard's pieces: a buffer of their own
        flat = (
            _raw_chunks(pieces, count, chunk, groups, per, group_major, _empty(n * size, dtype=np.uint8))
            .reshape(-1)
            .view(np.uint8)
        )
        view = flat.data
        chunks = [view[k * size : (k + 1) * size] for k in range(n)]
    encoded: list[Any] = []
    for c in chunks:
        # gil_release_mode=0: a chunk's CRC takes a microsecond or two; giving the GIL up for
        # it costs more, in the wait to get it back beside a node's other threads.
        encoded += (c, crc32c(c, gil_release_mode=0).to_bytes(4, "little"))
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


def _raw_chunks(
    pieces: Sequence[tuple[int, np.ndarray]], count: int, chunk: int, groups: int, per: int, group_major: bool, buffer: np.ndarray
) -> np.ndarray:
    """The inner chunks' raw bytes, contiguous in the order they lie in the shard, in the
    first bytes of ``buffer`` (uint8, whatever it held): ``[count, groups, chunk, per, K]``
    (the index's order) or ``[groups, count, ...]`` (layer group major). Rows no piece covers
    and the padded layers past L hold the fill value 0.

    Each row chunk is filled from its pieces in one assignment per piece, on the caller's
    thread: spread over a pool of threads it took twice as long (H100 host, 16 cores: 3.0
    against 1.5 ms per 8 MB batch; the copies' Python queued for the GIL)."""
    first = pieces[0][1]
    _, layers, top_k = first.shape
    shape = (groups, count, chunk, per, top_k) if group_major else (count, groups, chunk, per, top_k)
    # Not zeroed first (that wrote every byte twice): the fill below zeroes only what no piece covers.
    raw = buffer[: int(np.prod(shape)) * first.dtype.itemsize].view(first.dtype).reshape(shape)
    full = layers // per  # whole layer groups; a last partial one holds layers full*per .. L-1
    # The pieces each chunk overlaps (pieces are in row order).
    spans: list[list[int]] = [[] for _ in range(count)]
    for k, (offset, data) in enumerate(pieces):
        for i in range(offset // chunk, min(count, -(-(offset + len(data)) // chunk))):
            spans[i].append(k)
    for i in range(count):
        lo, hi = i * chunk, (i + 1) * chunk
        rows = (raw[:, i] if group_major else raw[i]).transpose(1, 0, 2, 3)  # [chunk, groups, per, K], a view
        done = lo  # rows below it are filled
        for k in spans[i]:
            offset, data = pieces[k]
            a, b = max(lo, offset), min(hi, offset + len(data))
            if a > done:
                rows[done - lo : a - lo] = 0  # fill rows between pieces
            src = data[a - offset : b - offset]
            if full:
                rows[a - lo : b - lo, :full] = src[:, : full * per].reshape(b - a, full, per, top_k)
            if full < groups:
                rows[a - lo : b - lo, full, : layers - full * per] = src[:, full * per :]
            done = b
        if done < hi:
            rows[done - lo :] = 0  # the last chunk's rows past the array's end
        if full < groups:
            rows[:, full, layers - full * per :] = 0  # the last group's layers past L
    return raw


class _RawBuffers:
    """Buffers for batches' raw chunks, reused: a fresh 8 MB array per batch cost its pages'
    first-touch faults on every batch (the fill of an 8 MB batch took ~5.5 ms on the 16 cores
    of an H100 host, most of an encode). A few are kept (batches encode one or two at a time
    per store: a writer's next batch, a node's connections), up to ``_KEEP_BYTES`` each."""

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least ``nbytes`` (a kept one if one is large enough)."""
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.size >= nbytes:
                    return self._free.pop(i)
        return _empty(-(-nbytes // _ROUND) * _ROUND, dtype=np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        """Return ``buffer`` for a later batch (kept if it is small enough and few are kept)."""
        if buffer.size <= _KEEP_BYTES:
            with self._lock:
                if len(self._free) < self._keep:
                    self._free.append(buffer)


_ROUND = 1 << 20  # buffers are whole MiB, so batches of slightly different sizes reuse them
_KEEP_BYTES = 64 << 20
_raw_buffers = _RawBuffers()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's zstd compressor of ``level`` (python-zstandard's instances are not thread
    safe, and a store encodes several batches at once)."""
    by_level = getattr(_compressors, "by_level", None)
    if by_level is None:
        by_level = _compressors.by_level = {}
    compressor = by_level.get(level)
    if compressor is None:
        # No checksum, the content size in the frame header: the frame zarr's zstd codec writes.
        compressor = by_level[level] = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
    return compressor


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
    geometry here (into memory); a batch's own differs in its row count, its inner chunks'
    rows (``chunk``: a batch smaller than ``chunk_rows`` is one chunk of its own rows) and its
    shard's (``count * chunk``) rows only. The document is serialized as zarr does once per
    geometry, with three marker numbers in those places, and each batch's is that text with
    its numbers in place of the markers (serializing it per batch, indented as zarr writes it,
    took ~0.3 ms of Python's pure-Python JSON encoder per commit; a template per row count of
    a small batch made most small commits build one, ~2 ms of Python each on the CPU VM).
    """
    key = (np.dtype(dtype).str, layers, top_k, per, zstd_level)
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
        (sharding,) = [c for c in doc["codecs"] if c["name"] == "sharding_indexed"]
        sharding["configuration"]["chunk_shape"][0] = _CHUNK_ROWS_MARK
        text = json.dumps(doc, allow_nan=True, indent=zarr.config.get("json_indent"))
        if any(text.count(str(mark)) != 1 for mark in (_ROWS_MARK, _SHARD_ROWS_MARK, _CHUNK_ROWS_MARK)):
            raise AssertionError("zarr.json template: a marker number is not unique in the document")
        template = _metadata_templates[key] = text
    return (
        template.replace(str(_ROWS_MARK), str(rows))
        .replace(str(_SHARD_ROWS_MARK), str(count * chunk))
        .replace(str(_CHUNK_ROWS_MARK), str(chunk))
        .encode()
    )


# Numbers no zarr.json holds otherwise: where a batch's row counts go in the template.
_ROWS_MARK = 918273645546372819
_SHARD_ROWS_MARK = 918273645546372818
_CHUNK_ROWS_MARK = 918273645546372817
