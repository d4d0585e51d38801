"""Decoding whole shard files of the layout r3rdma writes, in parallel, without zarr's loop.

A remote reader fetches a batch array's shard files whole (one GET each) and must then
decode them. zarr-python 3.1 runs every inner chunk through its single asyncio loop
thread (with google_crc32c, which holds the GIL, on that thread): decoding one 13.5 MB
shard took 12-18 ms uncompressed and 32-51 ms with zstd-3 on the 2-core VM (this module:
~2 and ~12 ms), and did not speed up with more cores or parallel arrays; the read bench
measured 0.21-0.29 of a raw GET of the same files. This module decodes exactly one layout, the one ``LocalRoutingStore`` writes
(docs/FORMAT.md), and nothing else:

    sharding_indexed(chunk_shape, codecs=[bytes, zstd?, crc32c],
                     index_codecs=[bytes(little), crc32c], index_location=start|end)

per the Zarr v3 sharding spec: the shard starts (what LocalRoutingStore writes) or ends (what
it wrote before 2026-11-21, still read) with an index of (offset, nbytes) uint64 pairs, one per inner chunk in C order
(2**64-1 twice: chunk absent, fill value), followed by the index's CRC-32C; each inner chunk
is its zstd frame (or raw bytes) followed by its CRC-32C.
Inner chunks are checked and decompressed in a thread pool with ``crc32c`` and numcodecs'
zstd (zarr's own dependency), which both release the GIL. Any other metadata makes :meth:`ShardDecoder.of`
return None and the reader falls back to zarr; tests check both paths give the same bytes.
"""

from __future__ import annotations

import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Sequence

import numpy as np
from numcodecs import Zstd

from r3rdma.errors import CorruptDataError
from r3rdma.records import buffer_checksum

__all__ = ["ShardDecoder", "ChunkJob", "chunk_pool", "zstd_content_size"]

_EMPTY = 2**64 - 1
_CRC = struct.Struct("<I")
_DTYPES = {"uint8": "<u1", "uint16": "<u2", "int32": "<i4"}

_pool: ThreadPoolExecutor | None = None
_ZSTD = Zstd()  # decode only; stateless (a fresh decompression context per call)


class ChunkJob(NamedTuple):
    """One stored inner chunk: its bytes ``[offset, end)`` in the shard file and where it decodes
    to: ``target``, the bytes of the array's rows ``[first_row, end_row)``."""

    offset: int
    end: int
    target: np.ndarray
    where: str
    first_row: int
    end_row: int


def chunk_pool() -> ThreadPoolExecutor:
    """The process-wide pool that checks and decodes inner chunks (one thread per core)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="r3rdma-shard")
    return _pool


class ShardDecoder:
    """Decodes the shard files of one batch array (3-D: token, layer, k; sharded on tokens)."""

    def __init__(
        self, shape: tuple[int, ...], dtype: np.dtype, shard_rows: int, chunk_rows: int, zstd: bool, fill: int,
        *, index_at_start: bool = False,
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.shard_rows = shard_rows
        self.chunk_rows = chunk_rows
        self.zstd = zstd
        self.fill = fill
        self.index_at_start = index_at_start
        self.row_bytes = int(np.prod(shape[1:])) * dtype.itemsize
        self.chunks_per_shard = shard_rows // chunk_rows

    @classmethod
    def of(cls, metadata: dict[str, Any]) -> ShardDecoder | None:
        """A decoder for an array's ``zarr.json`` contents, or None if it is not our layout."""
        try:
            shape = tuple(metadata["shape"])
            dtype = metadata["data_type"]
            outer = tuple(metadata["chunk_grid"]["configuration"]["chunk_shape"])
            (sharding,) = metadata["codecs"]
            config = sharding["configuration"]
            inner = tuple(config["chunk_shape"])
            names = [c["name"] for c in config["codecs"]]
            index_codecs = config["index_codecs"]
        except (KeyError, TypeError, ValueError):
            return None
        ok = (
            metadata.get("zarr_format") == 3
            and metadata["chunk_grid"].get("name") == "regular"
            and metadata.get("chunk_key_encoding") == {"name": "default", "configuration": {"separator": "/"}}
            and sharding.get("name") == "sharding_indexed"
            and config.get("index_location", "end") in ("start", "end")
            and dtype in _DTYPES
            and len(shape) == 3 and outer[1:] == shape[1:] and inner[1:] == shape[1:]
            and outer[0] % inner[0] == 0
            and names in (["bytes", "crc32c"], ["bytes", "zstd", "crc32c"])
            and config["codecs"][0].get("configuration", {}).get("endian", "little") == "little"
            and [c["name"] for c in index_codecs] == ["bytes", "crc32c"]
            and index_codecs[0].get("configuration", {}).get("endian", "little") == "little"
            and isinstance(metadata.get("fill_value"), int)
            and not metadata.get("storage_transformers")
        )
        if not ok:
            return None
        return cls(
            shape, np.dtype(_DTYPES[dtype]), outer[0], inner[0], "zstd" in names, metadata["fill_value"],
            index_at_start=config.get("index_location", "end") == "start",
        )

    @property
    def num_shards(self) -> int:
        return -(-self.shape[0] // self.shard_rows)

    @property
    def index_bytes(self) -> int:
        """Size of a shard's index: (offset, nbytes) per inner chunk, then its CRC-32C."""
        return 16 * self.chunks_per_shard + 4

    def index_of(self, data: memoryview) -> memoryview:
        """The index bytes of a whole shard file: its first or its last ``index_bytes``."""
        return data[: self.index_bytes] if self.index_at_start else data[len(data) - self.index_bytes :]

    def decode_into(self, out: np.ndarray, shard_no: int, blob: bytes | memoryview | None, where: str) -> None:
        """Decode shard ``shard_no`` (its file's bytes, None if absent) into ``out``, the whole
        array's rows. Raises CorruptDataError naming ``where`` on any damage."""
        if blob is None:
            first = shard_no * self.shard_rows
            out[first : first + min(self.shard_rows, self.shape[0] - first)] = self.fill
            return
        data = memoryview(blob).cast("B")
        if len(data) < self.index_bytes:
            raise CorruptDataError(f"{where}: shard {shard_no} has {len(data)} bytes, less than its {self.index_bytes}-byte index")
        jobs = [
            chunk_pool().submit(self.decode_chunk, data[chunk.offset : chunk.end], chunk.target, chunk.where)
            for chunk in self.plan(out, shard_no, self.index_of(data), len(data), where)
        ]
        for job in jobs:
            job.result()  # re-raises the first CorruptDataError

    def plan(self, out: np.ndarray, shard_no: int, index_raw: bytes | memoryview, size: int, where: str) -> list["ChunkJob"]:
        """The stored inner chunks of shard ``shard_no`` (a file of ``size`` bytes whose index is
        ``index_raw``), in file order, each with the rows of ``out`` it decodes into. Chunks the
        index marks absent are filled with the fill value here. A streaming reader decodes each
        chunk as soon as its bytes have arrived; :meth:`decode_into` does them all at once."""
        index_raw = memoryview(index_raw).cast("B")
        if len(index_raw) != self.index_bytes or size < self.index_bytes:
            raise CorruptDataError(f"{where}: shard {shard_no} ({size} bytes) cannot hold its {self.index_bytes}-byte index")
        if buffer_checksum(index_raw[:-4]) != _CRC.unpack(index_raw[-4:])[0]:
            raise CorruptDataError(f"{where}: shard {shard_no} index fails its crc32c")
        index = np.frombuffer(index_raw[:-4], dtype="<u8").reshape(self.chunks_per_shard, 2)
        first = shard_no * self.shard_rows
        last = min(first + self.shard_rows, self.shape[0])
        flat = out.reshape(out.shape[0], -1).view(np.uint8).reshape(-1)  # rows of raw bytes
        jobs = []
        for c in range(self.chunks_per_shard):
            lo_row = first + c * self.chunk_rows
            if lo_row >= last:
                break
            hi_row = min(lo_row + self.chunk_rows, last)
            target = flat[lo_row * self.row_bytes : hi_row * self.row_bytes]
            offset, nbytes = (int(v) for v in index[c])
            if offset == _EMPTY and nbytes == _EMPTY:
                target.view(out.dtype)[:] = self.fill
                continue
            data_lo, data_hi = (self.index_bytes, size) if self.index_at_start else (0, size - self.index_bytes)
            if nbytes < 4 or offset < data_lo or offset + nbytes > data_hi:
                raise CorruptDataError(f"{where}: shard {shard_no} chunk {c} lies outside the shard ({offset}+{nbytes})")
            jobs.append(ChunkJob(offset, offset + nbytes, target, f"{where}: shard {shard_no} chunk {c}", lo_row, hi_row))
        return sorted(jobs, key=lambda job: job.end)

    def decode_chunk(self, encoded: memoryview, target: np.ndarray, where: str, check: bool = True) -> None:
        """Check and decode one inner chunk (its stored bytes, CRC-32C last) into ``target``.
        ``check=False`` skips the chunk's CRC-32C: for a caller that checks every row of
        ``target`` against CRCs of its own (a damaged zstd frame still fails to decode, or
        decodes to rows those CRCs refuse)."""
        body, crc = encoded[:-4], _CRC.unpack(encoded[-4:])[0]
        if check and buffer_checksum(body) != crc:
            raise CorruptDataError(f"{where} fails its crc32c")
        full = self.chunk_rows * self.row_bytes  # edge chunks are stored padded to full size
        if not self.zstd:
            raw = body
        elif target.nbytes == full and zstd_content_size(body) == full:
            # Straight into the caller's rows: no intermediate buffer, no copy. zstd itself
            # refuses a frame whose content differs from the size its header declares.
            try:
                _ZSTD.decode(body, out=target)
            except (RuntimeError, ValueError) as e:
                raise CorruptDataError(f"{where} is not a valid zstd frame: {e}") from e
            return
        else:
            try:
                raw = _ZSTD.decode(body)
            except RuntimeError as e:  # numcodecs: "Zstd decompression error: ..."
                raise CorruptDataError(f"{where} is not a valid zstd frame: {e}") from e
        if len(raw) != full:
            raise CorruptDataError(f"{where} decodes to {len(raw)} bytes, expected {full}")
        target[:] = np.frombuffer(raw, dtype=np.uint8, count=target.nbytes)

    def decode_chunks(self, work: Sequence[tuple[memoryview, np.ndarray, str, bool]]) -> None:
        """:meth:`decode_chunk` of each ``(encoded, target, where, check)``: one task of the
        chunk pool for a run of chunks (each task costs a GIL hand-off or two)."""
        for encoded, target, where, check in work:
            self.decode_chunk(encoded, target, where, check)

    def place_run(self, file: memoryview, run: Sequence[ChunkJob], rows: np.ndarray, check: Sequence[bool]) -> None:
        """Consecutive stored chunks of a shard laid out contiguously (:meth:`contiguous_layout`)
        into ``rows`` (the array's bytes, flat): the chunks ``check`` marks are checked against
        their CRC-32C first, then all full ones move in one strided copy (one GIL release for
        the run instead of one per chunk) and the padded edge chunk, if there, on its own."""
        stride = self.chunk_rows * self.row_bytes + 4
        for job, wanted in zip(run, check):
            if wanted and buffer_checksum(file[job.offset : job.end - 4]) != _CRC.unpack(file[job.end - 4 : job.end])[0]:
                raise CorruptDataError(f"{job.where} fails its crc32c")
        # Rows follow file order (contiguous_layout), so only the array's last chunk can be short.
        full = run[:-1] if run and run[-1].end_row - run[-1].first_row < self.chunk_rows else run
        if full:
            stored = np.frombuffer(file, dtype=np.uint8, count=len(full) * stride, offset=full[0].offset)
            dest = rows[full[0].first_row * self.row_bytes : full[-1].end_row * self.row_bytes]
            np.copyto(dest.reshape(len(full), stride - 4), stored.reshape(len(full), stride)[:, : stride - 4])
        for job in run[len(full) :]:  # the edge chunk: the array ends inside it
            job.target[:] = np.frombuffer(file, dtype=np.uint8, count=job.target.nbytes, offset=job.offset)

    def contiguous_layout(self, jobs: list[ChunkJob], size: int) -> bool:
        """Whether the stored chunks of a shard file of ``size`` bytes (``jobs``, from
        :meth:`plan`) can be placed in runs (:meth:`place_run`): uncompressed, index first,
        each chunk full-size, one after another to the file's end with no gap, the array's
        rows in file order."""
        full = self.chunk_rows * self.row_bytes + 4
        at = self.index_bytes
        for job in jobs:
            if job.offset != at or job.end - job.offset != full:
                return False
            at = job.end
        rows_in_order = all(a.end_row == b.first_row for a, b in zip(jobs, jobs[1:]))
        return not self.zstd and self.index_at_start and at == size and rows_in_order


def zstd_content_size(frame: bytes | memoryview) -> int | None:
    """The decompressed size a zstd frame's header declares (RFC 8878 3.1.1.1), or None when
    the header does not declare one or is not a zstd frame header."""
    head = bytes(frame[:18])  # magic, descriptor, window, dictionary id, content size: at most 18
    if len(head) < 5 or head[:4] != b"\x28\xb5\x2f\xfd":
        return None
    descriptor = head[4]
    single_segment = descriptor >> 5 & 1
    size_bytes = (0, 2, 4, 8)[descriptor >> 6] or (1 if single_segment else 0)
    if not size_bytes:
        return None
    at = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 3]
    if len(head) < at + size_bytes:
        return None
    value = int.from_bytes(head[at : at + size_bytes], "little")
    return value + 256 if size_bytes == 2 else value
