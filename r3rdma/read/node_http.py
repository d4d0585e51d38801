"""A reader's HTTP client of one store node: its Zarr files, with shards decoded as they arrive.

A trainer that wants most of a batch array needs the array's ``zarr.json`` and its one shard
file (r3rdma writes one shard per batch array, ``c/0/0/0``, with the shard index first).
Through zarr's fsspec store that is: metadata GET, shard GET into aiohttp's buffers, a join,
then a decode of the whole shard once its last byte is in. Here:

- the metadata and the shard body are requested at once (the metadata from a helper thread);
- the body is read with ``http.client``'s ``readinto`` into a reused buffer of the file, in
  reads of 1 MiB: the socket's ``recv_into`` writes there, no per-read bytes objects, no join,
  and the GIL is released while it waits, so several arrays stream in parallel from the
  reader's threads. (aiohttp's client cannot read into a caller's buffer; it moved the same
  files at ~0.35-0.6x the speed of this way, on the 2-core VM and on the 16-core H200 host.)
  The receiving thread does nothing else: whatever else it does, the socket waits for. (It
  used to read uncompressed chunks straight into the array, 384 KiB at a time between 4-byte
  CRCs, and hash them: ~2.3x the time of a plain GET of the file on the CPU VM, and 0.64-0.73
  of the plain GETs' speed against 0.84-0.91 now on the 16-core H100 host.)
- the index at the shard's start gives every inner chunk's place before its bytes arrive: a
  placer thread, one per shard being received, follows the transfer and handles the chunks
  whose bytes are all in, a run of a few at a time: uncompressed ones are checked and copied
  into their rows there, zstd ones are decompressed into their rows in the chunk pool
  (threads; crc32c, numpy's copy and zstd release the GIL). Only the last run's work follows
  the transfer.
- the placer hashes the caller's row ranges (a reader's requests) as their rows become final,
  and a full-size chunk they wholly cover skips its own CRC (the caller's comparison checks
  it), so each byte is hashed once, while in cache, not again in a pass after the transfer.
  Shards written before the index moved to the start (it was at the end) are decoded once
  their last byte is in.

Anything that is not that layout (other codecs, several shards) comes back as None and the
caller reads through zarr. Connections are kept alive and reused; every socket wait is
bounded by ``timeout_s``.

Errors say what happened (:func:`read_error`, also used by the reader for its reads through
zarr's fsspec store): a refused token is :class:`AuthenticationError`; a connection refused,
reset or closed mid-body is :class:`TransportError` and a wait past ``timeout_s`` is
:class:`R3TimeoutError` (both retryable); another status (5xx) is :class:`StoreError`; only
bytes that arrived whole and fail their checksum or format are :class:`CorruptDataError`.
"""

from __future__ import annotations

import bisect
import collections
import http.client
import json
import queue
import threading
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, NoReturn, Sequence

import numpy as np

from r3rdma.errors import (
    AuthenticationError,
    ConfigError,
    CorruptDataError,
    R3Error,
    R3TimeoutError,
    StoreError,
    TransportError,
)
from r3rdma.store.row_checksums import RowRangeChecksums
from r3rdma.store.shard_codec import ChunkJob, ShardDecoder, chunk_pool

__all__ = ["NodeHttpClient", "ArrayRead", "read_error", "status_error"]

_SHARD_KEY = "c/0/0/0"  # the one shard of a batch array (default key encoding, "/" separator)
_READ_STEP = 1 << 20  # bytes per readinto: chunks are placed at most this far behind the transfer
_IDLE_CONNECTIONS = 16
_RUN_CHUNKS = 4  # chunks placed per run (~1.5 MB of rows at Qwen3-30B geometry)
_BUFFER_ROUND = 1 << 20  # receive buffers are whole MiB, so one serves files of similar sizes
_IDLE_BUFFER_BYTES = 256 << 20  # receive buffers kept for reuse, in all


class ArrayRead(NamedTuple):
    """A whole batch array, and the CRC-32C of each row range the caller asked for."""

    array: np.ndarray
    crc32c: list[int]


def status_error(node: str, what: str, status: int, text: str = "") -> R3Error:
    """The error for store node ``node`` answering ``what`` (e.g. ``GET /zarr/<key>``) with an
    HTTP ``status`` the caller cannot use (a 404 that means "absent" is the caller's to handle)."""
    if status in (401, 403):
        # The node's text says no more than this; the token itself is never in a message.
        return AuthenticationError(
            f"store node {node} refused the token ({what}: HTTP {status}); "
            "give the reader the nodes' read token, derive_read_token(secret), not the push secret "
            "(--read-token-file / R3_STORE_READ_TOKEN_FILE)"
        )
    detail = " ".join(text.split())[:200]
    side = "failed" if status >= 500 else "refused"  # 5xx: the node's own failure
    return StoreError(f"store node {node} {side} the read ({what}: HTTP {status}{' ' + detail if detail else ''})")


def read_error(node: str, what: str, error: BaseException) -> R3Error | None:
    """The :class:`R3Error` for ``error``, raised while reading ``what`` from store node
    ``node`` over HTTP (http.client, or aiohttp under zarr's fsspec store); None when it is
    not a failure to talk to the node (the caller decides: absent, corrupt, a bug).

    - R3Error: itself;
    - a refused token (401/403): AuthenticationError; 404: None (absent); another HTTP status:
      see :func:`status_error`;
    - a timeout: R3TimeoutError; a connection refused, reset or closed mid-body, a DNS failure,
      an unparsable HTTP response: TransportError. Both are worth a retry;
    - FileNotFoundError: fsspec raises it for a 404 (None here), and also for a status or
      connection error while it probes a file's size (then its cause says which).
    """
    import aiohttp

    if isinstance(error, R3Error):
        return error
    if isinstance(error, FileNotFoundError):
        cause = error.__cause__
        return None if cause is None or isinstance(cause, FileNotFoundError) else read_error(node, what, cause)
    if isinstance(error, aiohttp.ClientResponseError):
        return None if error.status == 404 else status_error(node, what, error.status, error.message)
    if isinstance(error, TimeoutError):  # socket.timeout, asyncio's and aiohttp's timeouts
        return R3TimeoutError(f"store node {node} did not answer in time ({what}; retryable): {_describe(error)}")
    if isinstance(error, (OSError, http.client.HTTPException, aiohttp.ClientError)):
        # ConnectionError (refused, reset), socket.gaierror (DNS), ssl errors, IncompleteRead,
        # aiohttp's connection and payload errors.
        return TransportError(f"connection to store node {node} failed ({what}; retryable): {_describe(error)}")
    return None


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


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
        # One per shard being received: checks, copies or decodes its chunks as they land.
        self._placers = ThreadPoolExecutor(max_workers=32, thread_name_prefix="r3rdma-place")
        self._buffers = _ReceiveBuffers(_IDLE_BUFFER_BYTES)

    def close(self) -> None:
        self._helpers.shutdown(wait=True)
        self._placers.shutdown(wait=True)
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return

    def get_json(self, key: str) -> dict[str, Any] | None:
        """The JSON document at ``key``, or None if the node has no such file (404)."""
        try:
            status, body = self._get(key)
        except (OSError, http.client.HTTPException) as e:
            raise self._failed(key, e) from e
        if status == 404:
            return None
        if status != 200:
            raise status_error(self.base_url, self._what(key), status, body.decode(errors="replace"))
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
            return self._read_array(prefix, shard, meta_f, conn, response, where, crc_ranges)
        except R3Error:
            raise
        except (OSError, http.client.HTTPException) as e:
            raise self._failed(shard, e) from e
        finally:
            _settle(meta_f)

    # -- internals --------------------------------------------------------------------------

    def _url(self, key: str) -> str:
        return f"{self.base_url}/zarr/{key}"

    def _what(self, key: str) -> str:
        return f"GET {self._prefix}{key}"

    def _failed(self, key: str, error: OSError | http.client.HTTPException) -> R3Error:
        """The R3Error that says why ``GET key`` failed: the connection or its wait."""
        what = self._what(key)
        return read_error(self.base_url, what, error) or TransportError(
            f"connection to store node {self.base_url} failed ({what}; retryable): {_describe(error)}"
        )

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
                if response.status != 404:
                    raise status_error(self.base_url, self._what(shard), response.status, body.decode(errors="replace"))
                decoder = decoder_of(meta_f.result())
                self._release(conn, response)
                if decoder is None:
                    return None  # not our layout: zarr reads what a missing shard means
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
                self._stream_and_place(body, decoder, plan, sums, out.reshape(-1).view(np.uint8))
            else:  # written before the index moved to the start: decode once it is all in
                whole = body.read_all(memoryview(np.empty(body.size, dtype=np.uint8)))
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

    def _stream_and_place(
        self, body: "_Body", decoder: ShardDecoder, plan: list[ChunkJob], sums: RowRangeChecksums, rows: np.ndarray
    ) -> None:
        """This thread only receives: the shard streams into a reused buffer in large reads,
        and a placer thread checks and copies (or decodes, in the chunk pool) each chunk whose
        bytes are all in, and hashes the caller's ranges, while later bytes still arrive."""
        buffer = self._buffers.take(body.size)
        arrivals = _Arrivals()
        placer = self._placers.submit(_place_chunks, arrivals, buffer, decoder, plan, sums, rows)

        def arrived(_view: memoryview, received: int) -> None:
            if placer.done():
                placer.result()  # a damaged chunk: stop receiving, say what it was
            arrivals.advance(received)

        try:
            body.read_all(buffer, arrived)
        except BaseException:
            arrivals.abandon()
            placer.exception()  # it must not touch the buffer or the array after we return
            raise
        placer.result()
        self._buffers.give(buffer)


def _place_chunks(arrivals: "_Arrivals", buffer: memoryview, decoder: ShardDecoder, plan: list[ChunkJob],
                  sums: RowRangeChecksums, rows: np.ndarray) -> None:
    """Each chunk of ``plan`` into ``rows`` (the array's bytes) as soon as its bytes have
    arrived, and ``sums`` fed as rows become final. A full-size chunk whose rows ``sums``
    covers skips its own CRC: the caller compares ``sums``, which checks those bytes.

    Chunks are handled in runs: at least the next ``_RUN_CHUNKS``, and all that are in by then
    (a placer that fell behind catches up in fewer, larger runs). Per chunk, the GIL hand-offs
    between 8 busy threads cost more than the work: the placers fell behind the transfer.
    - uncompressed, laid out contiguously (what r3rdma writes): each run checked and copied
      here with a few GIL-free calls (one strided copy);
    - zstd: runs of up to ``_RUN_CHUNKS`` chunks decoded in the chunk pool, settled in order;
    - anything else uncompressed: chunk by chunk, here."""
    def needs_check(job: ChunkJob) -> bool:
        return job.end_row - job.first_row < decoder.chunk_rows or not sums.covers(job.first_row, job.end_row)

    def work(run: list[ChunkJob]) -> list[tuple[memoryview, np.ndarray, str, bool]]:
        return [(buffer[job.offset : job.end], job.target, job.where, needs_check(job)) for job in run]

    def finals(run: list[ChunkJob]) -> None:
        for job in run:
            sums.final(job.first_row, job.end_row)

    contiguous = decoder.contiguous_layout(plan, len(buffer))
    decoding: collections.deque[tuple[Future, list[ChunkJob]]] = collections.deque()

    def settle(wait: bool) -> None:
        while decoding and (wait or decoding[0][0].done()):
            future, done_run = decoding.popleft()
            future.result()  # re-raises its CorruptDataError
            finals(done_run)

    ends = [job.end for job in plan]  # plan is in file order
    done = 0
    try:
        while done < len(plan):
            received = arrivals.wait_for(ends[min(done + _RUN_CHUNKS, len(plan)) - 1])
            arrived = plan[done : bisect.bisect_right(ends, received, lo=done)]
            done += len(arrived)
            if contiguous:
                decoder.place_run(buffer, arrived, rows, [needs_check(job) for job in arrived])
                sums.final(arrived[0].first_row, arrived[-1].end_row)
            elif decoder.zstd:
                for i in range(0, len(arrived), _RUN_CHUNKS):
                    run = arrived[i : i + _RUN_CHUNKS]
                    decoding.append((chunk_pool().submit(decoder.decode_chunks, work(run)), run))
                settle(wait=False)
            else:
                decoder.decode_chunks(work(arrived))
                finals(arrived)
        settle(wait=True)
    except BaseException:
        for future, _ in decoding:  # they read the buffer and write the array: let them end first
            future.cancel() or future.exception()
        raise


class _Arrivals:
    """How many bytes of a file have arrived, for a thread that works on them as they do."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._received = 0
        self._abandoned = False

    def advance(self, received: int) -> None:
        with self._changed:
            self._received = received
            self._changed.notify()

    def abandon(self) -> None:
        """The transfer failed: no more bytes will come."""
        with self._changed:
            self._abandoned = True
            self._changed.notify()

    def wait_for(self, received: int) -> int:
        """Block until at least ``received`` bytes are in; returns how many are."""
        with self._changed:
            self._changed.wait_for(lambda: self._received >= received or self._abandoned)
            if self._received < received:
                raise _TransferAbandoned()
            return self._received


class _TransferAbandoned(Exception):
    """The receiving thread gave up; it reports why."""


class _ReceiveBuffers:
    """Reused receive buffers: a fresh one is faulted in page by page by the socket's copy, in
    the receiving thread, on the transfer's critical path (~3,400 faults per 14 MB where
    transparent huge pages are off; few where numpy's huge-page advice is honoured)."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.nbytes <= 2 * nbytes + _BUFFER_ROUND]
            if fits:
                return memoryview(self._free.pop(min(fits, key=lambda i: self._free[i].nbytes)))[:nbytes]
        return memoryview(np.empty(-(-nbytes // _BUFFER_ROUND) * _BUFFER_ROUND, dtype=np.uint8))[:nbytes]

    def give(self, view: memoryview) -> None:
        buffer = view.obj
        with self._lock:
            self._free.append(buffer)
            while sum(b.nbytes for b in self._free) > self._max_bytes:
                self._free.pop(0)  # the oldest


class _Body:
    """The body of one shard response, consumed in file order: first its head (the shard
    index), then the whole file into one buffer (:meth:`read_all`)."""

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

    def read_all(self, view: memoryview, progress: Callable[[memoryview, int], None] = lambda view, received: None) -> memoryview:
        """The whole file into ``view`` (``size`` bytes); ``progress(view, bytes_in)`` after every read."""
        assert self._position <= len(self._head) and len(view) == self.size
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
        # The connection closed before Content-Length bytes came: the node or the network
        # dropped it, the file is not damaged (a short file is sent whole, with its own
        # length, and fails its index or checksums instead).
        raise TransportError(
            f"{self._where}: shard body ended after {received} of {self.size} bytes: "
            "the connection closed mid-body (retryable)"
        )


def _settle(*futures: Future) -> None:
    """Wait for helper GETs we no longer need (their connections go back to the pool)."""
    for f in futures:
        f.cancel() or f.exception()
