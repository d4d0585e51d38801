"""In-process loopback transport: asyncio queues instead of sockets, same protocol code.

Every message is copied on send, like a real wire, and the full hello, framing, limits and
error frames run exactly as over UCXX. Use it to test the layers above without UCX.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np

from r3rdma.errors import ProtocolError, TransportError

from .base import Handler, ServerAddress
from .conn import Conn
from .device import PayloadBuffer, to_host_uint8
from .limits import TransportLimits
from .session import ConnClient, ConnServer, timed

__all__ = ["LoopbackServer", "LoopbackClient"]

_CLOSED = object()  # queued after the last message when a side closes
_ports = itertools.count(1)


class _LoopbackConn(Conn):
    def __init__(self, peer: str) -> None:
        self.peer = peer
        self._inbox: asyncio.Queue[object] = asyncio.Queue()
        self._arrived = asyncio.Event()  # set with every put into the inbox (wait_incoming)
        self._other: _LoopbackConn | None = None
        self._closed = False

    def _put(self, item: object) -> None:
        self._inbox.put_nowait(item)
        self._arrived.set()

    @staticmethod
    def pair(client_name: str, server_name: str) -> tuple[_LoopbackConn, _LoopbackConn]:
        client, server = _LoopbackConn(server_name), _LoopbackConn(client_name)
        client._other, server._other = server, client
        return client, server

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, buf: PayloadBuffer) -> None:
        if self._closed:
            raise TransportError(f"send to {self.peer}: connection closed")
        data = to_host_uint8(buf).tobytes()  # copy: the sender may reuse its buffer at once
        await asyncio.sleep(0)  # a real send yields; keeps interleavings realistic
        if self._closed:
            raise TransportError(f"send to {self.peer}: connection closed by peer")
        assert self._other is not None
        self._other._put(data)

    async def recv_into(self, buf: np.ndarray) -> None:
        if self._closed and self._inbox.empty():
            raise TransportError(f"recv from {self.peer}: connection closed")
        msg = await self._inbox.get()
        if msg is _CLOSED:
            self._put(_CLOSED)  # later receives fail too
            self._closed = True
            raise TransportError(f"recv from {self.peer}: connection closed by peer")
        assert isinstance(msg, bytes)
        if len(msg) > buf.nbytes:
            raise ProtocolError(f"message from {self.peer} is {len(msg)} bytes, {buf.nbytes} were announced")
        buf[: len(msg)] = np.frombuffer(msg, dtype=np.uint8)

    async def wait_incoming(self) -> None:
        while self._inbox.empty():  # a close queues a marker too: it ends the wait
            self._arrived.clear()
            await self._arrived.wait()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._put(_CLOSED)  # wake our own pending receive
        if self._other is not None and not self._other._closed:
            self._other._closed_by_peer()

    def _closed_by_peer(self) -> None:
        # Messages already queued stay receivable, as with UCX; sends fail from now on.
        self._put(_CLOSED)
        self._closed = True


class LoopbackServer(ConnServer):
    """In-process server; clients reach it through :class:`LoopbackClient` (no sockets)."""

    def __init__(self, handler: Handler, *, secret: bytes | str, limits: TransportLimits | None = None) -> None:
        super().__init__(handler, secret, limits)
        self._listening = False
        self._port = next(_ports)
        self._names = itertools.count(1)

    async def _listen(self) -> ServerAddress:
        self._listening = True
        return ServerAddress("loopback", self._port)

    async def _unlisten(self) -> None:
        self._listening = False

    def _accept(self) -> _LoopbackConn:
        if not self._listening:
            raise TransportError(f"loopback server {self._port} is not listening")
        name = f"loopback-client-{next(self._names)}"
        client_end, server_end = _LoopbackConn.pair(name, f"loopback-server-{self._port}")
        asyncio.get_running_loop().create_task(self.serve(server_end), name=f"r3-serve-{name}")
        return client_end


class LoopbackClient(ConnClient):
    """In-process client of a :class:`LoopbackServer`."""

    def __init__(self, server: LoopbackServer, *, secret: bytes | str, limits: TransportLimits | None = None) -> None:
        super().__init__(secret, limits)
        self._server = server

    async def _open(self) -> _LoopbackConn:
        async def accept() -> _LoopbackConn:
            return self._server._accept()

        return await timed(accept(), self.limits.timeout_s, "connecting to the loopback server")
