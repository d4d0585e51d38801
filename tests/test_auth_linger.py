"""What a connection costs the node after its fatal ERROR frame.

The node waits for the peer to close after a fatal frame so that the frame is read before the
connection goes (the stalled-sender fix, issue 31: ucxx closes without flushing). That wait
used to last up to ``timeout_s`` (30 s by default) for every peer, so a peer that failed the
hello (wrong secret, random proof, proof over swapped nonces, a batch before HELLO) kept its
connection open for as long. Now an unauthenticated peer is closed right after its frame, and
an authenticated one that never closes is closed after a short bounded linger.

Each test measures, from the peer's side, the time from reading the typed error to seeing the
node close the connection. The server keeps the default ``timeout_s`` of 30 s, so the old
behaviour fails every bound here. Loopback (in-process) and UCXX (a node in another process,
on 127.0.0.1, port 0) run the same tests.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from r3rdma.errors import AuthenticationError, ProtocolError, R3TimeoutError, TransportError
from r3rdma.transport import TransportLimits, auth
from r3rdma.transport.frames import PROTOCOL_VERSION, SUPPORTED_VERSIONS, Kind, error_from_header
from r3rdma.transport.session import client_handshake, recv_header, recv_preamble, recv_reply, send_message
from r3rdma.transport.testing import LoopbackHarness, UcxxProcessHarness

pytestmark = pytest.mark.timeout(120)

SECRET = b"auth-linger-secret-0123456789abcdef"
# The default timeout_s (30 s), which the old linger waited for in full.
SERVER_LIMITS = TransportLimits(timeout_s=30.0)
# A generous connect deadline: connecting is not what is measured, and the VM may be busy.
CLIENT_LIMITS = TransportLimits(timeout_s=5.0, ack_timeout_s=5.0, connect_timeout_s=20.0)
T = CLIENT_LIMITS.timeout_s
# Both bounds are far under the old 30 s. An unauthenticated peer is closed right after its
# frame; an authenticated one after at most ~2 s; the rest is slack for a loaded 2-core VM.
UNAUTHENTICATED_CLOSE_S = 2.0
AUTHENTICATED_CLOSE_S = 3.0


@pytest.fixture(scope="module")
def ucxx_harness():
    """A UcxxServer node in another process, on 127.0.0.1 and a free port, for the module."""
    h = UcxxProcessHarness(SECRET, SERVER_LIMITS)
    h.spawn()
    yield h
    h.kill()


@pytest.fixture(params=["loopback", "ucxx"])
def harness(request):
    """The node under test: in-process loopback, or the UCXX node process."""
    if request.param == "loopback":
        return LoopbackHarness(SECRET, SERVER_LIMITS)
    return request.getfixturevalue("ucxx_harness")


def run(coro, timeout: float = 60.0):
    """Run ``coro`` in a fresh event loop, failing after ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def raw_conn(harness):
    """A connection to the harness's node with no hello yet."""
    return await harness.client(SECRET, CLIENT_LIMITS)._open()


async def reply(conn, kind: Kind, version: int | None):
    """The node's ``kind`` answer; its ERROR frame raised as the typed error it carries."""
    pre = await recv_preamble(conn, T, f"waiting for {kind.name}")
    header = await recv_header(conn, pre, 1 << 14, T, f"receiving {kind.name}")
    if pre.kind is Kind.ERROR:
        raise error_from_header(header)
    assert pre.kind is kind and (version is None or pre.version == version), pre
    return header


async def hello_with_proof(conn, proof_of) -> None:
    """The client half of the hello, with the AUTH proof computed by ``proof_of(version, cn, sn)``."""
    client_nonce = auth.new_nonce()
    hello = {"versions": list(SUPPORTED_VERSIONS), "nonce": client_nonce}
    await send_message(conn, PROTOCOL_VERSION, Kind.HELLO, hello, timeout=T)
    challenge = await reply(conn, Kind.CHALLENGE, None)
    version, server_nonce = challenge["version"], challenge["nonce"]
    await send_message(conn, version, Kind.AUTH, {"proof": proof_of(version, client_nonce, server_nonce)}, timeout=T)
    await reply(conn, Kind.AUTH_OK, version)


async def wrong_secret(conn) -> None:
    """The real client hello, with a secret the node does not hold."""
    await client_handshake(conn, auth.coerce_secret(b"not-the-secret-0123456789abcdef!"), CLIENT_LIMITS)


async def random_proof(conn) -> None:
    """A hello whose AUTH proof is 32 random bytes."""
    await hello_with_proof(conn, lambda v, cn, sn: os.urandom(32))


async def swapped_nonces(conn) -> None:
    """A hello whose proof uses the right secret over the nonces in the wrong order."""
    secret = auth.coerce_secret(SECRET)
    await hello_with_proof(conn, lambda v, cn, sn: auth.client_proof(secret, v, sn, cn))


async def batch_before_hello(conn) -> None:
    """A BATCH where the HELLO belongs (a ProtocolError, before any authentication)."""
    await send_message(conn, PROTOCOL_VERSION, Kind.BATCH, {"seq": 1, "frames": [], "records": []}, timeout=T)
    await reply(conn, Kind.CHALLENGE, None)


async def seconds_until_closed(conn, bound: float, who: str) -> float:
    """Wait (at most ``bound`` s) for the node to close ``conn`` without closing it ourselves;
    return how long it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        pre = await recv_preamble(conn, bound, "waiting for the node to close")
    except TransportError:
        return loop.time() - start
    except R3TimeoutError:
        pytest.fail(f"the node kept the connection of {who} open for more than {bound:g} s after its fatal error")
    pytest.fail(f"the node sent {pre.kind.name} after a fatal error instead of closing")


@pytest.mark.parametrize(
    ("attempt", "error"),
    [
        (wrong_secret, AuthenticationError),
        (random_proof, AuthenticationError),
        (swapped_nonces, AuthenticationError),
        (batch_before_hello, ProtocolError),
    ],
    ids=lambda p: getattr(p, "__name__", ""),
)
def test_unauthenticated_peer_is_closed_right_after_its_error(harness, attempt, error):
    """A peer that failed or broke the hello reads its typed error, then the node closes the
    connection at once (it used to keep it open for timeout_s, 30 s), though the peer never
    closes."""

    async def main():
        await harness.start()
        conn = await raw_conn(harness)
        try:
            with pytest.raises(error) as caught:  # the typed error first
                await attempt(conn)
            assert type(caught.value) is error
            took = await seconds_until_closed(conn, UNAUTHENTICATED_CLOSE_S, "an unauthenticated peer")
            print(f"{harness.kind} {attempt.__name__}: closed {took:.3f} s after the {error.__name__} frame")
            assert took < UNAUTHENTICATED_CLOSE_S
        finally:
            await conn.close()
            await harness.stop()

    run(main())


def test_authenticated_peer_gets_its_fatal_error_and_a_bounded_linger(harness):
    """A protocol violation after the hello (a second HELLO where a batch belongs) draws a
    fatal ProtocolError. The peer reads it, then never closes: the node must not hold the
    connection for timeout_s, but it does linger a little (the peer's chance to read)."""

    async def main():
        await harness.start()
        conn = await raw_conn(harness)
        try:
            version = await client_handshake(conn, auth.coerce_secret(SECRET), CLIENT_LIMITS)
            # Small enough to travel inline in the preamble message: nothing is left unread
            # on the node's side (an unread message would end its linger at once).
            again = {"versions": list(SUPPORTED_VERSIONS), "nonce": auth.new_nonce()}
            await send_message(conn, version, Kind.HELLO, again, timeout=T)
            with pytest.raises(ProtocolError, match="expected a BATCH") as caught:
                await recv_reply(conn, version, 1, CLIENT_LIMITS)
            assert caught.value.fatal
            assert not conn.closed, "the node closed before its frame was read"
            took = await seconds_until_closed(conn, AUTHENTICATED_CLOSE_S, "an authenticated peer")
            print(f"{harness.kind}: closed {took:.3f} s after the fatal ProtocolError frame")
            assert took < AUTHENTICATED_CLOSE_S
            # It did wait for the peer (~2 s); the lower bound leaves room for a late read.
            assert took > 0.5, f"the node closed {took:.3f} s after the frame: no linger left"
        finally:
            await conn.close()
            await harness.stop()

    run(main())
