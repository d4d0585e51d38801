"""A store node's ``/zarr/`` files as a read-only zarr store, over a small asyncio HTTP/1.1 client.

Why not obstore's ``HTTPStore`` through zarr's ``ObjectStore`` (the reader's store before #34):
on the CPU VM, 16 ranged GETs of 80 KB at a time from a store node cost 250-280 us of CPU each
(~150 of them in its tokio runtime), and a trainer rank's slice (a pipeline stage's layers, a
context-parallel rank's rows) is one GET per ~80 KB inner chunk: the client alone cost ~3
core-seconds per GB returned. Here the same GETs cost 100-140 us each, 1 MB ones 250 us (450-660
through obstore): one :class:`asyncio.BufferedProtocol` per kept-alive connection on the
reader's event loop (:mod:`r3rdma.read.http_connection`), the answer received straight into the numpy array whose view is returned
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

from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype

from r3rdma.read.http_connection import Answer, Connection, StaleConnection
from r3rdma.read.http_errors import HTTPStatusError

__all__ = ["NodeHTTPStore"]

_RETRIES = 2
_FIRST_BACKOFF_S = 0.05
_CONNECTIONS = 8  # connections open at once to a node, per event loop and store


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

    async def _request(self, method: str, key: str, byte_range: str | None, size: int | None = None) -> Answer:
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

    async def _exchange(self, request: bytes, head_only: bool, size: int | None) -> Answer:
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
            except StaleConnection:
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
        self.idle: list[Connection] = []
        self._open = 0  # connections made and not closed (idle or in use)
        self._waiters: collections.deque[asyncio.Future[Connection | None]] = collections.deque()

    def take(self) -> Connection | None:
        """A kept-alive connection if one is idle (no coroutine: the usual case)."""
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed:
                return connection
            self._open -= 1  # the node closed it while idle
        return None

    async def acquire(self) -> Connection:
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
            waiter: asyncio.Future[Connection | None] = self._loop.create_future()
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

    def release(self, connection: Connection) -> None:
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

    async def _connect(self) -> Connection:
        try:
            _, connection = await asyncio.wait_for(
                self._loop.create_connection(Connection, self._host, self._port), self._timeout_s
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
