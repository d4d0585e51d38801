"""r3rdma's own HTTP client for store nodes (r3rdma.read.node_http) and the reader's decode jobs
(r3rdma.read.jobs): what a node may answer (ranges, whole files, chunked bodies, a node that
ignores Range, closes connections, fails for a moment, answers slowly), how many connections a
reader opens, and how a read waits for its jobs and hears of their failures."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import numpy as np
import pytest
from aiohttp import web
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype

from r3rdma.errors import AuthenticationError, StoreError, TransportError
from r3rdma.read.http_errors import HTTPStatusError, read_error
from r3rdma.read.jobs import JobBatch
from r3rdma.read.node_http import NodeHTTPStore
from r3rdma.read.reader import RoutingReader
from r3rdma.store.local_store import LocalRoutingStore

from .store_nodes import serve_in_thread

BLOB = bytes(np.random.default_rng(7).integers(0, 256, size=300_000, dtype=np.uint8))
PROTO = default_buffer_prototype()


def _range(request: web.Request) -> tuple[int, int]:
    start, stop, _ = request.http_range.indices(len(BLOB))
    return start, stop


class Node:
    """A stand-in node serving ``BLOB`` at ``/zarr/blob`` in the way ``mode`` says, counting
    requests and the client connections they came on."""

    def __init__(self, mode: str = "plain") -> None:
        self.mode = mode
        self.requests = 0
        self.peers: set[tuple] = set()
        self.failures_left = 0  # 503s to answer before serving
        self.release = threading.Event()  # ends "hang" handlers
        app = web.Application()
        app.router.add_route("*", "/zarr/{path:.*}", self.handle)
        self._serving: contextlib.AbstractContextManager[str] | None = serve_in_thread(app)
        self.url = self._serving.__enter__()

    def close(self) -> None:
        """Stop serving (again: nothing)."""
        self.release.set()
        if self._serving is not None:
            self._serving.__exit__(None, None, None)
            self._serving = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Answer one request as ``mode`` says."""
        self.requests += 1
        self.peers.add(request.transport.get_extra_info("peername"))
        if request.headers.get("Authorization") != "Bearer secret":
            return web.Response(status=401, text="no\n")
        if request.match_info["path"] != "blob":
            raise web.HTTPNotFound()
        if self.failures_left:
            self.failures_left -= 1
            return web.Response(status=503, text="busy\n")
        start, stop = _range(request) if "Range" in request.headers and self.mode != "ignore-range" else (0, len(BLOB))
        status = 206 if (start, stop) != (0, len(BLOB)) else 200
        body = BLOB[start:stop]
        if request.method == "HEAD":
            return web.Response(status=200, headers={"Content-Length": str(len(BLOB))})
        if self.mode == "chunked":
            response = web.StreamResponse(status=status)
            response.enable_chunked_encoding()
            await response.prepare(request)
            for i in range(0, len(body), 7000):
                await response.write(body[i : i + 7000])
            await response.write_eof()
            return response
        if self.mode == "trickle":  # slower than the timeout in all, never silent that long
            response = web.StreamResponse(status=status, headers={"Content-Length": str(len(body))})
            await response.prepare(request)
            for i in range(0, len(body), len(body) // 8 + 1):
                await asyncio.sleep(0.1)
                await response.write(body[i : i + len(body) // 8 + 1])
            await response.write_eof()
            return response
        if self.mode == "hang":  # accepts, never answers (until the test ends)
            await asyncio.to_thread(self.release.wait, 30)
            raise web.HTTPServiceUnavailable()
        headers = {"Connection": "close"} if self.mode == "close" else {}
        return web.Response(status=status, body=body, headers=headers)


@pytest.fixture
def node():
    """Start stand-in nodes (``node(mode)``); all stopped at the end."""
    started: list[Node] = []

    def start(mode: str = "plain") -> Node:
        started.append(Node(mode))
        return started[-1]

    yield start
    for n in started:
        n.close()


def run(coro):
    """``coro``'s result, on an event loop of its own."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def _bytes(buffer) -> bytes:
    return buffer.to_bytes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["plain", "chunked", "ignore-range", "close"])
def test_every_kind_of_request_reads_the_right_bytes(node, mode):
    """A range, an open range, a suffix, the whole file, its size; chunked bodies, a node that
    sends the whole file for a range, and one that closes each connection read the same."""
    n = node(mode)
    store = NodeHTTPStore(n.url, "secret", 10)

    async def reads():
        return [
            _bytes(await store.get("blob", PROTO, RangeByteRequest(1000, 91_000))),
            _bytes(await store.get("blob", PROTO, OffsetByteRequest(299_000))),
            _bytes(await store.get("blob", PROTO, SuffixByteRequest(10))),
            _bytes(await store.get("blob", PROTO)),
            _bytes(await store.get("blob", PROTO, RangeByteRequest(5, 5))),
            await store.getsize("blob"),
            await store.exists("blob"),
            await store.exists("nothing"),
            await store.get("nothing", PROTO),
        ]

    got = run(reads())
    assert got == [BLOB[1000:91_000], BLOB[299_000:], BLOB[-10:], BLOB, b"", len(BLOB), True, False, None]


@pytest.mark.timeout(60)
def test_kept_alive_connections_are_reused_and_capped(node):
    """Requests one after another share one connection; 40 at once open no more than 8."""
    n = node()
    store = NodeHTTPStore(n.url, "secret", 10)

    async def one_by_one():
        for i in range(10):
            assert _bytes(await store.get("blob", PROTO, RangeByteRequest(i, i + 100))) == BLOB[i : i + 100]

    loop = asyncio.new_event_loop()
    loop.run_until_complete(one_by_one())
    assert n.requests == 10 and len(n.peers) == 1

    async def at_once():
        got = await asyncio.gather(*(store.get("blob", PROTO, RangeByteRequest(i, i + 5000)) for i in range(40)))
        assert [_bytes(b) for b in got] == [BLOB[i : i + 5000] for i in range(40)]

    loop.run_until_complete(at_once())
    assert n.requests == 50 and 1 < len(n.peers) <= 8
    store.close()
    loop.close()


@pytest.mark.timeout(60)
def test_a_connection_the_node_closed_while_idle_is_replaced(node):
    """The node drops kept-alive connections (a restart, its keep-alive timeout): the next
    request goes on a new connection, with no error."""
    n = node()
    store = NodeHTTPStore(n.url, "secret", 10)
    loop = asyncio.new_event_loop()
    assert _bytes(loop.run_until_complete(store.get("blob", PROTO, RangeByteRequest(0, 10)))) == BLOB[:10]
    (pool,) = store._pools.values()
    for connection in pool.idle:  # what the node's side closing looks like to the client
        connection.transport.abort()
    loop.run_until_complete(asyncio.sleep(0.05))
    assert _bytes(loop.run_until_complete(store.get("blob", PROTO, RangeByteRequest(10, 20)))) == BLOB[10:20]
    assert len(n.peers) == 2
    loop.close()


@pytest.mark.timeout(60)
def test_a_node_failing_for_a_moment_is_tried_again(node):
    """Two 503s, then the data: read (two tries more); three 503s: the failure, as StoreError
    through the reader's mapping."""
    n = node()
    store = NodeHTTPStore(n.url, "secret", 10)
    n.failures_left = 2
    assert _bytes(run(store.get("blob", PROTO, RangeByteRequest(0, 100)))) == BLOB[:100]
    assert n.requests == 3
    n.failures_left = 3
    with pytest.raises(HTTPStatusError) as raised:
        run(store.get("blob", PROTO, RangeByteRequest(0, 100)))
    assert raised.value.status == 503 and n.requests == 6
    mapped = read_error(n.url, "GET blob", raised.value)
    assert isinstance(mapped, StoreError) and "HTTP 503" in str(mapped) and n.url in str(mapped)


@pytest.mark.timeout(60)
def test_the_timeout_bounds_each_wait_not_the_whole_answer(node):
    """A body that takes longer than ``timeout_s`` in all, but never stays silent that long, is
    read; ``timeout_s`` is per wait for bytes, as documented."""
    n = node("trickle")
    store = NodeHTTPStore(n.url, "secret", 0.5)
    assert _bytes(run(store.get("blob", PROTO, RangeByteRequest(0, 200_000)))) == BLOB[:200_000]


@pytest.mark.timeout(60)
def test_refused_tokens_and_node_failures_say_what_happened(node, tmp_path, make_record):
    """Through a reader: a refused token is AuthenticationError, a node gone is TransportError."""
    n = node()
    reader = RoutingReader(n.url, token="wrong", timeout_s=5)
    with reader, pytest.raises(AuthenticationError, match="HTTP 401"):
        reader.info("roll-0")
    n.close()
    reader = RoutingReader(n.url, token="secret", timeout_s=5)
    with reader, pytest.raises(TransportError, match="ConnectionRefused"):
        reader.info("roll-0")


@pytest.mark.timeout(60)
def test_packed_reads_land_in_place_and_match_whole_reads(tmp_path, make_record):
    """Rows decoded straight into the packed buffer (no per-request array first) equal the
    per-request reads, with layers and rows chosen, over a shared chunk."""
    recs = [make_record(f"r{i}", rows=40 + 13 * i, layers=8, k=4, num_experts=60) for i in range(6)]
    with LocalRoutingStore(tmp_path, chunk_rows=16, layers_per_chunk=2) as store:
        store.commit(recs)
    rows = {"r1": [(3, 20), (40, 52)], "r4": [(0, 1)], "r5": []}
    layer_map = list(recs[0].layer_map)
    cols = [5, 2, 3]
    with RoutingReader(tmp_path) as reader:
        packed = reader.get_packed("roll-0", ["r5", "r1", "r4", "r0"], layers=[layer_map[c] for c in cols], rows=rows)
        arrays = reader.get_numpy("roll-0", ["r5", "r1", "r4", "r0"], layers=[layer_map[c] for c in cols], rows=rows)
    want = {
        "r5": recs[5].ids_TLK[:0][:, cols],
        "r1": np.concatenate([recs[1].ids_TLK[3:20], recs[1].ids_TLK[40:52]])[:, cols],
        "r4": recs[4].ids_TLK[0:1][:, cols],
        "r0": recs[0].ids_TLK[:, cols],
    }
    cu = packed.cu_seqlens.tolist()
    for i, rid in enumerate(["r5", "r1", "r4", "r0"]):
        np.testing.assert_array_equal(arrays[rid], want[rid])
        np.testing.assert_array_equal(packed.ids_TLK[cu[i] : cu[i + 1]].numpy(), want[rid])


# -- decode jobs ----------------------------------------------------------------------------


def test_a_batch_waits_for_every_job_and_raises_the_first_failure():
    """Every job put is run before wait() returns; the first failure is raised and jobs put
    after it are skipped; a read that stops its batch hears of no job's failure."""
    done: list[int] = []
    lock = threading.Lock()

    def job(i: int) -> None:
        with lock:
            done.append(i)

    def bad(message: str) -> None:
        raise ValueError(message)

    async def ok():
        batch = JobBatch()
        for i in range(50):
            batch.put(job, i)
        await batch.wait()
        return sorted(done)

    assert run(ok()) == list(range(50))

    async def failing():
        batch = JobBatch()
        batch.put(bad, "first")
        await asyncio.sleep(0.05)  # the failure is in: what comes later is skipped
        batch.put(job, 99)
        await batch.wait()

    with pytest.raises(ValueError, match="first"):
        run(failing())
    assert 99 not in done

    async def stopped():
        batch = JobBatch()
        batch.put(bad, "ignored")
        await batch.wait(stop=True)  # a read that failed already: its jobs' errors are not raised

    run(stopped())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", [0, 3])
def test_layer_groups_and_whole_layer_chunks_read_exact(tmp_path, make_record, level):
    """A stage reading exactly one layer group, some rows of a request spanning whole chunks,
    and chunks holding every layer read back as the records hold them; a flipped byte in a
    chunk is refused."""
    from r3rdma.errors import CorruptDataError

    recs = [make_record(f"r{i}", rows=70 + 20 * i, layers=8, k=4, num_experts=60) for i in range(4)]
    with LocalRoutingStore(tmp_path / "groups", zstd_level=level, chunk_rows=16, layers_per_chunk=2) as store:
        store.commit(recs)
    with LocalRoutingStore(tmp_path / "whole", zstd_level=level, chunk_rows=16, layers_per_chunk=8) as store:
        store.commit(recs)
    ids = [r.request_id for r in recs]
    with RoutingReader(tmp_path / "groups") as reader:
        got = reader.get_numpy("roll-0", ids, layers=[2, 3], rows={"r1": [(5, 80)]})
    np.testing.assert_array_equal(got["r1"], recs[1].ids_TLK[5:80, 2:4])
    for r in (recs[0], recs[2], recs[3]):
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK[:, 2:4])
    with RoutingReader(tmp_path / "whole") as reader:
        packed = reader.get_packed("roll-0", ids)
    np.testing.assert_array_equal(packed.ids_TLK.numpy(), np.concatenate([r.ids_TLK for r in recs]))
    shard = tmp_path / "whole" / "roll-0" / "b00000001" / "c" / "0" / "0" / "0"
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    shard.write_bytes(bytes(blob))
    with RoutingReader(tmp_path / "whole") as reader, pytest.raises(CorruptDataError):
        reader.get_numpy("roll-0", ids)


@pytest.mark.timeout(60)
def test_a_prefetch_says_a_batch_is_gone_when_its_turn_comes(tmp_path, make_record, monkeypatch):
    """Loads start ahead of the consumer; a batch whose request is gone by then (deleted) fails
    when that batch is asked for, after the batches before it are yielded whole."""
    from r3rdma.errors import UnknownRequestError

    recs = [make_record(f"r{i}", rows=20 + i) for i in range(6)]
    with LocalRoutingStore(tmp_path) as store:
        store.commit(recs)
    with RoutingReader(tmp_path) as reader:
        stream = reader.prefetch("roll-0", [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]], depth=2)
        real = reader._indexes.require

        def require(rollout_id, request_ids):
            if "r5" in request_ids:  # what the index says once r5 is deleted
                raise UnknownRequestError(f"rollout {rollout_id!r} has no committed request 'r5'")
            return real(rollout_id, request_ids)

        monkeypatch.setattr(reader._indexes, "require", require)
        got = [next(stream).request_ids, next(stream).request_ids]  # the second starts the third's load
        assert got == [("r0", "r1"), ("r2", "r3")]
        with pytest.raises(UnknownRequestError, match="r5"):
            next(stream)
        np.testing.assert_array_equal(reader.get_numpy("roll-0", ["r4"])["r4"], recs[4].ids_TLK)


@pytest.mark.timeout(60)
def test_a_node_that_stops_answering_fails_every_queued_request_together(node):
    """40 GETs at once to a node that accepts and never answers: the 8 on connections time out,
    and the 32 waiting for a connection fail with them, not one timeout after another (they
    never reach the node)."""
    n = node("hang")
    store = NodeHTTPStore(n.url, "secret", 0.5)

    async def at_once():
        return await asyncio.gather(
            *(store.get("blob", PROTO, RangeByteRequest(i, i + 10)) for i in range(40)), return_exceptions=True
        )

    got = run(at_once())
    assert all(isinstance(g, TimeoutError) for g in got)
    assert n.requests == 8
