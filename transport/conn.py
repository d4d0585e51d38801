"""A message pipe: the only thing the protocol needs from an underlying transport."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from .device import PayloadBuffer

__all__ = ["Conn"]


class Conn(ABC):
    """An ordered, reliable, message-oriented pipe to one peer.

    Implementations raise :class:`~r3rdma.errors.TransportError` when the pipe fails or the
    peer closed it, and :class:`~r3rdma.errors.ProtocolError` when an incoming message is
    longer than the buffer posted for it (UCX "message truncated"). Messages sent before
    the peer closed stay receivable. Deadlines are the caller's business.
    """

    peer: str

    @abstractmethod
    async def send(self, buf: PayloadBuffer) -> None:
        """Send one message (host buffer or CUDA array)."""

    @abstractmethod
    async def recv_into(self, buf: np.ndarray) -> None:
        """Receive the next message into ``buf`` (writable, contiguous uint8).

        A shorter message leaves the rest of ``buf`` untouched (UCX does not report the
        received length); callers zero-fill and validate the contents.
        """

    async def wait_incoming(self) -> None:  # noqa: B027 (a default on purpose, not abstract: see below)
        """Return once a message is waiting to be received, or the pipe closed (the receive
        that follows then says so), without holding a receive posted meanwhile.

        For waits of unbounded length between messages (a server waiting for a connection's
        next batch), where a posted receive costs the pipe something while nothing comes
        (UCXX: a core). The default returns at once: the receive itself waits.
        """

    @abstractmethod
    async def close(self) -> None:
        """Close the pipe; idempotent, never raises."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once either side closed the pipe or it failed."""
