"""A reader's HTTP client of one store node: its Zarr files, with shards decoded as they arrive.

A trainer that wants most of a batch array needs the array's ``zarr.json`` and its one shard
file (r3rdma writes one shard per batch array, ``c/0/0/0``, with the shard index first).
Through zarr's fsspec store that is: metadata GET, shard GET into aiohttp's buffers, a join,
then a decode of the whole shard once its last byte is in. Here:

- the metadata and the shard body are requested at once (the metadata from a helper thread);
- the body is read with ``http.client``'s ``readinto`` into preallocated memory: the socket's
  ``recv_into`` writes there, no per-read bytes objects, no join, and the GIL is released
  while it waits, so several arrays stream in parallel from the reader's threads. (aiohttp's
  client cannot read into a caller's buffer; it moved the same files at ~0.35-0.6x the speed
  of this way, on the 2-core VM and on the 16-core H200 host.)
- the index at the shard's start gives every inner chunk's place before its bytes arrive:
  - uncompressed chunks are read straight into their rows of the returned array (no
    shard-sized buffer, no copy) and hashed by the reading thread as each one lands;
  - zstd chunks stream into one buffer of the shard, and each chunk whose bytes are all in is
    decompressed into its rows in the chunk pool (threads; crc32c and zstd release the GIL)
    while later bytes still arrive: only the last chunk's decode follows the transfer.
- the caller's row ranges (a reader's requests) are hashed as their rows become final, and a
  full-size chunk they wholly cover skips its own CRC (the caller's comparison checks it), so
  each byte is hashed once, while in cache, not again in a pass after the transfer.
  Shards written before the index moved to the start (it was at the end) are decoded once
  their last byte is in.

Anything that is not that layout (other codecs, several shards) comes back as None and the
caller reads through zarr. Connections are kept alive and reused; every socket wait is
bounded by ``timeout_s``.
"""

from __future__ import annotations

import http.client
import json
import queue
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, NoReturn, Sequence

import numpy as np

from .errors import ConfigError, CorruptDataError
from .row_checksums import RowRangeChecksums
from .shard_codec import ChunkJob, ShardDecoder, chunk_pool

__all__ = ["NodeHttpClient", "HttpStatusError", "ArrayRead"]

_SHARD_KEY = "c/0/0/0"  # the one shard of a batch array (default key encoding, "/" separator)
_READ_STEP = 1 << 20  # bytes per readinto: decodes start at most this far behind the transfer
_IDLE_CONNECTIONS = 16


class ArrayRead(NamedTuple):
    """A whole batch array, and the CRC-32C of each row range the caller asked for."""

    array: np.ndarray
    crc32c: list[int]


class HttpStatusError(Exception):
    """A store node answered a read with an unexpected HTTP status."""

    def __init__(self, url: str, status: int, text: str) -> None:
        super().__init__(f"GET {url}: HTTP {status} {text.strip()[:200]}")
        self.status = status


class NodeHttpClient:
    """GETs of ``<base_url>/zarr/<key>`` with a bearer ``token``; thread-safe, blocking."""

    def __init__(self, base_url: str, token: str | None, *, timeout_s: float = 60.0) -> None:
        parts = urllib.parse.urlsplit(base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"store node URL must be http(s)://host:port, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/") + "/zarr/"
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout_s
        self._idle: queue.LifoQueue[http.client.HTTPConnection] = queue.LifoQueue()
        # Metadata GETs, issued while the caller's thread reads the shard body.
        self._helpers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="r3rdma-http")

    def close(self) -> None:
        self._helpers.shutdown(wait=True)
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return

    def get_json(self, key: str) -> dict[str, Any] | None:
        """The JSON document at ``key``, or None if the node has no such file (404)."""
        status, body = self._get(key)
        if status == 404:
            return None
        if status != 200:
            raise HttpStatusError(self._url(key), status, body.decode(errors="replace"))
        try:
            document = json.loads(body)
        except ValueError as e:
            raise CorruptDataError(f"{self._url(key)} is not JSON: {e}") from e
        if not isinstance(document, dict):
            raise CorruptDataError(f"{self._url(key)} is not a JSON object")
        return document

    def read_array(self, key: str, where: str, crc_ranges: Sequence[tuple[int, int]] = ()) -> ArrayRead | None:
        """The whole batch array at ``key`` (its directory), or None when its layout is not the
        one :class:`ShardDecoder` knows. Raises CorruptDataError naming ``where`` on damage.
        ``crc_ranges``: row ranges whose CRC-32C to compute while the rows arrive (a reader's
        per-request checks), returned in :attr:`ArrayRead.crc32c`. A full-size chunk whose rows
        all lie in ``crc_ranges`` skips its own CRC-32C (one pass over its bytes instead of
        two): the caller must compare every returned CRC, which checks those bytes end to end.

        The array's metadata and the shard body are requested at once (a helper thread and
        this one): the chain is one round trip plus the body."""
        prefix = key.rstrip("/") + "/"
        shard = prefix + _SHARD_KEY
        meta_f = self._helpers.submit(self.get_json, prefix + "zarr.json")
        try:
            conn, response = self._request(shard)
        except BaseException:
            _settle(meta_f)
            raise
        try:
            return self._read_array(prefix, shard, meta_f, conn, response, where, crc_ranges)
        finally:
            _settle(meta_f)

    # -- internals --------------------------------------------------------------------------

    def _url(self, key: str) -> str:
        return f"{self.base_url}/zarr/{key}"

    def _new_connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self._timeout)

    def _release(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        if response.will_close or self._idle.qsize() >= _IDLE_CONNECTIONS:
            conn.close()
        else:
            self._idle.put(conn)

    def _request(self, key: str, headers: dict[str, str] | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        try:
            conn = self._idle.get_nowait()
        except queue.Empty:
            conn = self._new_connection()
        for attempt in (0, 1):
            try:
                conn.request("GET", self._prefix + key, headers={**self._headers, **(headers or {})})
                return conn, conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # A kept-alive connection the server closed while idle: once more on a new one.
                conn.close()
                if attempt:
                    raise
                conn = self._new_connection()
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    def _get(self, key: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn, response = self._request(key, headers)
        try:
            body = response.read()
        except BaseException:
            conn.close()
            raise
        self._release(conn, response)
        return response.status, body

    def _read_array(
        self, prefix: str, shard: str, meta_f: Future, conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse, where: str, crc_ranges: Sequence[tuple[int, int]],
    ) -> ArrayRead | None:
        def decoder_of(meta: dict[str, Any] | None) -> ShardDecoder | None:
            if meta is None:
                raise CorruptDataError(f"{where}: {self._url(prefix + 'zarr.json')} not found")
            decoder = ShardDecoder.of(meta)
            if decoder is None or decoder.num_shards != 1:
                return None
            wanted = max((hi for _, hi in crc_ranges), default=0)
            if wanted > decoder.shape[0]:
                raise CorruptDataError(f"{where} has {decoder.shape[0]} rows; the index lists rows up to {wanted}")
            return decoder

        jobs: list[Future] = []
        try:
            if response.status != 200:
                body = response.read()
                decoder = decoder_of(meta_f.result())
                if decoder is None:
                    self._release(conn, response)
                    return None  # not our layout: zarr will say what this status means
                if response.status != 404:
                    raise HttpStatusError(self._url(shard), response.status, body.decode(errors="replace"))
                self._release(conn, response)
                out = np.empty(decoder.shape, dtype=decoder.dtype)
                decoder.decode_into(out, 0, None, where)  # no shard file: every chunk is the fill value
                return ArrayRead(out, RowRangeChecksums(out, crc_ranges, ()).values)
            length = response.getheader("Content-Length")
            if length is None or not length.isdigit():
                raise CorruptDataError(f"{where}: shard response has no Content-Length ({length!r})")
            body = _Body(response, int(length), where)
            # The metadata (one small GET, sent first) is needed before any body byte can be
            # placed. Waiting for it here costs no transfer time: the kernel keeps receiving
            # into the socket buffer meanwhile. (Reading ahead into a buffer while waiting
            # cannot be done without a read that may block past the metadata's arrival.)
            decoder = decoder_of(meta_f.result())
            if decoder is None:
                conn.close()  # the body is not read to its end: the connection is spent
                return None
            if body.size < decoder.index_bytes:
                raise CorruptDataError(f"{where}: shard has {body.size} bytes, less than its {decoder.index_bytes}-byte index")
            out = np.empty(decoder.shape, dtype=decoder.dtype)
            if decoder.index_at_start:
                plan = decoder.plan(out, 0, body.head(decoder.index_bytes), body.size, where)
                sums = RowRangeChecksums(out, crc_ranges, [(job.first_row, job.end_row) for job in plan])
                if decoder.in_place_layout(plan, body.size):
                    self._read_in_place(body, decoder, plan, sums)
                else:
                    self._read_then_decode(body, decoder, plan, jobs, sums)
            else:  # written before the index moved to the start: decode once it is all in
                whole = body.read_all()
                plan = decoder.plan(out, 0, decoder.index_of(whole), body.size, where)
                sums = RowRangeChecksums(out, crc_ranges, [(job.first_row, job.end_row) for job in plan])
                jobs += [chunk_pool().submit(decoder.decode_chunk, whole[j.offset : j.end], j.target, j.where) for j in plan]
                for job, future in zip(plan, jobs):
                    future.result()  # re-raises the first CorruptDataError
                    sums.final(job.first_row, job.end_row)
            assert sums.complete
            body.finish()
        except BaseException:
            conn.close()
            for job in jobs:  # they write into ``out``: let started ones finish first
                job.cancel() or job.exception()
            raise
        self._release(conn, response)
        return ArrayRead(out, sums.values)

    @staticmethod
    def _read_in_place(body: "_Body", decoder: ShardDecoder, plan: list[ChunkJob], sums: RowRangeChecksums) -> None:
        """Uncompressed chunks: each one's bytes go straight into its rows of the array (an edge
        chunk's padding to a scratch buffer), and this thread hashes each chunk as soon as it is
        in, while the socket keeps receiving the next (crc32c releases the GIL): for the
        caller's ranges, and against the chunk's own CRC where those do not cover it. No
        shard-sized buffer, no copy, and no hand-off to the pool: hashing 384 KiB takes ~25 us,
        less than waking a pool thread for it."""
        full = decoder.chunk_rows * decoder.row_bytes
        crc = bytearray(4)
        for job in plan:
            padding = np.empty(full - job.target.nbytes, dtype=np.uint8)
            body.read_into(job.target, job.offset)
            body.read_into(padding, job.offset + job.target.nbytes)
            body.read_into(crc, job.end - 4)
            if padding.nbytes or not sums.covers(job.first_row, job.end_row):
                decoder.check_chunk(job.target, padding, bytes(crc), job.where)
            # else: the caller's CRCs cover every byte of this chunk; one pass checks it.
            sums.final(job.first_row, job.end_row)  # hashed for the caller while still in cache

    @staticmethod
    def _read_then_decode(
        body: "_Body", decoder: ShardDecoder, plan: list[ChunkJob], jobs: list[Future], sums: RowRangeChecksums
    ) -> None:
        """Compressed (or irregularly laid out) chunks: the shard streams into one buffer and
        each chunk whose bytes are all in is checked and decoded in the chunk pool. Between
        reads this thread hashes the rows of decoded chunks for ``sums``."""
        ready = iter(plan)
        job = next(ready, None)
        decoding: list[tuple[Future, ChunkJob]] = []

        def settle(wait: bool) -> None:
            still = []
            for future, done in decoding:
                if wait or future.done():
                    future.result()  # re-raises its CorruptDataError
                    sums.final(done.first_row, done.end_row)
                else:
                    still.append((future, done))
            decoding[:] = still

        def submit_complete(view: memoryview, received: int) -> None:
            nonlocal job
            while job is not None and job.end <= received:
                check = job.end_row - job.first_row < decoder.chunk_rows or not sums.covers(job.first_row, job.end_row)
                future = chunk_pool().submit(decoder.decode_chunk, view[job.offset : job.end], job.target, job.where, check)
                jobs.append(future)
                decoding.append((future, job))
                job = next(ready, None)
            settle(wait=False)

        body.read_all(submit_complete)
        settle(wait=True)


class _Body:
    """The body of one shard response, consumed in file order: first its head (the shard
    index), then either straight into the caller's buffers (:meth:`read_into`) or into one
    buffer of the whole file (:meth:`read_all`)."""

    def __init__(self, response: http.client.HTTPResponse, size: int, where: str) -> None:
        self.size = size
        self._response = response
        self._where = where
        self._head = bytearray()  # the first bytes of the file: the shard index
        self._position = 0  # the next file offset handed to the caller

    def head(self, n: int) -> bytes:
        """The file's first ``n`` bytes (read now if not yet in)."""
        if len(self._head) < n:
            want = n - len(self._head)
            data = self._response.read(want)
            if len(data) < want:
                self._ended(len(self._head) + len(data))
            self._head += data
        self._position = max(self._position, n)
        return bytes(self._head[:n])

    def read_into(self, dest: np.ndarray | bytearray, offset: int) -> None:
        """File bytes ``[offset, offset + len(dest))`` into ``dest``. Calls go forward through
        the file; bytes skipped between them must be in the head (the shard index)."""
        assert self._position <= offset <= max(self._position, len(self._head)), (offset, self._position)
        view = memoryview(dest).cast("B")
        have = max(0, min(len(view), len(self._head) - offset))
        view[:have] = self._head[offset : offset + have]
        done = have
        while done < len(view):
            n = self._response.readinto(view[done:])
            if not n:
                self._ended(offset + done)
            done += n
        self._position = offset + len(view)

    def read_all(self, progress: Callable[[memoryview, int], None] = lambda view, received: None) -> memoryview:
        """The whole file in one buffer; ``progress(buffer, bytes_in)`` after every read."""
        assert self._position <= len(self._head)
        view = memoryview(np.empty(self.size, dtype=np.uint8))
        received = len(self._head)
        view[:received] = self._head
        progress(view, received)
        while received < self.size:
            n = self._response.readinto(view[received : min(self.size, received + _READ_STEP)])
            if not n:
                self._ended(received)
            received += n
            progress(view, received)
        self._position = self.size
        return view

    def finish(self) -> None:
        """Once every byte is in: make sure the response is closed, so its connection can carry
        the next request (http.client closes it on the read that reaches Content-Length; this
        keeps that true whatever read came last)."""
        assert self._position == self.size
        self._response.read()

    def _ended(self, received: int) -> NoReturn:
        raise CorruptDataError(f"{self._where}: shard body ended after {received} of {self.size} bytes")


def _settle(*futures: Future) -> None:
    """Wait for helper GETs we no longer need (their connections go back to the pool)."""
    for f in futures:
        f.cancel() or f.exception()
