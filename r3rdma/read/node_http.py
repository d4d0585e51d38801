"""A store node's ``/zarr/`` files as a read-only zarr store, over a small asyncio HTTP/1.1 client.

Why not obstore's ``HTTPStore`` through zarr's ``ObjectStore`` (the reader's store before #34):
on the CPU VM, 16 ranged GETs of 80 KB at a time from a store node cost 250-280 us of CPU each
(~150 of them in its tokio runtime), and a trainer rank's slice (a pipeline stage's layers, a
context-parallel rank's rows) is one GET per ~80 KB inner chunk: the client alone cost ~3
core-seconds per GB returned. Here the same GETs cost 100-140 us each, 1 MB ones 250 us (450-660
through obstore): one :class:`asyncio.BufferedProtocol` per kept-alive connection on the
reader's event loop, the answer received straight into the numpy array whose view is returned
(no copy), one timer per connection. Not aiohttp's client either (the house's HTTP library,
the store nodes' server): 80 KB ranged GETs against a node in another process, 8 at a time,
client CPU only, cost 112-248 us each through an ``aiohttp.ClientSession`` and 83-85 us here
(CPU VM, 2026-11-26, three runs). It speaks what a store node serves: GET and HEAD of a
file or one byte range; bodies by ``Content-Length`` (also chunked, or ending with the
connection).

Failures are exceptions :func:`r3rdma.read.http_errors.read_error` maps: a connection refused,
reset or closed mid-body is a :class:`ConnectionError`, a wait past ``timeout_s`` (connect,
then each arrival of answer bytes) a :class:`TimeoutError`, another status than 2xx or 404 an
:class:`~r3rdma.read.http_errors.HTTPStatusError`; 404 is an absent file (``get``: None). As
obstore was configured: a failed connection or a 5xx answer is tried again twice (after 50 ms,
then 100 ms) while ``timeout_s`` has not passed since the first try; a wait past the timeout is
not. A request on a kept-alive connection that the node closed meanwhile goes again on a new one.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
import weakref
from collections.abc import AsyncIterator, Iterable
from typing import Any
from urllib.parse import quote, urlsplit

import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype

from r3rdma.read.http_errors import HTTPStatusError

__all__ = ["NodeHTTPStore"]

_RETRIES = 2
_FIRST_BACKOFF_S = 0.05
_CONNECTIONS = 8  # connections open at once to a node, per event loop and store
_HEAD_LIMIT = 1 << 16  # a status line and headers longer than this are no store node's answer
_HEAD_READ = 4096  # bytes received per read until the headers are complete (body size unknown)
_HEAD_ROOM = 1024  # room for the status line and headers in a buffer sized for a known body
_SCRATCH = 1 << 16  # bytes received per read of a body of unknown length (chunked, or until EOF)
_NO_BODY = np.empty(0, dtype=np.uint8)
_HEADERS_USED = (b"\r\ncontent-length:", b"\r\ntransfer-encoding:", b"\r\nconnection:")  # as looked up


class _Answer:
    """One response: status, headers (lower-case names), body."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: Any) -> None:
        self.status = status
        self.headers = headers
        self.body = body  # a uint8 numpy array (Content-Length bodies) or bytes


class _StaleConnection(ConnectionError):
    """A kept-alive connection closed before any byte of the answer came: send again."""


class _Connection(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection; one request at a time (no pipelining).

    Answer bytes land in place: with the body's size known up front (a ranged GET), the
    status line, the headers and the body are received into one array sized for them all, and
    the body returned is a view of it (one read for a small body already in the socket); else
    the headers come through a small buffer, and a ``Content-Length`` body is received
    straight into its own array."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False  # a request already went over it
        self.keep = True  # whether the node keeps it open after the current answer
        self._small = np.empty(_HEAD_READ, dtype=np.uint8)  # headers of answers of unknown size
        self._scratch: bytearray | None = None  # bodies of unknown length (chunked, until EOF)
        self._waiter: asyncio.Future[_Answer] | None = None
        self._arrivals = 0  # counts reads, for the timeout's "any progress since" check
        self._seen = 0  # _arrivals when the wait for answer bytes began
        self._since = 0.0  # loop time when it began
        self._timeout_s = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._state = "idle"  # idle | head | length | chunked | eof
        self._head_only = False
        self._planned = False  # _buf was made for this answer: its body may stay in it
        self._buf: np.ndarray = self._small  # where the answer's head (and perhaps body) is received
        self._pos = 0  # bytes of it received
        self._status = 0
        self._headers: dict[str, str] = {}
        self._length = 0  # Content-Length of the answer
        self._body: np.ndarray = _NO_BODY
        self._view: memoryview = memoryview(b"")
        self._got = 0
        self._raw = bytearray()  # chunked or until-EOF bodies, as received
        self._chunks = bytearray()  # a chunked body, decoded
        self._chunk_pos = 0

    # -- asyncio protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self._state == "length":
            return self._view[self._got :]  # the body lands in the array returned: no copy
        if self._state == "head":
            return memoryview(self._buf)[self._pos :]  # type: ignore[arg-type]  # a writable buffer
        if self._scratch is None:
            self._scratch = bytearray(_SCRATCH)
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self._arrivals += 1
        state = self._state
        if state == "length":
            self._got += nbytes
            if self._got == len(self._body):
                self._answer(self._body)
        elif state == "head":
            self._pos += nbytes
            self._head_received()
        elif state == "idle":
            self._fail(ConnectionError("the node sent bytes nobody asked for"))
        else:
            assert self._scratch is not None
            self._body_received(memoryview(self._scratch)[:nbytes])

    def eof_received(self) -> bool:
        if self._state == "eof":
            self.keep = False
            self._answer(bytes(self._raw))
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            if self._state == "head" and not self._pos and self.reused:
                self._fail(_StaleConnection("the node closed a kept-alive connection"))
            elif self._state == "eof" and exc is None:
                self.keep = False
                self._answer(bytes(self._raw))
            else:
                got = f" after {self._got} of {len(self._body)} body bytes" if self._state == "length" else ""
                self._fail(exc if exc is not None else ConnectionResetError(f"the node closed the connection{got}"))

    # -- one request ------------------------------------------------------------------------

    def send(self, request: bytes, head_only: bool, body_size: int | None = None) -> asyncio.Future[_Answer]:
        """Send ``request``; the future holds the answer. ``body_size``: the body expected
        (a byte range's length), for one buffer that takes the answer whole."""
        assert self.transport is not None and self._state == "idle"
        self._waiter = asyncio.get_running_loop().create_future()
        self._state, self._head_only, self._pos = "head", head_only, 0
        self._planned = body_size is not None
        self._buf = np.empty(body_size + _HEAD_ROOM, dtype=np.uint8) if body_size is not None else self._small
        self.transport.write(request)
        return self._waiter

    def start(self, request: bytes, head_only: bool, body_size: int | None, timeout_s: float) -> asyncio.Future[_Answer]:
        """:meth:`send` ``request``; the future holds the answer, or TimeoutError once
        ``timeout_s`` passes with no byte arriving."""
        answer = self.send(request, head_only, body_size)
        loop = answer.get_loop()
        self._timeout_s, self._seen, self._since = timeout_s, self._arrivals, loop.time()
        if self._timer is None:
            # One timer per connection, not per request: it fires at most every timeout_s
            # while requests keep the connection busy, and stops when it finds it idle.
            self._timer = loop.call_at(self._since + timeout_s, self._watch)
        return answer

    def _watch(self) -> None:
        """The timeout's timer: fail the request in flight if no byte came for ``timeout_s``."""
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # idle (or closed): the next request arms a new timer
        loop = waiter.get_loop()
        now = loop.time()
        if self._arrivals != self._seen:  # bytes came since: wait on, from now
            self._seen, self._since = self._arrivals, now
        elif now - self._since >= self._timeout_s:
            waiter.set_exception(TimeoutError(f"no answer bytes for {self._timeout_s} s"))
            return
        self._timer = loop.call_at(self._since + self._timeout_s, self._watch)

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.close()

    def _head_received(self) -> None:
        """Look for the end of the headers in what came; once found, start on the body."""
        pos, view = self._pos, memoryview(self._buf)  # type: ignore[arg-type]
        end = view[: min(pos, _HEAD_READ)].tobytes().find(b"\r\n\r\n")  # headers are short: look there first
        if end < 0 and pos > _HEAD_READ:
            end = view[: min(pos, _HEAD_LIMIT)].tobytes().find(b"\r\n\r\n")
        if end < 0:
            if pos >= _HEAD_LIMIT:
                self._fail(ConnectionError(f"the node's answer has no end of headers in its first {_HEAD_LIMIT} bytes"))
            elif pos == len(self._buf):  # headers longer than the room left for them
                grown = np.empty(min(2 * len(self._buf), _HEAD_LIMIT + _HEAD_READ), dtype=np.uint8)
                grown[:pos] = self._buf[:pos]
                self._buf, self._planned = grown, False
            return
        try:
            self._start_body(view[:end].tobytes())
        except ValueError as e:
            self._fail(ConnectionError(f"malformed HTTP answer from the node: {e}"))
            return
        first = end + 4  # the body's first byte in _buf
        if self._state == "idle":
            if pos > first:
                self.keep = False  # bytes after a body-less answer: the connection is not reused
        elif self._state == "length":
            length = self._length
            got = min(pos - first, length)
            if self._planned and first + length <= len(self._buf):
                self._body = self._buf[first : first + length]  # received in place, and the rest will be
            else:
                self._body = np.empty(length, dtype=np.uint8)
                self._body[:got] = self._buf[first : first + got]
            self._view = memoryview(self._body)  # type: ignore[arg-type]  # numpy arrays are writable buffers
            self._got = got
            if pos - first > length:
                self.keep = False  # bytes past the body: no answer of ours, the connection is not reused
            if got == length:
                self._answer(self._body)
        elif pos > first:  # chunked, or until EOF
            self._body_received(view[first:pos].tobytes())

    def _body_received(self, data: memoryview | bytes) -> None:
        if self._state == "chunked":
            self._raw += data
            self._unchunk()
        elif self._state == "eof":
            self._raw += data

    def _start_body(self, head: bytes) -> None:
        """The status line and the headers this client acts on (``Content-Length``,
        ``Transfer-Encoding``, ``Connection``): what comes next, and whether the node keeps
        the connection open after it."""
        status_line, _, rest = head.partition(b"\r\n")
        version, _, status = status_line.partition(b" ")
        if not version.startswith(b"HTTP/1.") or not status[:3].isdigit():
            raise ValueError(f"status line {status_line[:80]!r}")
        self._status = int(status[:3])
        # Three lookups in the lower-cased headers, not a parse of every line: a node sends ~10.
        low = b"\r\n" + rest.lower()
        headers: dict[str, str] = {}
        for name in _HEADERS_USED:
            at = low.find(name)
            if at >= 0:
                end = low.find(b"\r\n", at + len(name))
                headers[name[2:-1].decode()] = low[at + len(name) : end if end >= 0 else None].strip().decode("latin-1")
        self._headers = headers
        connection = headers.get("connection", "").lower()
        self.keep = "close" not in connection and (version != b"HTTP/1.0" or "keep-alive" in connection)
        if self._head_only or self._status in (204, 304) or 100 <= self._status < 200:
            self._answer(_NO_BODY)
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._state, self._raw, self._chunks, self._chunk_pos = "chunked", bytearray(), bytearray(), 0
        elif "content-length" in headers:
            self._length = int(headers["content-length"])
            if self._length < 0:
                raise ValueError(f"Content-Length {self._length}")
            self._state = "length"
        else:
            self._state, self._raw = "eof", bytearray()

    def _unchunk(self) -> None:
        """Move complete chunks of a chunked body from ``_raw`` to ``_chunks``; answer at the last."""
        raw, pos = self._raw, self._chunk_pos
        while True:
            line_end = raw.find(b"\r\n", pos)
            if line_end < 0:
                break
            try:
                size = int(bytes(raw[pos:line_end]).split(b";", 1)[0], 16)
            except ValueError:
                self._fail(ConnectionError(f"malformed chunk size line {bytes(raw[pos:line_end])[:40]!r}"))
                return
            if size == 0:  # the last chunk: then trailers (none, usually) and an empty line
                if raw.find(b"\r\n\r\n", line_end) < 0:
                    break
                self._answer(bytes(self._chunks))
                return
            if len(raw) < line_end + 2 + size + 2:
                break
            self._chunks += raw[line_end + 2 : line_end + 2 + size]
            pos = line_end + 2 + size + 2
        self._chunk_pos = pos

    def _answer(self, body: Any) -> None:
        waiter, self._waiter = self._waiter, None
        self._state = "idle"
        self._body, self._view, self._buf = _NO_BODY, memoryview(b""), self._small
        if waiter is not None and not waiter.done():
            waiter.set_result(_Answer(self._status, self._headers, body))

    def _fail(self, error: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        self.keep = False
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        self.close()


class NodeHTTPStore(Store):
    """The files under ``<url>/zarr/`` of a store node, read-only (see the module docstring).

    ``token``: sent as ``Authorization: Bearer``; ``timeout_s``: bounds the connect and each
    wait for answer bytes."""

    supports_writes = False
    supports_deletes = False
    supports_partial_writes = False
    supports_listing = False

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        super().__init__(read_only=True)
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"NodeHTTPStore reads http://host[:port] URLs, got {url!r}")
        self.url = url.rstrip("/")
        self._host, self._port = parts.hostname, parts.port or 80
        netloc = parts.netloc.rpartition("@")[2]
        self._prefix = f"{parts.path.rstrip('/')}/zarr/"
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self._headers = f"Host: {netloc}\r\n{auth}Accept-Encoding: identity\r\n"
        self._token = token
        self._timeout_s = float(timeout_s)
        # Connections by event loop: a connection belongs to the loop that made it.
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pool] = weakref.WeakKeyDictionary()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeHTTPStore) and (other.url, other._token) == (self.url, self._token)

    def __hash__(self) -> int:
        return hash((type(self), self.url))

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"NodeHTTPStore({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "token": self._token, "timeout_s": self._timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["token"], state["timeout_s"])  # type: ignore[misc]

    def close(self) -> None:
        """Close the kept-alive connections (of every event loop; from any thread: each loop
        closes its own)."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for loop, pool in list(self._pools.items()):
            if loop is running:
                pool.close()
            elif not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(pool.close)
                except RuntimeError:  # closed meanwhile: its connections went with it
                    pass
        super().close()

    # -- reads ----------------------------------------------------------------------------

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        """The file ``key`` (or ``byte_range`` of it); None when the node has no such file."""
        size: int | None = None  # the body's size, when known
        if byte_range is None:
            wanted = None
        elif isinstance(byte_range, RangeByteRequest):
            if byte_range.end <= byte_range.start:
                return prototype.buffer.from_bytes(b"")
            wanted = f"bytes={byte_range.start}-{byte_range.end - 1}"
            size = byte_range.end - byte_range.start
        elif isinstance(byte_range, OffsetByteRequest):
            wanted = f"bytes={byte_range.offset}-"
        elif isinstance(byte_range, SuffixByteRequest):
            wanted = f"bytes=-{byte_range.suffix}"
        else:
            raise TypeError(f"unexpected byte_range {byte_range!r}")
        answer = await self._request("GET", key, wanted, size)
        if answer.status == 404:
            return None
        body = answer.body
        if answer.status == 200 and isinstance(byte_range, RangeByteRequest):  # the node sent the whole file
            body = body[byte_range.start : byte_range.end]
        elif answer.status == 200 and isinstance(byte_range, OffsetByteRequest):
            body = body[byte_range.offset :]
        elif answer.status == 200 and isinstance(byte_range, SuffixByteRequest):
            body = body[max(0, len(body) - byte_range.suffix) :]
        return prototype.buffer.from_bytes(body)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        """:meth:`get` of each ``(key, byte_range)``, all at once."""
        return list(await asyncio.gather(*(self.get(key, prototype, byte_range) for key, byte_range in key_ranges)))

    async def exists(self, key: str) -> bool:
        """Whether the node has the file ``key``."""
        return (await self._request("HEAD", key, None)).status != 404

    async def getsize(self, key: str) -> int:
        """The size in bytes of the file ``key`` (FileNotFoundError when there is none)."""
        answer = await self._request("HEAD", key, None)
        if answer.status == 404:
            raise FileNotFoundError(key)
        try:
            return int(answer.headers["content-length"])
        except (KeyError, ValueError):
            raise ConnectionError(f"the node's answer to HEAD {key} has no Content-Length") from None

    # -- writes and listings: not over HTTP -----------------------------------------------

    async def set(self, key: str, value: Buffer) -> None:
        """Refused: the store is read-only."""
        self._check_writable()

    async def delete(self, key: str) -> None:
        """Refused: the store is read-only."""
        self._check_writable()

    def list(self) -> AsyncIterator[str]:
        """Not supported: a store node lists no files over HTTP."""
        return _no_listing()

    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        """Not supported: a store node lists no files over HTTP."""
        return _no_listing()

    def list_dir(self, prefix: str) -> AsyncIterator[str]:
        """Not supported: a store node lists no files over HTTP."""
        return _no_listing()

    # -- the client -----------------------------------------------------------------------

    async def _request(self, method: str, key: str, byte_range: str | None, size: int | None = None) -> _Answer:
        """One request, retried as the module docstring says; a status the caller cannot use
        (not 2xx, not 404) raises :class:`HTTPStatusError`."""
        request = (
            f"{method} {self._prefix}{_quoted(key)} HTTP/1.1\r\n{self._headers}"
            + (f"Range: {byte_range}\r\n" if byte_range else "")
            + "\r\n"
        ).encode("latin-1")
        began = time.monotonic()
        backoff = _FIRST_BACKOFF_S
        tries = 0
        while True:
            try:
                answer = await self._exchange(request, method == "HEAD", size)
            except ConnectionError as e:
                failure: Exception = e
            else:
                if answer.status < 500:
                    if answer.status >= 300 and answer.status != 404:
                        body = answer.body
                        text = bytes(body[:300]).decode("utf-8", "replace") if len(body) else ""
                        raise HTTPStatusError(answer.status, text)
                    return answer
                failure = HTTPStatusError(answer.status, bytes(answer.body[:300]).decode("utf-8", "replace"))
            if tries >= _RETRIES or time.monotonic() - began + backoff > self._timeout_s:
                raise failure
            tries += 1
            await asyncio.sleep(backoff)
            backoff *= 2

    async def _exchange(self, request: bytes, head_only: bool, size: int | None) -> _Answer:
        """Send ``request`` on a kept-alive connection (or a new one) and wait for its answer;
        a kept-alive connection the node had closed is replaced, not counted as a failure."""
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None:
            pool = self._pools[loop] = _Pool(loop, self._host, self._port, self._timeout_s)
        while True:
            connection = pool.take() or await pool.acquire()
            try:
                answer = await connection.start(request, head_only, size, self._timeout_s)
            except _StaleConnection:
                pool.release(connection)
                continue
            except BaseException as e:
                if isinstance(e, TimeoutError):
                    # The node stopped answering: the requests queued for a connection to it
                    # fail now, not one timeout after another.
                    pool.fail_waiters(e)
                connection.close()  # mid-request (failed, timed out or cancelled): never reused
                pool.release(connection)
                raise
            connection.reused = True
            pool.release(connection)
            return answer


class _Pool:
    """One event loop's connections to a node: at most :data:`_CONNECTIONS` open, kept alive
    between requests; a request finding none free waits for one (a reader's every GET at once
    would otherwise open as many connections, each a connect and a transport made and dropped)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, port: int, timeout_s: float) -> None:
        self._loop, self._host, self._port, self._timeout_s = loop, host, port, timeout_s
        self.idle: list[_Connection] = []
        self._open = 0  # connections made and not closed (idle or in use)
        self._waiters: collections.deque[asyncio.Future[_Connection | None]] = collections.deque()

    def take(self) -> _Connection | None:
        """A kept-alive connection if one is idle (no coroutine: the usual case)."""
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed:
                return connection
            self._open -= 1  # the node closed it while idle
        return None

    async def acquire(self) -> _Connection:
        """A kept-alive connection, or a new one, or (all in use) the next one released."""
        while True:
            while self.idle:
                connection = self.idle.pop()
                if not connection.closed:
                    return connection
                self._open -= 1  # the node closed it while idle
            if self._open < _CONNECTIONS:
                self._open += 1
                try:
                    return await self._connect()
                except BaseException:
                    self._open -= 1
                    self._wake()
                    raise
            waiter: asyncio.Future[_Connection | None] = self._loop.create_future()
            self._waiters.append(waiter)
            try:
                handed = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    given = waiter.result()
                    if given is not None:
                        self.release(given)  # handed over just as the wait was cancelled
                raise
            if handed is not None:
                return handed
            # None: a connection was closed, so there is room for a new one

    def release(self, connection: _Connection) -> None:
        """Hand ``connection`` back after a request: to a waiting request, kept idle, or (closed,
        or not to be kept alive) dropped, making room for a new one."""
        if connection.keep and not connection.closed:
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result(connection)
                    return
            self.idle.append(connection)
            return
        connection.close()
        self._open -= 1
        self._wake()

    def fail_waiters(self, error: BaseException) -> None:
        """Fail the requests waiting for a connection with ``error``."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(type(error)(*error.args))  # an exception of its own each

    def close(self) -> None:
        """Close the idle connections."""
        for connection in self.idle:
            connection.close()
        self._open -= len(self.idle)
        self.idle.clear()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _connect(self) -> _Connection:
        try:
            _, connection = await asyncio.wait_for(
                self._loop.create_connection(_Connection, self._host, self._port), self._timeout_s
            )
        except TimeoutError:
            raise TimeoutError(f"no connection to {self._host}:{self._port} within {self._timeout_s} s") from None
        return connection


@functools.lru_cache(maxsize=4096)
def _quoted(key: str) -> str:
    """``key`` as a URL path (kept: a read asks for the same shard files again and again)."""
    return quote(key, safe="/")


async def _no_listing() -> AsyncIterator[str]:
    raise NotImplementedError("a store node lists no files over HTTP; read keys you know")
    yield ""  # unreachable: makes this an async generator, as Store.list is
