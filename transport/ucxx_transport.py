"""The UCXX implementation of the transport contract.

ucxx is imported lazily (through :func:`~.ucx_env.import_ucxx`, after the UCX environment
is set), so importing this module loads no UCX library. Every ucxx exception is wrapped at
this boundary: ``TransportError`` (or ``ProtocolError`` for an over-long message) ``from``
the ucxx error.

Notes on ucxx (0.52) that shape this file:
- A listener binds every interface (``UCXListener.create`` takes a port only); the ``host``
  given to :class:`UcxxServer` is what it advertises. The hello keeps strangers out.
- Tag receives post a buffer of the announced size: a longer message fails as "message
  truncated" and is never copied, a shorter one is silently accepted (callers validate).
- Messages a peer sent before closing stay receivable; our sends then fail with
  "connection reset".
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from r3rdma.errors import ProtocolError, TransportError

from .base import Handler, ServerAddress
from .conn import Conn
from .device import PayloadBuffer
from .limits import TransportLimits
from .session import ConnClient, ConnServer, timed
from .ucx_env import import_ucxx, next_progress

__all__ = ["UcxxServer", "UcxxClient"]

# Thread-mode probes for a connection's next message (_UcxxConn.wait_incoming): after 1 ms,
# doubling to one every 10 ms while the connection stays idle (~100 cheap probes a second).
_PROBE_FIRST_S, _PROBE_MAX_S = 0.001, 0.01
# For this long after a connection starts waiting (after each batch's ack) it keeps the loop
# awake (yields, as a posted receive did) before it sleeps until the worker's next event: a
# client pushing batch after batch is answered within it without a wake-up, which cost ~1 ms
# more per 4 KB push on the busy 2-core VM (2 ms was too short there; 10 ms matched the old
# latency). An idle connection costs this once after its last batch, then nothing.
_STAY_AWAKE_S = 0.01


class _UcxxConn(Conn):
    def __init__(self, ep: Any, peer: str) -> None:
        self._ep = ep
        self.peer = peer
        self._ucxx = import_ucxx()

    @property
    def closed(self) -> bool:
        return self._ep is None or self._ep.closed

    async def send(self, buf: PayloadBuffer) -> None:
        if self._ep is None:
            raise TransportError(f"send to {self.peer}: connection closed")
        try:
            await self._ep.send(buf)
        except self._ucxx.exceptions.UCXError as e:
            raise TransportError(f"send to {self.peer} failed: {type(e).__name__}: {e}") from e

    async def recv_into(self, buf: np.ndarray) -> None:
        if self._ep is None:
            raise TransportError(f"recv from {self.peer}: connection closed")
        exc = self._ucxx.exceptions
        try:
            await self._ep.recv(buf)
        except exc.UCXMessageTruncatedError as e:
            raise ProtocolError(f"message from {self.peer} is longer than the {buf.nbytes} bytes its preamble announced") from e
        except exc.UCXError as e:
            raise TransportError(f"recv from {self.peer} failed: {type(e).__name__}: {e}") from e

    async def wait_incoming(self) -> None:
        # Probe for the peer's next message instead of posting a receive: ucxx awaits a posted
        # receive by yielding to the loop in a loop, a core's worth of CPU per waiting
        # connection (ucx_env.STORE_NODE_UCX_ENV). Where the loop progresses UCX in blocking
        # mode (a store node), probe again after each progress of the worker: no CPU between
        # messages. In thread mode nothing here learns of a progress: probe at growing
        # intervals, 1 ms up to _PROBE_MAX_S (a message waits at most that long to be taken).
        loop = asyncio.get_running_loop()
        pause = _PROBE_FIRST_S
        busy_until = loop.time() + _STAY_AWAKE_S
        while True:
            ep = self._ep
            if ep is None or ep.closed:
                return  # recv_into raises the closure (after any message sent before it)
            try:
                if ep.tag_probe().matched:
                    return
            except self._ucxx.exceptions.UCXError as e:
                raise TransportError(f"recv from {self.peer} failed: {type(e).__name__}: {e}") from e
            if loop.time() < busy_until:
                await asyncio.sleep(0)  # the loop polls the worker's fd without blocking meanwhile
                continue
            progressed = next_progress(loop)
            if progressed is not None:
                await progressed
            else:
                await asyncio.sleep(pause)
                pause = min(2 * pause, _PROBE_MAX_S)

    async def close(self) -> None:
        ep, self._ep = self._ep, None
        if ep is None:
            return
        try:
            await ep.close()
        except self._ucxx.exceptions.UCXError:  # already reset by the peer: nothing to flush
            pass


class UcxxServer(ConnServer):
    """Listens with ucxx on ``port`` (0: pick a free one) and serves authenticated pushes."""

    def __init__(
        self,
        handler: Handler,
        *,
        secret: bytes | str,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: TransportLimits | None = None,
    ) -> None:
        super().__init__(handler, secret, limits)
        self._host = host
        self._port = port
        self._listener: Any = None
        self._accepted = 0

    async def _listen(self) -> ServerAddress:
        ucxx = import_ucxx()
        try:
            self._listener = ucxx.create_listener(self._on_connect, port=self._port, connect_timeout=self.limits.timeout_s)
        except ucxx.exceptions.UCXError as e:
            raise TransportError(f"cannot listen on port {self._port}: {e}") from e
        return ServerAddress(self._host, int(self._listener.port))

    async def _unlisten(self) -> None:
        if self._listener is not None:
            self._listener.close()  # stops accepting; the object stays alive until _release

    async def _release(self) -> None:
        # ucxx warns when a Listener object is collected while its connection handlers
        # still run, so it is dropped only after every session ended. ucxx retires a handler
        # one loop turn after its coroutine returns, hence the few bounded yields.
        listener, self._listener = self._listener, None
        for _ in range(100):
            if listener is None or not listener.active_clients:
                break
            await asyncio.sleep(0)

    async def _on_connect(self, ep: Any) -> None:
        # Runs as its own task in our event loop (ucxx schedules it from its progress thread).
        self._accepted += 1
        if self._stopping:
            await _UcxxConn(ep, "refused").close()
            return
        await self.serve(_UcxxConn(ep, f"ucxx-client-{self._accepted}"))


class UcxxClient(ConnClient):
    """Connects with ucxx to a :class:`UcxxServer` at ``host:port``."""

    def __init__(self, host: str, port: int, *, secret: bytes | str, limits: TransportLimits | None = None) -> None:
        super().__init__(secret, limits)
        self._host = host
        self._port = port

    async def _open(self) -> _UcxxConn:
        ucxx = import_ucxx()
        peer = f"{self._host}:{self._port}"
        try:
            ep = await timed(
                ucxx.create_endpoint(self._host, self._port, connect_timeout=self.limits.connect_timeout_s),
                self.limits.connect_timeout_s + 1.0,  # ucxx's own deadline first; ours if it hangs past it
                f"connecting to {peer}",
            )
        except ucxx.exceptions.UCXError as e:
            raise TransportError(f"cannot connect to {peer}: {type(e).__name__}: {e}") from e
        except (OSError, RuntimeError) as e:  # exchange_peer_info raises RuntimeError on garbage
            if isinstance(e, TransportError) or isinstance(e, TimeoutError):
                raise
            raise TransportError(f"cannot connect to {peer}: {type(e).__name__}: {e}") from e
        return _UcxxConn(ep, peer)
