"""Yardstick for ``r3rdma bench transport``: the same bytes over plain ucxx send/recv.

No preamble, no header, no hello, no validation, no handler: the sender announces the
message size once (8 bytes), then each iteration is one ``ep.send`` of the payload and one
8-byte ack back, the minimum a push could cost on the same two processes. The difference
to :meth:`UcxxClient.push` of the same bytes is the protocol's overhead.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from r3rdma.errors import TransportError

from .device import PayloadBuffer, payload_nbytes
from .session import timed
from .ucx_env import import_ucxx

__all__ = ["RawSinkServer", "RawResult", "raw_push"]

_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class RawResult:
    """Outcome of :func:`raw_push`: ``iterations`` sends of ``nbytes`` each."""

    iterations: int
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Payload throughput in GB/s (1e9 bytes)."""
        return self.iterations * self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class RawSinkServer:
    """A ucxx listener that receives fixed-size messages and acks each (no auth: bench only)."""

    def __init__(self, *, port: int = 0, max_bytes: int = 1 << 30, timeout_s: float = 60.0) -> None:
        self._port = port
        self._max_bytes = max_bytes
        self._timeout = timeout_s
        self._listener: Any = None
        self.received = 0  # payload messages received, all connections

    async def start(self) -> int:
        """Start listening; return the port."""
        ucxx = import_ucxx()
        self._listener = ucxx.create_listener(self._serve, port=self._port, connect_timeout=self._timeout)
        return int(self._listener.port)

    async def stop(self) -> None:
        """Stop listening; idempotent."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _serve(self, ep: Any) -> None:
        ucxx = import_ucxx()
        size = np.zeros(8, np.uint8)
        try:
            await timed(ep.recv(size), self._timeout, "raw sink: size")
            n = _U64.unpack(size.tobytes())[0]
            if n > self._max_bytes:  # even a yardstick does not allocate what a peer says
                return
            buf = np.empty(n, np.uint8)
            ack = np.zeros(8, np.uint8)
            while True:
                await timed(ep.recv(buf), self._timeout, "raw sink: payload")
                self.received += 1
                await timed(ep.send(ack), self._timeout, "raw sink: ack")
        except ucxx.exceptions.UCXError:
            return  # the client closed: the normal end of a run
        finally:
            await ep.close()


async def raw_push(
    host: str, port: int, payload: PayloadBuffer, iterations: int, *, warmup: int = 2, timeout_s: float = 60.0
) -> RawResult:
    """Send ``payload`` ``iterations`` times to a :class:`RawSinkServer`; time the loop.

    ``payload`` may be a host buffer or a CUDA array (synchronise its stream first).
    """
    ucxx = import_ucxx()
    nbytes = payload_nbytes(payload)
    try:
        ep = await timed(ucxx.create_endpoint(host, port, connect_timeout=timeout_s), timeout_s, "raw connect")
    except ucxx.exceptions.UCXError as e:
        raise TransportError(f"raw baseline cannot connect to {host}:{port}: {e}") from e
    ack = np.zeros(8, np.uint8)
    try:
        await timed(ep.send(np.frombuffer(_U64.pack(nbytes), np.uint8)), timeout_s, "raw size")

        async def once() -> None:
            await timed(ep.send(payload), timeout_s, "raw send")
            await timed(ep.recv(ack), timeout_s, "raw ack")

        for _ in range(warmup):
            await once()
        t0 = time.perf_counter()
        for _ in range(iterations):
            await once()
        seconds = time.perf_counter() - t0
    except ucxx.exceptions.UCXError as e:
        raise TransportError(f"raw baseline send to {host}:{port} failed: {e}") from e
    finally:
        await ep.close()
    return RawResult(iterations, nbytes, seconds)
