"""One kept-alive HTTP/1.1 connection to a store node, its answers received in place.

An :class:`asyncio.BufferedProtocol` on the reader's event loop: asyncio hands it the buffer to
receive into, so a ranged GET's answer lands in one numpy array sized for the status line, the
headers and the body, and the body returned is a view of it (no copy; one read for a small
body already in the socket). One request at a time (no pipelining), and one timer per
connection for its timeout, not one per request. It speaks what a store node serves: GET and
HEAD of a file or one byte range; bodies by ``Content-Length`` (also chunked, or ending with the
connection). :class:`~r3rdma.read.node_http.NodeHTTPStore` pools these connections and retries.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

__all__ = ["Answer", "Connection", "StaleConnection"]

_HEAD_LIMIT = 1 << 16  # a status line and headers longer than this are no store node's answer
_HEAD_READ = 4096  # bytes received per read until the headers are complete (body size unknown)
_HEAD_ROOM = 1024  # room for the status line and headers in a buffer sized for a known body
_SCRATCH = 1 << 16  # bytes received per read of a body of unknown length (chunked, or until EOF)
_NO_BODY = np.empty(0, dtype=np.uint8)
_HEADERS_USED = (b"\r\ncontent-length:", b"\r\ntransfer-encoding:", b"\r\nconnection:")  # as looked up


class Answer:
    """One response: status, headers (lower-case names), body."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: Any) -> None:
        self.status = status
        self.headers = headers
        self.body = body  # a uint8 numpy array (Content-Length bodies) or bytes


class StaleConnection(ConnectionError):
    """A kept-alive connection closed before any byte of the answer came: send again."""


class Connection(asyncio.BufferedProtocol):
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
        self._waiter: asyncio.Future[Answer] | None = None
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
        """asyncio: the connection is open."""
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        """asyncio: where the next bytes that arrive are received (in place, where known)."""
        if self._state == "length":
            return self._view[self._got :]  # the body lands in the array returned: no copy
        if self._state == "head":
            return memoryview(self._buf)[self._pos :]  # type: ignore[arg-type]  # a writable buffer
        if self._scratch is None:
            self._scratch = bytearray(_SCRATCH)
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        """asyncio: ``nbytes`` arrived in the buffer :meth:`get_buffer` gave."""
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
        """asyncio: the node closed its side (ends a body sent until EOF)."""
        if self._state == "eof":
            self.keep = False
            self._answer(bytes(self._raw))
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        """asyncio: the connection is gone; a request in flight fails (or, on a kept-alive
        connection with no answer byte yet, is to be sent again: :class:`StaleConnection`)."""
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            if self._state == "head" and not self._pos and self.reused:
                self._fail(StaleConnection("the node closed a kept-alive connection"))
            elif self._state == "eof" and exc is None:
                self.keep = False
                self._answer(bytes(self._raw))
            else:
                got = f" after {self._got} of {len(self._body)} body bytes" if self._state == "length" else ""
                self._fail(exc if exc is not None else ConnectionResetError(f"the node closed the connection{got}"))

    # -- one request ------------------------------------------------------------------------

    def send(self, request: bytes, head_only: bool, body_size: int | None = None) -> asyncio.Future[Answer]:
        """Send ``request``; the future holds the answer. ``body_size``: the body expected
        (a byte range's length), for one buffer that takes the answer whole."""
        assert self.transport is not None and self._state == "idle"
        self._waiter = asyncio.get_running_loop().create_future()
        self._state, self._head_only, self._pos = "head", head_only, 0
        self._planned = body_size is not None
        self._buf = np.empty(body_size + _HEAD_ROOM, dtype=np.uint8) if body_size is not None else self._small
        self.transport.write(request)
        return self._waiter

    def start(self, request: bytes, head_only: bool, body_size: int | None, timeout_s: float) -> asyncio.Future[Answer]:
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
        """Close the connection and stop its timer."""
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
            waiter.set_result(Answer(self._status, self._headers, body))

    def _fail(self, error: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        self.keep = False
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        self.close()
