"""The protocol engine shared by every implementation: hello, batches, acks, errors.

Written against :class:`~.conn.Conn` only, so the loopback fake and UCXX run the same code.
Every wait goes through :func:`timed`, so nothing here can block past a deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from abc import abstractmethod
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import numpy as np

from r3rdma.errors import (
    AuthenticationError,
    ProtocolError,
    R3Error,
    R3TimeoutError,
    TransportError,
)
from r3rdma.records import RequestRecord

from . import auth
from .base import Handler, PushAck, ServerAddress, TransportClient, TransportServer
from .batch import PackedBatch, batch_header, check_batch_header, decode_batch, encode_records, is_probe, packed_table
from .conn import Conn
from .device import PayloadBuffer, payload_nbytes
from .frames import (
    HANDSHAKE_MAX_HEADER_BYTES,
    INLINE_HEADER_BYTES,
    PREAMBLE_BYTES,
    PROTOCOL_VERSION,
    REPLY_MAX_HEADER_BYTES,
    SUPPORTED_VERSIONS,
    Kind,
    Preamble,
    error_from_header,
    error_header,
    pack_header,
    unpack_header,
)
from .limits import TransportLimits
from .receive import FrameHasher, ReceiveBuffers

__all__ = ["timed", "ConnServer", "ConnClient"]

log = logging.getLogger("r3rdma.transport")
T = TypeVar("T")

#: After a fatal ERROR frame to an authenticated peer, the server waits at most this long (or
#: ``timeout_s``, if shorter) for the peer to close before closing itself (ConnServer._linger):
#: closing at once raced the frame (issue 31). 2 s because the peer's receive for the frame
#: is already posted (it waits for an ack or error): it matches the frame within milliseconds,
#: and a client closes as soon as it has read it; a peer that does not close would otherwise
#: hold its connection for ``timeout_s`` (30 s by default), its budget already given back.
FATAL_LINGER_S = 2.0
#: The same wait for a peer that never authenticated (failed or broke the hello): only a
#: short, fixed flush window for the frame, ending early once the peer closes. Such a peer
#: costs the node nothing more: it is closed right after, whatever it does.
UNAUTHENTICATED_LINGER_S = 0.05


async def timed(aw: Awaitable[T], timeout: float, what: str) -> T:
    """Await ``aw`` for at most ``timeout`` seconds, else raise R3TimeoutError naming ``what``."""
    try:
        return await asyncio.wait_for(aw, timeout)
    except TimeoutError as e:
        if isinstance(e, R3Error):  # a deadline deeper down already named itself
            raise
        raise R3TimeoutError(f"{what}: nothing happened within {timeout:g} s") from e


# -- messages ------------------------------------------------------------------------------


async def send_message(
    conn: Conn,
    version: int,
    kind: Kind,
    header: dict[str, Any],
    frames: Sequence[PayloadBuffer] = (),
    *,
    timeout: float,
) -> None:
    raw = pack_header(header)
    sizes = [payload_nbytes(f) for f in frames]
    pre = Preamble(version, kind, len(raw), sum(sizes))
    what = f"sending {kind.name} to {conn.peer}"
    # All sends are posted at once: UCX matches same-tag messages from one sender in posting
    # order, and waiting for each send before posting the next costs a progress-thread round
    # trip per frame (~1.5 ms here), which halved throughput for batches of many requests.
    # Zero-byte frames are never listed, so never sent.
    head = [pre.pack() + raw] if len(raw) <= INLINE_HEADER_BYTES else [pre.pack(), raw]
    buffers = [*head, *(f for f, size in zip(frames, sizes) if size)]
    await timed(asyncio.gather(*(conn.send(b) for b in buffers)), timeout, what)


async def recv_preamble(conn: Conn, timeout: float, what: str) -> Preamble:
    # Room for an inline header (see INLINE_HEADER_BYTES); a shorter message fills a prefix.
    buf = np.zeros(PREAMBLE_BYTES + INLINE_HEADER_BYTES, dtype=np.uint8)
    await timed(conn.recv_into(buf), timeout, what)
    pre = Preamble.unpack(buf[:PREAMBLE_BYTES].tobytes())
    if 1 <= pre.header_len <= INLINE_HEADER_BYTES:
        pre = dataclasses.replace(pre, inline=buf[PREAMBLE_BYTES : PREAMBLE_BYTES + pre.header_len].tobytes())
    return pre


async def recv_header(conn: Conn, pre: Preamble, limit: int, timeout: float, what: str) -> dict[str, Any]:
    if not 1 <= pre.header_len <= limit:
        raise ProtocolError(f"{pre.kind.name} header must be 1..{limit} bytes, the preamble announced {pre.header_len}")
    if pre.inline:
        return unpack_header(pre.inline, pre.kind.name)
    buf = np.zeros(pre.header_len, dtype=np.uint8)
    await timed(conn.recv_into(buf), timeout, what)
    return unpack_header(buf.data, pre.kind.name)


def expect(pre: Preamble, kinds: tuple[Kind, ...], version: int | None, max_payload: int = 0) -> None:
    if pre.kind not in kinds:
        raise ProtocolError(f"expected a {'/'.join(k.name for k in kinds)} message, got {pre.kind.name}")
    if version is not None and pre.version != version:
        raise ProtocolError(f"expected protocol version {version} (negotiated), got {pre.version}")
    if pre.payload_len > max_payload:
        raise ProtocolError(
            f"{pre.kind.name} payload must be at most {max_payload} bytes, the preamble announced {pre.payload_len}"
        )


def _bytes_field(header: dict[str, Any], key: str, size: int, what: str) -> bytes:
    value = header.get(key)
    if not isinstance(value, bytes) or len(value) != size:
        shown = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise ProtocolError(f"{what} field {key!r} must be {size} bytes, got {shown}")
    return value


# -- server side ---------------------------------------------------------------------------


async def server_handshake(conn: Conn, secret: bytes, limits: TransportLimits) -> int:
    """Run the server half of the hello; return the negotiated version."""
    t = limits.timeout_s
    await timed(conn.wait_incoming(), t, f"waiting for HELLO from {conn.peer}")
    pre = await recv_preamble(conn, t, f"waiting for HELLO from {conn.peer}")
    expect(pre, (Kind.HELLO,), None)
    hello = await recv_header(conn, pre, HANDSHAKE_MAX_HEADER_BYTES, t, "receiving HELLO")
    offered = hello.get("versions")
    if not isinstance(offered, list) or not all(isinstance(v, int) for v in offered):
        raise ProtocolError(f"HELLO must list the client's protocol versions, got {offered!r}")
    common = set(offered) & set(SUPPORTED_VERSIONS)
    if not common:
        raise ProtocolError(f"no common protocol version: server speaks {list(SUPPORTED_VERSIONS)}, client offers {offered}")
    version = max(common)
    client_nonce = _bytes_field(hello, "nonce", auth.NONCE_BYTES, "HELLO")
    server_nonce = auth.new_nonce()
    await send_message(conn, version, Kind.CHALLENGE, {"version": version, "nonce": server_nonce}, timeout=t)

    pre = await recv_preamble(conn, t, f"waiting for AUTH from {conn.peer}")
    expect(pre, (Kind.AUTH,), version)
    answer = await recv_header(conn, pre, HANDSHAKE_MAX_HEADER_BYTES, t, "receiving AUTH")
    expected = auth.client_proof(secret, version, client_nonce, server_nonce)
    if not auth.proofs_match(expected, answer.get("proof")):
        raise AuthenticationError(
            "client proof does not match the shared secret (both sides must hold the same secret: "
            "R3_STORE_TOKEN_FILE, or R3_STORE_TOKEN, on the engines; --token-file on the store nodes)"
        )
    proof = auth.server_proof(secret, version, client_nonce, server_nonce)
    await send_message(conn, version, Kind.AUTH_OK, {"proof": proof}, timeout=t)
    return version


class _Session:
    __slots__ = ("task", "busy", "authenticated")

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.busy = False
        self.authenticated = False  # set once the hello succeeded (see ConnServer._linger)


class ConnServer(TransportServer):
    """Server logic over :class:`Conn`; subclasses only listen and produce connections."""

    def __init__(self, handler: Handler, secret: bytes | str, limits: TransportLimits | None = None) -> None:
        self._handler = handler
        self._secret = auth.coerce_secret(secret)
        self.limits = limits or TransportLimits()
        self._sessions: set[_Session] = set()
        self._stopping = False
        self._address: ServerAddress | None = None
        # Connections answered with a fatal ERROR frame: closed only once the peer closed (or
        # a short bounded wait passed), so the frame is read before the connection goes (_linger).
        self._answered_fatally: set[Conn] = set()
        # In-flight payload budget (limits.max_inflight_bytes), shared by all connections.
        self._inflight = 0
        self._inflight_changed: asyncio.Condition | None = None  # created in the serving loop
        self.buffers = ReceiveBuffers(max_cached_bytes=self.limits.max_inflight_bytes)

    @property
    def inflight_bytes(self) -> int:
        """Payload bytes reserved by batches being received or handled now."""
        return self._inflight

    async def _reserve(self, nbytes: int) -> int:
        """Wait for room for ``nbytes`` of payload in the in-flight budget; return what was taken.

        A batch larger than the whole budget takes all of it (it runs alone) instead of waiting
        forever. The caller must :meth:`_unreserve` what this returned, whatever happens.
        """
        budget = self.limits.max_inflight_bytes
        take = min(nbytes, budget)
        if self._inflight_changed is None:
            self._inflight_changed = asyncio.Condition()
        async with self._inflight_changed:
            await self._inflight_changed.wait_for(lambda: self._inflight + take <= budget)
            self._inflight += take
        return take

    async def _unreserve(self, taken: int) -> None:
        if not taken:
            return
        assert self._inflight_changed is not None
        async with self._inflight_changed:
            self._inflight -= taken
            self._inflight_changed.notify_all()

    @property
    def address(self) -> ServerAddress:
        """The address returned by :meth:`start`; raises :class:`TransportError` before it."""
        if self._address is None:
            raise TransportError("server not started: call start() first")
        return self._address

    @abstractmethod
    async def _listen(self) -> ServerAddress: ...

    @abstractmethod
    async def _unlisten(self) -> None:
        """Stop accepting new connections."""

    async def _release(self) -> None:
        """Free listening resources once every session has ended."""

    async def start(self) -> ServerAddress:
        """Start listening (no-op when already listening); return the address clients connect to."""
        if self._address is None:
            self._stopping = False
            self._address = await self._listen()
        return self._address

    async def stop(self, drain: bool = True) -> None:
        """Stop accepting and end every session: with ``drain``, batches in flight are finished and
        acked first (see :meth:`TransportServer.stop`)."""
        self._stopping = True
        await self._unlisten()
        sessions = list(self._sessions)
        for s in sessions:
            # An idle session is blocked waiting for a preamble: nothing is in flight.
            if (not drain or not s.busy) and s.task is not None:
                s.task.cancel()
        tasks = [s.task for s in sessions if s.task is not None]
        if tasks:
            deadline = self.limits.handler_timeout_s + 2 * self.limits.timeout_s
            done, pending = await asyncio.wait(tasks, timeout=deadline)
            for task in pending:  # pragma: no cover - a handler ignored its deadline
                task.cancel()
        await self._release()
        self._address = None

    async def serve(self, conn: Conn) -> None:
        """Run one connection to completion (called by subclasses for each accepted conn)."""
        session = _Session(asyncio.current_task())
        self._sessions.add(session)
        try:
            await self._serve(conn, session)
            if conn in self._answered_fatally:
                await self._linger(conn, session.authenticated)
        except asyncio.CancelledError:
            pass  # stop(): the connection is closed below; the client sees TransportError
        finally:
            self._answered_fatally.discard(conn)
            self._sessions.discard(session)
            await conn.close()

    async def _linger(self, conn: Conn, authenticated: bool) -> None:
        """After a fatal ERROR frame: wait for the peer to close first (or to send anything
        more), then let :meth:`serve` close. The wait is bounded by :data:`FATAL_LINGER_S`
        (or ``timeout_s``, if shorter) for an authenticated peer, and by the short flush window
        :data:`UNAUTHENTICATED_LINGER_S` for one that failed or broke the hello.

        Why: closing at once raced the frame. ucxx closes an endpoint with UCX's force mode
        (nothing flushed), and a peer whose receive was still waiting saw the connection reset
        and its receive cancelled (``TransportError(... UCXXCanceledError ...)``) instead of
        the typed error the frame carried (a stalled sender under load, issue 31). A client
        closes on a fatal error as soon as it has read it; one that does not holds only this
        connection, for at most the bound: its budget and buffer were released before. An
        unauthenticated peer must cost the node nothing, so it gets no more than a flush window
        for its (small) frame, and is closed then whatever it does.
        """
        bound = min(self.limits.timeout_s, FATAL_LINGER_S if authenticated else UNAUTHENTICATED_LINGER_S)
        try:
            await timed(conn.wait_incoming(), bound, f"waiting for {conn.peer} to close")
        except R3Error as e:
            log.debug("closing %s after a fatal error: %s", conn.peer, e)

    async def _serve(self, conn: Conn, session: _Session) -> None:
        limits = self.limits
        version = PROTOCOL_VERSION
        try:
            version = await server_handshake(conn, self._secret, limits)
            session.authenticated = True
        except (TransportError, R3TimeoutError) as e:
            log.info("hello with %s failed: %s", conn.peer, e)
            return
        except R3Error as e:
            log.warning("refusing %s: %s", conn.peer, e)
            await self._send_error(conn, version, e, seq=None, fatal=True)
            return
        while not self._stopping:
            try:
                # Wait for the next batch with no receive posted (Conn.wait_incoming: over UCXX a
                # posted receive spins a core for as long as the client stays idle).
                await timed(conn.wait_incoming(), limits.idle_timeout_s, f"idle connection from {conn.peer}")
                pre = await recv_preamble(conn, limits.timeout_s, f"receiving a batch preamble from {conn.peer}")
            except (TransportError, R3TimeoutError, ProtocolError) as e:
                # Peer gone, idle too long, or garbage where a preamble belongs.
                if isinstance(e, ProtocolError):
                    await self._send_error(conn, version, e, seq=None, fatal=True)
                log.debug("closing %s: %s", conn.peer, e)
                return
            session.busy = True
            try:
                if not await self._one_batch(conn, version, pre):
                    return
            finally:
                session.busy = False

    async def _one_batch(self, conn: Conn, version: int, pre: Preamble) -> bool:
        """Receive, hand over and ack one batch; False when the connection must close."""
        taken = [0]
        try:
            return await self._one_batch_budgeted(conn, version, pre, taken)
        finally:
            # Whatever happened (ack, error, peer vanished mid-transfer, cancellation), the
            # payload buffer is unreferenced once we return: give its budget back.
            await asyncio.shield(self._unreserve(taken[0]))

    async def _one_batch_budgeted(self, conn: Conn, version: int, pre: Preamble, taken: list[int]) -> bool:
        limits = self.limits
        t = limits.timeout_s
        seq: int | None = None
        try:
            expect(pre, (Kind.BATCH,), version, limits.max_payload_bytes)
            header = await recv_header(conn, pre, limits.max_header_bytes, t, "receiving a batch header")
            metas = check_batch_header(header, pre.payload_len, limits)
            seq = header["seq"]
            try:
                taken[0] = await asyncio.wait_for(self._reserve(pre.payload_len), t)
            except TimeoutError:
                # The payload was not consumed, so the stream is out of sync: fatal for this
                # connection only. The client treats R3TimeoutError as "node busy/down" and
                # fails over or retries.
                err = R3TimeoutError(
                    f"store node busy: no room for a {pre.payload_len}-byte batch within {t:g} s "
                    f"(in-flight budget {limits.max_inflight_bytes} bytes)"
                )
                await self._send_error(conn, version, err, seq=seq, fatal=True)
                return False
        except R3Error as e:
            return await self._stream_broken(conn, version, e, seq)
        base = self.buffers.take(pre.payload_len)
        try:
            return await self._receive_and_handle(conn, version, pre, seq, metas, header, base)
        finally:
            self.buffers.give_back(base)  # kept by the pool only if no record still views it

    async def _receive_and_handle(
        self, conn: Conn, version: int, pre: Preamble, seq: int, metas: list, header: dict[str, Any], base: np.ndarray
    ) -> bool:
        limits = self.limits
        t = limits.timeout_s
        frame_sizes: list[int] = header["frames"]
        # UCX does not report a *shorter* message, so bytes a frame did not fill keep what the
        # buffer held before (a pooled buffer: an earlier batch). Every request carries the
        # sender's CRC-32C (check_batch_header refuses a null one), so such a request fails
        # as CorruptDataError; nothing is zero-filled (a zeroed short frame used to be stored
        # as zeros under a checksum computed here) and pages are touched only as bytes land.
        payload = base[: pre.payload_len]
        views, start = [], 0
        for size in frame_sizes:
            views.append(payload[start : start + size])
            start += size
        hasher = FrameHasher(metas, frame_sizes, payload)

        async def receive(i: int, view: np.ndarray) -> None:
            await conn.recv_into(view)
            hasher.frame_done(i)  # hash its requests in a thread while later frames arrive

        try:
            try:
                # Posted at once, in order (see send_message).
                await timed(
                    asyncio.gather(*(receive(i, v) for i, v in enumerate(views))),
                    t,
                    f"receiving the payload of batch {seq} ({pre.payload_len} bytes announced; sender stalled)",
                )
            except R3Error as e:
                return await self._stream_broken(conn, version, e, seq)

            # The message was consumed entirely: errors from here on leave the stream in sync.
            try:
                records = decode_batch(metas, payload, await hasher.results())
                if not is_probe(header):  # a probe is received and checked like any batch, never stored
                    await timed(self._handler(records), limits.handler_timeout_s, "handler (durable write)")
            except R3Error as e:
                return await self._send_error(conn, version, e, seq=seq, fatal=False)
            except Exception as e:  # a bug in the handler: report it typed, keep serving
                log.exception("handler failed on a batch from %s", conn.peer)
                return await self._send_error(conn, version, e, seq=seq, fatal=False)
        finally:
            await hasher.settle()  # no hashing thread may still read the buffer
        ack = {"seq": seq, "requests": len(metas), "bytes": pre.payload_len}
        try:
            await send_message(conn, version, Kind.ACK, ack, timeout=t)
        except (TransportError, R3TimeoutError) as e:
            log.info("ack to %s lost: %s", conn.peer, e)
            return False
        return True

    async def _stream_broken(self, conn: Conn, version: int, exc: R3Error, seq: int | None) -> bool:
        """A batch failed before it was consumed entirely; always False (close the connection).

        The caller (:meth:`_one_batch`) releases the batch's budget reservation and buffer
        once this returns, so a sender that announced a batch and stalls holds them for at
        most ``timeout_s`` (plus the bounded send of the error frame).
        """
        if isinstance(exc, TransportError):
            log.info("batch from %s aborted: %s", conn.peer, exc)  # peer gone: nobody to tell
        elif isinstance(exc, R3TimeoutError):
            # A sender that announced a batch and stalled: tell it why (typed, fatal), then
            # close, so a buggy or hostile client cannot hold the budget with no cost to it.
            log.info("batch from %s stalled: %s", conn.peer, exc)
            await self._send_error(conn, version, exc, seq=seq, fatal=True)
        else:  # ProtocolError: the stream can no longer be trusted; say why before closing
            log.warning("protocol violation by %s: %s", conn.peer, exc)
            await self._send_error(conn, version, exc, seq=seq, fatal=True)
        return False

    async def _send_error(self, conn: Conn, version: int, exc: BaseException, *, seq: int | None, fatal: bool) -> bool:
        """Best-effort ERROR frame; returns whether the connection is still usable. After a
        fatal one the connection closes once the peer has read it (:meth:`_linger`)."""
        try:
            await send_message(conn, version, Kind.ERROR, error_header(exc, seq=seq, fatal=fatal), timeout=self.limits.timeout_s)
        except (TransportError, R3TimeoutError):
            return False
        if fatal:
            self._answered_fatally.add(conn)
        return not fatal


# -- client side ---------------------------------------------------------------------------


async def client_handshake(conn: Conn, secret: bytes, limits: TransportLimits) -> int:
    """Run the client half of the hello; return the negotiated version."""
    t = limits.timeout_s
    client_nonce = auth.new_nonce()
    hello = {"versions": list(SUPPORTED_VERSIONS), "nonce": client_nonce}
    await send_message(conn, PROTOCOL_VERSION, Kind.HELLO, hello, timeout=t)
    pre, challenge = await _handshake_reply(conn, Kind.CHALLENGE, None, t)
    version = challenge.get("version")
    if version not in SUPPORTED_VERSIONS or pre.version != version:
        raise ProtocolError(f"server chose protocol version {version!r}; this client speaks {list(SUPPORTED_VERSIONS)}")
    server_nonce = _bytes_field(challenge, "nonce", auth.NONCE_BYTES, "CHALLENGE")
    proof = auth.client_proof(secret, version, client_nonce, server_nonce)
    await send_message(conn, version, Kind.AUTH, {"proof": proof}, timeout=t)
    _, answer = await _handshake_reply(conn, Kind.AUTH_OK, version, t)
    expected = auth.server_proof(secret, version, client_nonce, server_nonce)
    if not auth.proofs_match(expected, answer.get("proof")):
        raise AuthenticationError("server proof does not match the shared secret: not the server we expected")
    return version


async def _handshake_reply(conn: Conn, kind: Kind, version: int | None, t: float) -> tuple[Preamble, dict[str, Any]]:
    """The server's ``kind`` answer during the hello; its ERROR frame raised as its typed error."""
    pre = await recv_preamble(conn, t, f"waiting for {kind.name} from {conn.peer}")
    expect(pre, (kind, Kind.ERROR), version)
    header = await recv_header(conn, pre, HANDSHAKE_MAX_HEADER_BYTES, t, f"receiving {kind.name}")
    if pre.kind is Kind.ERROR:
        raise error_from_header(header)
    return pre, header


async def recv_reply(conn: Conn, version: int, seq: int, limits: TransportLimits) -> PushAck:
    """Wait for the ACK (or typed ERROR) of batch ``seq``; no deadline on the first byte."""
    pre = await recv_preamble(conn, limits.ack_timeout_s, f"waiting for the ack from {conn.peer}")
    expect(pre, (Kind.ACK, Kind.ERROR), version)
    header = await recv_header(conn, pre, REPLY_MAX_HEADER_BYTES, limits.timeout_s, "receiving the ack")
    if pre.kind is Kind.ERROR:
        exc = error_from_header(header)
        exc.fatal = bool(header.get("fatal", True))  # type: ignore[attr-defined]
        raise exc
    got = header.get("seq")
    requests, nbytes = header.get("requests"), header.get("bytes")
    if got != seq or not isinstance(requests, int) or not isinstance(nbytes, int):
        raise ProtocolError(f"expected an ack of batch {seq} with request and byte counts, got {header!r}")
    return PushAck(seq=seq, requests=requests, bytes=nbytes)


class ConnClient(TransportClient):
    """Client logic over :class:`Conn`; subclasses only open connections."""

    def __init__(self, secret: bytes | str, limits: TransportLimits | None = None) -> None:
        self._secret = auth.coerce_secret(secret)
        self.limits = limits or TransportLimits()
        self._conn: Conn | None = None
        self._version = PROTOCOL_VERSION
        self._seq = 0
        self._lock = asyncio.Lock()

    @abstractmethod
    async def _open(self) -> Conn:
        """Open a raw connection (no hello yet); bounded by ``limits.timeout_s``."""

    @property
    def connected(self) -> bool:
        """True while the connection is open (a failed push closes it)."""
        return self._conn is not None and not self._conn.closed

    async def connect(self) -> None:
        """Connect and authenticate unless connected; raises :class:`AuthenticationError`,
        :class:`TransportError` or :class:`R3TimeoutError`."""
        if self.connected:
            return
        await self._drop()
        conn = await self._open()
        try:
            self._version = await client_handshake(conn, self._secret, self.limits)
        except BaseException:
            await conn.close()
            raise
        self._conn = conn

    async def close(self) -> None:
        """Close the connection once the push in flight, if any, is done; idempotent."""
        async with self._lock:
            await self._drop()

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def push(self, records: Sequence[RequestRecord]) -> PushAck:
        """Send a batch of host records; return once the server acked it as durable. Raises
        :class:`ProtocolError` for an empty batch or one over ``limits.max_records``."""
        if not records:
            raise ProtocolError("push needs at least one record, got an empty batch")
        if len(records) > self.limits.max_records:
            raise ProtocolError(f"a batch holds at most {self.limits.max_records} records, got {len(records)}")
        table, frames = encode_records(records, max_frames=self.limits.max_frames)
        return await self._push(table, frames, probe=False)

    async def push_packed(self, batch: PackedBatch) -> PushAck:
        """Send a caller-packed batch (host or CUDA payload; sync its stream first); return once
        the server acked it. Raises :class:`ProtocolError` for an empty batch."""
        if not batch.metas:
            raise ProtocolError("push needs at least one record, got an empty batch")
        table = packed_table(batch)
        return await self._push(table, [batch.payload] if batch.nbytes else [], probe=batch.probe)

    async def _push(self, table: list[dict[str, Any]], frames: list[PayloadBuffer], *, probe: bool) -> PushAck:
        async with self._lock:
            if not self.connected:  # first push, or the previous connection failed / idled out
                await self.connect()
            conn = self._conn
            assert conn is not None
            self._seq += 1
            seq = self._seq
            try:
                return await self._exchange(conn, seq, table, frames, probe)
            except R3Error as e:
                if getattr(e, "fatal", True):
                    # Transport failure, timeout, protocol error, or a fatal error frame: the
                    # stream state is unknown, so never reuse it.
                    await self._drop()
                raise
            except BaseException:
                await self._drop()
                raise

    async def _exchange(
        self, conn: Conn, seq: int, table: list[dict[str, Any]], frames: list[PayloadBuffer], probe: bool
    ) -> PushAck:
        limits = self.limits
        header = batch_header(seq, table, [payload_nbytes(f) for f in frames], probe=probe)
        # Post the reply receive first: if the server refuses the message part-way (limits)
        # it answers with an error frame and closes, which fails our remaining sends. The
        # error frame, not the broken pipe, is what the caller must see.
        reply = asyncio.ensure_future(recv_reply(conn, self._version, seq, limits))
        try:
            try:
                await send_message(conn, self._version, Kind.BATCH, header, frames, timeout=limits.timeout_s)
            except (TransportError, R3TimeoutError) as send_error:
                try:
                    await asyncio.wait_for(asyncio.shield(reply), min(limits.timeout_s, 2.0))
                except R3Error as typed:
                    if not isinstance(typed, (TransportError, R3TimeoutError)):
                        raise typed from send_error
                except (TimeoutError, Exception):
                    pass
                raise
            return await reply
        finally:
            if not reply.done():
                reply.cancel()
                await asyncio.gather(reply, return_exceptions=True)
