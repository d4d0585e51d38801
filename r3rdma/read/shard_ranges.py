"""Row ranges of r3rdma's batch arrays, read as few ranged GETs per shard, decoded by worker threads
straight into the caller's arrays.

Why not ``zarr.AsyncArray.getitem`` for this layout: zarr-python 3.1 reads part of a shard as
one awaited GET per inner chunk, one after another, re-reads the shard index on every call,
and runs each chunk through its single event-loop thread. On a data-parallel rank's scattered
share (a few requests from every batch array) it read 0.19-0.21 GB/s on a 16-core H100 host,
and 0.44-0.56 GB/s on contiguous reads, whatever its ``async.concurrency``; plain GETs of the
same files ran at 2.5-2.8 GB/s (BENCHMARKS.md "Read at scale" has the A/B). Here, per array:
the shard index is fetched once per reader (arrays are immutable), every inner chunk the
ranges need is planned first (:func:`plan_read`), chunks that lie close together in the file
are fetched as one ranged GET (:func:`fetch_run`: ``store.get`` with a byte range, r3rdma's
HTTP client, obstore, local files, any zarr store), a read's GETs at once, and chunks are
checked (CRC-32C) and decoded (zstd, releasing the GIL) by :mod:`r3rdma.read.jobs`' workers
(a short span's on the event loop, as it arrives), each chunk's rows copied once, into the
array the caller returns. Exactly the layout r3rdma writes (:mod:`r3rdma.read.shard_layout`:
sharded on tokens, ``bytes`` [+ ``zstd``] + ``crc32c`` inner codecs, index at the start or
end); anything else goes through zarr.

Layer groups (format 3): an inner chunk holds ``chunk_rows`` rows of ``layer_chunk`` layers
(one shard spans every layer, the last group padded with the fill value). A read may name
the MoE layer positions it wants (``layers``): only the chunks holding them are fetched and
decoded, and chunks of one row chunk's layer groups are fetched together only when every
group is wanted (a skipped group between them is not fetched). A chunk is numbered
``row_chunk * layer_chunks + group``: zarr's shard index order (C order over the chunk grid),
whatever the order the chunks' bytes lie in. Format 4 lays an array of long requests out
layer group major (group, then row chunk): a stage's chunks over a request's rows touch in the
file and are one GET. Plans go by where chunks lie (the shard index's offsets, or the ones an
index part's sizes give in their stated order): wanted chunks that touch share a GET; across a
gap, in a layer-group-major shard, only chunks of the same group do (between two groups'
chunks of a request lie every other row of the array: a whole read of a request is one GET
per layer group, not most of the array).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import zstandard
from zarr.abc.store import RangeByteRequest

from r3rdma.errors import CorruptDataError
from r3rdma.read.jobs import JobBatch
from r3rdma.read.shard_layout import EMPTY_CHUNK, ShardLayout, shard_index, shard_index_of

# shard_index_of and ShardLayout are imported from here too, as before they had a module of their own.
__all__ = ["ShardLayout", "Piece", "ArrayRead", "plan_read", "fetch_run", "shard_index_of"]

_GAP = 1 << 20  # chunks closer than this in the file are fetched in one GET (fewer requests win)
_SPAN = 1 << 62  # any gap: a shard's wanted chunks in one GET
_JOB_BYTES = 1 << 19
_NO_BYTES = np.empty(0, dtype=np.uint8)


Piece = tuple[int, int, np.ndarray]
"""Rows ``lo:hi`` of an array and where they go: an array ``[hi - lo, layers read, K]``."""


@dataclass(frozen=True, slots=True)
class _Pick:
    """Which layers of each layer group a read wants: ``groups[g] = (src, dst)``, the layers
    of group ``g``'s chunks to copy (``src``, within the chunk) and where they go in the
    output (``dst``); slices where contiguous (a plain strided copy), index arrays otherwise."""

    width: int  # layers per output row
    groups: dict[int, tuple[slice | np.ndarray, slice | np.ndarray]]
    every: bool  # every group wanted (chunks of a row chunk lie together in the file)


def _pick(layout: ShardLayout, layers: np.ndarray | None) -> _Pick:
    return _pick_of(layout, None if layers is None else tuple(layers.tolist()))


@functools.lru_cache(maxsize=256)
def _pick_of(layout: ShardLayout, layers: tuple[int, ...] | None) -> _Pick:
    """The pick of ``layers`` (kept: a trainer rank reads the same layers of every array)."""
    per = layout.layers_per_chunk
    if layers is None:
        groups: dict[int, tuple[slice | np.ndarray, slice | np.ndarray]] = {
            g: (slice(0, min(per, layout.row_shape[0] - g * per)), slice(g * per, min((g + 1) * per, layout.row_shape[0])))
            for g in range(layout.layer_chunks)
        }
        return _Pick(layout.row_shape[0], groups, True)
    picked: dict[int, tuple[list[int], list[int]]] = {}
    for dst, layer in enumerate(layers):
        src, dsts = picked.setdefault(layer // per, ([], []))
        src.append(layer % per)
        dsts.append(dst)
    out: dict[int, tuple[slice | np.ndarray, slice | np.ndarray]] = {}
    for g, (src, dsts) in picked.items():
        out[g] = (_as_slice(src), _as_slice(dsts))
    return _Pick(len(layers), out, len(out) == layout.layer_chunks)


def _as_slice(values: list[int]) -> slice | np.ndarray:
    if values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return np.asarray(values, dtype=np.intp)


@dataclass(eq=False, slots=True)
class ArrayRead:
    """One array's part of a read, planned by :func:`plan_read`: the GETs to make (``runs``,
    each ``(key, shard, [(offset, end, chunk), ...])``) and where each chunk's rows go
    (``wanted``: chunk -> the pieces that want rows of it). ``error``: the first failure of
    its GETs or decodes (the read's other arrays go on)."""

    store: Any
    layout: ShardLayout
    pick: _Pick
    pieces: Sequence[Piece]
    wanted: dict[int, list[int]]
    runs: list[tuple[str, int, list[tuple[int, int, int]]]]
    where: str
    error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        """Record ``error`` unless an earlier one is (the first failure says what happened)."""
        if self.error is None:
            self.error = error


async def plan_read(
    store: Any,
    path: str,
    layout: ShardLayout,
    pieces: Sequence[Piece],
    indexes: dict[tuple[str, int], np.ndarray],
    where: str,
    layers: np.ndarray | None = None,
    *,
    exact: bool = False,
    span: bool = False,
) -> ArrayRead:
    """Plan reading rows ``lo:hi`` of the array at ``path`` in ``store`` into ``out``, for each
    ``(lo, hi, out)`` of ``pieces``; with ``layers`` (MoE layer positions, in the order wanted)
    only those layers, from the inner chunks that hold them. Each chunk is fetched and decoded
    once, whatever number of pieces share it; its rows land in their outputs directly
    (:func:`fetch_run` does the GETs). Chunks zarr left out (all fill value) are filled here.

    Which GETs: ``span``, the wanted chunks of a shard in one GET (most of the array is wanted:
    the bytes between them cost less than more requests); ``exact``, no chunk that is not
    wanted (a trainer rank's slice: the chunks between its own are other ranks'); else chunks
    of one layer group closer than 1 MiB in the file share a GET. Chunks that touch in the
    file always do. ``indexes`` caches shard indexes (by path and
    shard number) across calls; one not there yet is fetched. Store errors propagate (the
    caller says what they mean); a damaged shard index raises :class:`CorruptDataError`
    naming ``where``."""
    pick = _pick(layout, layers)
    chunk_rows, groups, per_shard = layout.chunk_rows, layout.layer_chunks, layout.chunks_per_shard
    picked = tuple(pick.groups)
    wanted: dict[int, list[int]] = {}  # chunk number -> pieces that need rows of it
    for i, (lo, hi, _) in enumerate(pieces):
        for row_chunk in range(lo // chunk_rows, -(-hi // chunk_rows)):
            base = row_chunk * groups
            for g in picked:
                users = wanted.get(base + g)
                if users is None:
                    wanted[base + g] = [i]
                else:
                    users.append(i)
    by_shard: dict[int, list[int]] = {}
    for chunk in sorted(wanted):
        by_shard.setdefault(chunk // per_shard, []).append(chunk)
    # With layers skipped or an exact read, only chunks that touch share a GET (a skipped
    # chunk between two wanted ones is not fetched).
    gap = _SPAN if span else _GAP if pick.every and not exact else 0
    # Layer group major, chunks of two groups share a GET only where they touch (module
    # docstring); and a group's bytes between two requests are a 1/groups share of the rows
    # between them, so the gap shrinks alike: the same rows apart merge as in the index's order.
    across = 0 if layout.group_major else gap
    if layout.group_major and not span:
        gap //= groups
    runs: list[tuple[str, int, list[tuple[int, int, int]]]] = []
    for shard_no, chunks in by_shard.items():
        key = f"{path}/c/{shard_no}/0/0"
        index = indexes.get((key, shard_no))
        if index is None:
            index = await shard_index(store, key, layout, shard_no, indexes, where)
        stored = []
        for chunk in chunks:
            offset, nbytes = index[chunk % per_shard].tolist()
            if offset == EMPTY_CHUNK and nbytes == EMPTY_CHUNK:
                _place(layout, pick, chunk, None, pieces, wanted[chunk])
            else:
                stored.append((offset, offset + nbytes, chunk))
        stored.sort()
        for item in stored:  # chunks near each other in the file: one GET
            if runs and runs[-1][1] == shard_no:
                last = runs[-1][2][-1]
                limit = gap if (last[2] - item[2]) % groups == 0 else across
                if item[0] - last[1] <= limit:
                    runs[-1][2].append(item)
                    continue
            runs.append((key, shard_no, [item]))
    return ArrayRead(store, layout, pick, pieces, wanted, runs, where)


async def fetch_run(read: ArrayRead, run: tuple[str, int, list[tuple[int, int, int]]], batch: JobBatch, prototype: Any) -> None:
    """One GET of ``read``'s ``run``; its chunks are then checked and decoded by ``batch``'s
    workers (a span of one job's worth here, at once). Failures (the GET's, a decode's) are
    recorded on ``read``, not raised."""
    if read.error is not None:
        return  # the array failed already: its read is over
    key, shard_no, items = run
    start, end = items[0][0], items[-1][1]  # sorted by offset; chunks do not overlap (else: a CRC fails)
    try:
        buffer = await read.store.get(key, prototype=prototype, byte_range=RangeByteRequest(start, end))
    except Exception as e:  # the caller says what it means; cancellation is no failure of the array
        read.fail(e)
        return
    data = _NO_BYTES if buffer is None else buffer.as_numpy_array()
    if len(data) != end - start:
        read.fail(
            CorruptDataError(
                f"{read.where}: shard {shard_no} holds {start + len(data)} bytes; its index lists chunks up to byte {end}"
            )
        )
        return
    # Decode jobs of about _JOB_BYTES decoded bytes: a long span's chunks decode on all cores
    # at once. A span of one job's worth (a trainer rank's slice is a GET of ~100-400 KB) is
    # decoded here as it arrives: handing it to a worker and being told back cost more CPU
    # than the parallelism won. Measured with bench trainer-layout at full size (H100 host,
    # 16 cores, 8 reader processes, 2026-11-27): a rank's slice 5.4 -> 4.0 core-s/GB
    # (--slice-layout, zstd 3), 8.8 -> 6.6 (the default layout), whole reads 4.8 -> 4.3; and
    # the reads took no longer.
    per_job = max(1, _JOB_BYTES // read.layout.chunk_bytes)
    if len(items) <= per_job:
        _decode(read, data, start, items)
        return
    for i in range(0, len(items), per_job):
        batch.put(_decode, read, data, start, items[i : i + per_job])


def _decode(read: ArrayRead, data: np.ndarray, start: int, items: list[tuple[int, int, int]]) -> None:
    """Check and decode each chunk of one fetched byte span (a worker's job), its rows copied
    into the pieces that want them; a failure is recorded on ``read``.

    Chunks of one layer group over consecutive row chunks (a layer-group-major shard's run,
    or any run of a one-group array) are decoded one after another into one block and placed
    with one copy per piece: per chunk, a copy into each piece's rows and its Python around it
    cost ~12 us on the CPU VM, as much as decoding 10 KB."""
    if read.error is not None:
        return
    layout, where = read.layout, read.where
    groups, chunk_rows = layout.layer_chunks, layout.chunk_rows
    shape = (chunk_rows, layout.layers_per_chunk, layout.row_shape[1])
    try:
        k = 0
        while k < len(items):
            n = 1  # the chunks from k on that continue one group's rows
            while k + n < len(items) and items[k + n][2] == items[k][2] + n * groups:
                n += 1
            block = np.empty((n * chunk_rows, *shape[1:]), dtype=layout.dtype) if n > 1 else None
            for m in range(n):
                offset, end, chunk = items[k + m]
                a, b = offset - start, end - start - 4
                if b < a or _crc_with_gil(data[a:b]) != int.from_bytes(data[b : b + 4], "little"):
                    raise CorruptDataError(f"{where}: chunk {chunk} fails its crc32c")
                out = None if block is None else block[m * chunk_rows : (m + 1) * chunk_rows].reshape(-1).view(np.uint8)
                if layout.zstd:
                    try:
                        raw = _zstd_decode(data[a:b], out, layout.chunk_bytes)
                    except zstandard.ZstdError as e:
                        raise CorruptDataError(f"{where}: chunk {chunk} is not a valid zstd frame: {e}") from e
                else:
                    raw = data[a:b]
                    if out is not None and len(raw) == len(out):
                        out[:] = raw
                if len(raw) != layout.chunk_bytes:  # edge chunks are stored padded to full size
                    raise CorruptDataError(f"{where}: chunk {chunk} decodes to {len(raw)} bytes, expected {layout.chunk_bytes}")
                if block is None:  # a chunk alone: placed from its own bytes
                    rows = np.frombuffer(raw, dtype=layout.dtype).reshape(shape)
                    _place(layout, read.pick, chunk, rows, read.pieces, read.wanted[chunk])
            if block is not None:
                first = items[k][2]
                which = sorted({i for m in range(n) for i in read.wanted[first + m * groups]})
                _place(layout, read.pick, first, block, read.pieces, which)
            k += n
    except Exception as e:
        read.fail(e)


def _zstd_decode(frame: Any, out: np.ndarray | None, size: int) -> Any:
    """A zstd frame decoded into ``out`` (uint8; returned as the part written) or, without
    ``out``, into new bytes of at most ``size`` (a chunk's bytes).

    python-zstandard with a decompressor kept per thread, not numcodecs' ``Zstd.decode``: that
    makes a zstd context per call, ~10 us of a 24 KB chunk's ~30 (the slice layout's chunks,
    CPU VM: 31 -> 20 us; a 98 KB chunk 90 -> 86 us)."""
    d = getattr(_decompressors, "d", None)
    if d is None:
        d = _decompressors.d = zstandard.ZstdDecompressor()
    if out is None:
        return d.decompress(frame, max_output_size=size)
    view, n = out.data, 0
    with d.stream_reader(frame) as reader:
        while n < len(out):
            k = reader.readinto(view[n:])
            if not k:
                break
            n += k
        if n == len(out) and reader.read(1):
            return bytes(n + 1)  # longer than a chunk: the caller's size check names it
    return view[:n]


_decompressors = threading.local()  # a zstandard decompressor per thread (not thread safe)


def _crc_with_gil(buf: Any) -> int:
    """CRC-32C of a chunk, holding the GIL for its few microseconds: releasing it and taking it
    back costs more when the event loop and other workers want it."""
    return int(crc32c.crc32c(buf, 0, 0))


def _place(
    layout: ShardLayout,
    pick: _Pick,
    chunk: int,
    rows: np.ndarray | None,
    pieces: Sequence[Piece],
    which: list[int],
) -> None:
    """Chunk ``chunk``'s rows (None: a chunk left out, every value the fill value), or those of
    it and the chunks of its group after it that ``rows`` holds, into the pieces ``which`` that
    want some of them."""
    row_chunk, group = divmod(chunk, layout.layer_chunks)
    src, dst = pick.groups[group]
    first = row_chunk * layout.chunk_rows
    last = first + (layout.chunk_rows if rows is None else len(rows))
    for i in which:
        lo, hi, out = pieces[i]
        a = lo if lo > first else first
        b = hi if hi < last else last
        if rows is None:
            out[a - lo : b - lo, dst] = layout.fill
        else:
            out[a - lo : b - lo, dst] = rows[a - first : b - first, src]
