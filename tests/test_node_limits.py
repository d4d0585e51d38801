"""Issue 19: a store node's limits against restarts, stalled senders and slow HTTP clients.

Real store nodes in subprocesses (r3rdma.store.process.spawn_node), UCX over TCP loopback.
"""

import asyncio
import socket

import numpy as np
import pytest

from r3rdma.testing.failover import announce_and_stall, stall_while_pushing
from r3rdma.testing.harness import _visible, free_port, make_record
from r3rdma.records import RequestRecord
from r3rdma.transport import TransportLimits, configure_ucx_env
from r3rdma.write.push_client import StoreNodesClient

from .store_nodes import new_token, start_node


def test_restart_on_fixed_port_right_after_sigkill(tmp_path):
    """The documented cluster set-up uses fixed ports: a node killed with connections open
    leaves them in TIME_WAIT / FIN_WAIT on its port, and a restart must still bind at once
    (UCX_TCP_CM_REUSEADDR=y in STORE_NODE_UCX_ENV)."""
    configure_ucx_env()
    port, token = free_port(), new_token()
    node = start_node(tmp_path / "root", token, "--ucx-port", str(port), "--timeout-s", "10")
    try:
        assert node.ucx_port == port
        with StoreNodesClient([node.push_url], secret=token, limits=TransportLimits(timeout_s=10)) as client:
            client.commit([make_record("restart", "before")])
            node.kill()  # SIGKILL with the connection open: the node's side closes first
    finally:
        node.kill()
    again = start_node(tmp_path / "root", token, "--ucx-port", str(port), "--timeout-s", "10")
    try:
        assert again.ucx_port == port
        with StoreNodesClient([again.push_url], secret=token, limits=TransportLimits(timeout_s=10)) as client:
            client.commit([make_record("restart", "after")])
        assert set(_visible([again.root])["restart"]) == {"before", "after"}
    finally:
        again.kill()


def test_http_connection_with_a_partial_request_is_closed_within_the_timeout(tmp_path):
    """A socket that sends half a request line and then nothing must not stay open until the
    fd limit: the node closes it within its --timeout-s (here 2 s)."""
    node = start_node(tmp_path / "root", new_token(), "--timeout-s", "2")
    try:
        with socket.create_connection((node.host, node.http_port), timeout=10) as s:
            s.sendall(b"GET /healthz HT")  # no end of line, no headers
            s.settimeout(2 + 8)  # the node's timeout plus slack for a loaded machine
            try:
                got = s.recv(4096)
            except ConnectionResetError:
                got = b""
            except TimeoutError:
                pytest.fail("the node kept a connection with a partial request line open past its timeout")
            assert got == b"" or got.startswith(b"HTTP/1.1 4"), got
        # Complete requests are still served (the timer covers waiting for a request only).
        with socket.create_connection((node.host, node.http_port), timeout=10) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        node.kill()


def test_start_script_passes_inflight_budget_and_timeout_to_the_nodes(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, R3_STORE_BIN=str(Path(sys.executable).parent / "r3rdma-store"))
    out = subprocess.run([str(repo / "scripts/start_store_nodes.sh"), "1", "--dir", str(tmp_path),
                          "--max-inflight-mb", "48", "--timeout-s", "7.5"],
                         capture_output=True, text=True, timeout=120, env=env)
    try:
        assert out.returncode == 0, out.stderr
        pid = (tmp_path / "node0.pid").read_text().strip()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        i, j = argv.index(b"--max-inflight-mb"), argv.index(b"--timeout-s")
        assert (argv[i + 1], argv[j + 1]) == (b"48", b"7.5")
    finally:
        subprocess.run([str(repo / "scripts/stop_store_nodes.sh"), str(tmp_path)], capture_output=True, timeout=120)


def _stall_node(tmp_path, *extra):
    return start_node(tmp_path / "root", new_token(), "--max-payload-mb", "256", "--timeout-s", "3", *extra)


def test_stalled_senders_cost_no_memory_get_a_typed_timeout_and_release_the_budget(tmp_path):
    """Issue 19: six authenticated connections announcing 255 MiB each and sending nothing
    raised a node from 72 MiB to 1.6 GiB. Now: memory is committed only as bytes land, a
    normal client pushes meanwhile, and each staller gets an R3TimeoutError frame (fatal)
    after the node's timeout, its budget given back."""
    from r3rdma.errors import R3TimeoutError

    configure_ucx_env()
    node = _stall_node(tmp_path, "--max-inflight-mb", "1024")
    try:
        base = node.rss()
        rng = np.random.default_rng(0)
        normal = RequestRecord("stall", "normal", rng.integers(0, 64, (512, 8, 4), dtype=np.uint8), tuple(range(8)), 64)

        run = stall_while_pushing(node, normal, connections=6, payload_mb=255)
        ack, pushed_while_stalled, outcomes = asyncio.run(asyncio.wait_for(run, 120))
        assert ack.requests == 1 and pushed_while_stalled
        # Four fit the 1 GiB budget and stall on their payload; two wait for room. All six are
        # answered with a typed, fatal timeout (stalled payload, or no room in time).
        assert all(isinstance(o, R3TimeoutError) and o.fatal for o in outcomes), outcomes
        assert sum("payload" in str(o) for o in outcomes) >= 4, outcomes
        grown = node.peak_rss() - base
        assert grown < 128 << 20, f"node grew by {grown >> 20} MiB while 6 x 255 MiB were announced"
        # The budget was given back: a batch of the whole budget's size fits again.
        rows = (200 << 20) // 32
        big = RequestRecord("stall", "big", np.ones((rows, 8, 4), np.uint8), tuple(range(8)), 64)
        with StoreNodesClient([node.push_url], secret=node.token, limits=TransportLimits(timeout_s=10)) as c:
            c.commit([big])
        assert set(_visible([node.root])["stall"]) == {"normal", "big"}
    finally:
        node.kill()


def test_announced_batches_without_checksums_are_refused_before_any_allocation(tmp_path):
    """The issue's variant: with crc32c null the node zero-filled each announced 255 MiB
    buffer at once (1.6 GiB for six connections). Now such a batch is a ProtocolError."""
    from r3rdma.errors import ProtocolError
    from r3rdma.transport.session import recv_reply

    configure_ucx_env()
    node = _stall_node(tmp_path, "--max-inflight-mb", "2048")
    try:
        base = node.rss()

        async def run():
            stallers = [await announce_and_stall(node, 255, with_crc=False) for _ in range(6)]
            # Answered at once (well before the 3 s stall deadline would answer anything).
            outcomes = await asyncio.gather(
                *(asyncio.wait_for(recv_reply(c, v, 1, TransportLimits()), 2.5) for c, v in stallers),
                return_exceptions=True,
            )
            for c, _ in stallers:
                await c.close()
            return outcomes

        outcomes = asyncio.run(asyncio.wait_for(run(), 120))
        assert all(isinstance(o, ProtocolError) and "crc32c" in str(o) for o in outcomes), outcomes
        grown = node.peak_rss() - base
        assert grown < 64 << 20, f"node grew by {grown >> 20} MiB"
        assert node.alive
    finally:
        node.kill()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("client_closes", [True, False])
def test_a_fatal_error_frame_is_read_before_the_server_closes(client_closes):
    """Issue 31, item 12: under load one stalled sender of the test above got
    TransportError(... UCXXCanceledError ...) instead of its R3TimeoutError frame: the server
    closed the connection right after sending the frame, and ucxx closes endpoints without
    flushing, so the peer's waiting receive could be cancelled by the reset before the frame
    was matched. The server now closes after a fatal frame only once the peer closed (or
    timeout_s passed). Shown deterministically over the loopback transport (the same protocol
    code): right after the sender reads the frame its connection is still open."""
    import msgpack

    from r3rdma.errors import R3TimeoutError
    from r3rdma.transport import LoopbackClient, LoopbackServer
    from r3rdma.transport.auth import coerce_secret
    from r3rdma.transport.batch import RecordMeta, batch_header
    from r3rdma.transport.frames import Kind, Preamble
    from r3rdma.transport.session import client_handshake, recv_reply

    secret = new_token()
    limits = TransportLimits(timeout_s=1.0)

    async def run():
        async def handler(_records):
            return None

        server = LoopbackServer(handler, secret=secret, limits=limits)
        await server.start()
        conn = await LoopbackClient(server, secret=secret, limits=limits)._open()
        version = await client_handshake(conn, coerce_secret(secret), limits)
        meta = RecordMeta("stall", "s", 4096, 8, 4, "uint8", 64, tuple(range(8)), 0, 0x1234, 0)
        header = msgpack.packb(batch_header(1, [meta.to_wire()], [meta.nbytes]))
        # A batch announced with its table, and not one payload byte.
        await conn.send(np.frombuffer(Preamble(version, Kind.BATCH, len(header), meta.nbytes).pack() + header, np.uint8))
        with pytest.raises(R3TimeoutError, match="sender stalled") as caught:
            await recv_reply(conn, version, 1, TransportLimits(ack_timeout_s=30))
        assert caught.value.fatal
        assert not conn.closed, "the server closed before the sender could read its error frame"
        deadline = asyncio.get_running_loop().time() + 5 * limits.timeout_s
        while server.inflight_bytes:  # the budget comes back while the server waits for the close
            assert asyncio.get_running_loop().time() < deadline, "the stalled batch kept its budget"
            await asyncio.sleep(0.001)
        for _ in range(100):  # the server's next steps run (the old one closed within a few)
            await asyncio.sleep(0)
        assert not conn.closed, "the server closed before the sender closed"
        if client_closes:
            await conn.close()
        else:  # a sender that never closes is closed by the server after timeout_s
            while not conn.closed:
                assert asyncio.get_running_loop().time() < deadline, "the server kept the connection open"
                await asyncio.sleep(0.01)
        await server.stop()

    asyncio.run(asyncio.wait_for(run(), 30))
