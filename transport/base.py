"""The transport contract: a server that hands batches to a handler, a client that pushes.

Two implementations share every byte of protocol logic (``session.py``): UCXX
(``UcxxServer`` / ``UcxxClient``) and an in-process loopback (``LoopbackServer`` /
``LoopbackClient``) used as a fast fake in tests of the layers above.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

from r3rdma.records import RequestRecord

from .batch import PackedBatch

__all__ = ["Handler", "PushAck", "ServerAddress", "TransportServer", "TransportClient"]

#: The server's callback for one batch. It must make the records durable before returning:
#: the client's ack is sent only after it returns. Raising an ``R3Error`` sends that error
#: back, typed; the connection stays usable. Probe batches (``PackedBatch.probe``) never reach
#: it: they are acked once received and checksummed.
Handler = Callable[[list[RequestRecord]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ServerAddress:
    """Where a started server can be reached (``host`` as given to the server)."""

    host: str
    port: int


@dataclass(frozen=True, slots=True)
class PushAck:
    """The server's acknowledgement: this many requests and payload bytes are durable."""

    seq: int
    requests: int
    bytes: int


class TransportServer(ABC):
    """Accepts authenticated connections and hands each received batch to a handler.

    Construct with ``handler``, ``secret`` and ``limits``; use as ``async with``.
    """

    @abstractmethod
    async def start(self) -> ServerAddress:
        """Start listening; return the address clients connect to."""

    @abstractmethod
    async def stop(self, drain: bool = True) -> None:
        """Stop accepting. With ``drain``, batches already being received or handled are
        finished and acked (bounded by the limits' deadlines); idle connections are closed.
        Without, everything is cancelled and unacked batches are lost (clients retry)."""

    @property
    @abstractmethod
    def address(self) -> ServerAddress:
        """The address returned by :meth:`start`."""

    async def __aenter__(self) -> TransportServer:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop(drain=et is None)


class TransportClient(ABC):
    """One authenticated connection to a server; pushes are serialised (one in flight).

    Use several clients for parallel pushes. A push that fails with a transport error or
    a timeout closes the connection (the batch may or may not be durable: retry it; the
    store accepts an identical re-push). The next push reconnects.
    """

    @abstractmethod
    async def connect(self) -> None:
        """Connect and authenticate. Raises AuthenticationError, TransportError, R3TimeoutError."""

    @abstractmethod
    async def push(self, records: Sequence[RequestRecord]) -> PushAck:
        """Send a batch of host records; return once the server acked it as durable."""

    @abstractmethod
    async def push_packed(self, batch: PackedBatch) -> PushAck:
        """Send a caller-packed batch (host or CUDA payload; sync its stream first)."""

    @abstractmethod
    async def close(self) -> None:
        """Close the connection; idempotent."""

    async def __aenter__(self) -> TransportClient:
        await self.connect()
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()
