"""Remote reads of whole batch arrays through NodeHttpClient: bit-exact against zarr, damage
refused, other layouts declined (the reader then goes through zarr), and chunks decoded while
the shard is still arriving. Failures say what happened on every remote read path (a refused
token, a node-side failure, a refused or dropped connection, a timeout, damaged bytes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import zarr
from aiohttp import web
from zarr.codecs import BloscCodec
from zarr.storage import LocalStore

from r3rdma.store import shard_codec
from r3rdma.errors import (
    AuthenticationError,
    CorruptDataError,
    R3TimeoutError,
    StoreError,
    TransportError,
)
from r3rdma.store.local_store import LocalRoutingStore, zarr_codecs
from r3rdma.read.node_http import NodeHttpClient
from r3rdma.records import buffer_checksum
from r3rdma.read.reader import RoutingReader
from r3rdma.store.row_checksums import RowRangeChecksums

from .store_nodes import new_token, start_node

SHARD = ("c", "0", "0", "0")


def populate(root: Path, make_record, *, level: int, chunk_rows: int = 16) -> list:
    records = [make_record(f"r{i}", rows=17 + 9 * i, layers=4, k=3, num_experts=40) for i in range(6)]
    with LocalRoutingStore(root, zstd_level=level, chunk_rows=chunk_rows) as store:
        store.commit(records[:4])  # b00000001: 4 requests, several 16-row chunks, a partial last one
        store.commit(records[4:])
    return records


@pytest.fixture
def node_root(tmp_path):
    started = []

    def start(root: Path):
        node = start_node(root, new_token())
        started.append(node)
        return node

    yield start
    for node in started:
        node.stop()


@pytest.mark.parametrize("level", [0, 3])
def test_whole_arrays_are_bit_exact(tmp_path, make_record, node_root, level):
    root = tmp_path / "node"
    records = populate(root, make_record, level=level)
    node = node_root(root)
    assert_reads_back(node, records)
    client = NodeHttpClient(node.http_url, node.read_token)
    try:
        whole = client.read_array("roll-0/b00000001", "test").array
        want = zarr.open_array(LocalStore(root), path="roll-0/b00000001", mode="r")[:]
        assert whole is not None and whole.dtype == want.dtype and np.array_equal(whole, want)
        assert client.get_json("roll-0/nope/zarr.json") is None
    finally:
        client.close()


@pytest.mark.parametrize("level", [0, 3])  # 0: chunks are checked and copied in runs
@pytest.mark.parametrize("damage", ["last-chunk", "middle-chunk", "index", "truncated", "metadata"])
def test_damage_is_refused(tmp_path, make_record, node_root, damage, level):
    root = tmp_path / "node"
    records = populate(root, make_record, level=level)
    shard = root.joinpath("roll-0", "b00000001", *SHARD)
    blob = bytearray(shard.read_bytes())
    if damage == "last-chunk":
        # The index is at the start: the end is the last chunk (uncompressed: its padding
        # past the array's last row, which the chunk's CRC covers too).
        blob[-10] ^= 0xFF
        shard.write_bytes(bytes(blob))
    elif damage == "middle-chunk":
        blob[len(blob) // 2] ^= 0x01
        shard.write_bytes(bytes(blob))
    elif damage == "index":
        blob[10] ^= 0xFF
        shard.write_bytes(bytes(blob))
    elif damage == "truncated":
        shard.write_bytes(bytes(blob[: len(blob) // 2]))
    else:
        (root / "roll-0" / "b00000001" / "zarr.json").unlink()
    node = node_root(root)
    with RoutingReader(node.http_url, token=node.read_token) as reader:
        with pytest.raises(CorruptDataError, match="b00000001"):
            reader.get_numpy("roll-0", [r.request_id for r in records[:4]])
        # The other array is intact and still reads.
        np.testing.assert_array_equal(reader.get_numpy("roll-0", ["r5"])["r5"], records[5].ids_TLK)


def rewrite_first_array(root: Path, **layout) -> np.ndarray:
    """Rewrite batch array b00000001 with another (valid Zarr) layout, same rows: the index's
    CRCs still hold. Returns its rows."""
    data = zarr.open_array(LocalStore(root), path="roll-0/b00000001", mode="r")[:]
    zarr.create_array(LocalStore(root / "roll-0"), name="b00000001", data=data, chunks=(16, 4, 3),
                      fill_value=0, overwrite=True, **layout)
    return data


def read_first_array(node) -> np.ndarray | None:
    client = NodeHttpClient(node.http_url, node.read_token)
    try:
        got = client.read_array("roll-0/b00000001", "test")
        return None if got is None else got.array
    finally:
        client.close()


def assert_reads_back(node, records) -> None:
    with RoutingReader(node.http_url, token=node.read_token) as reader:
        got = reader.get_numpy("roll-0", [r.request_id for r in records])
    for r in records:
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)


def test_other_layouts_are_declined_and_read_through_zarr(tmp_path, make_record, node_root):
    root = tmp_path / "node"
    records = populate(root, make_record, level=3)
    rewrite_first_array(root, shards=(32, 4, 3), compressors=BloscCodec(cname="lz4"))
    node = node_root(root)
    assert read_first_array(node) is None
    assert_reads_back(node, records)


def test_shards_with_the_index_at_the_end_still_read(tmp_path, make_record, node_root):
    """r3rdma wrote the shard index at the end before 2026-11-21: such data reads the same."""
    root = tmp_path / "node"
    records = populate(root, make_record, level=3)
    rows = sum(r.num_rows for r in records[:4])
    data = rewrite_first_array(root, shards={"shape": (-(-rows // 16) * 16, 4, 3), "index_location": "end"},
                               compressors=zarr_codecs(3))
    meta = json.loads((root / "roll-0" / "b00000001" / "zarr.json").read_text())
    assert meta["codecs"][0]["configuration"]["index_location"] == "end"
    node = node_root(root)
    whole = read_first_array(node)
    assert whole is not None and np.array_equal(whole, data)
    assert_reads_back(node, records)


@pytest.mark.parametrize("level", [0, 3])
def test_chunks_left_out_as_fill_read_back(tmp_path, make_record, node_root, level):
    """Zarr leaves an inner chunk whose rows are all the fill value (0) out of the shard; the
    chunks after it are still placed (uncompressed) or decoded, and it reads as 0."""
    from r3rdma.records import RequestRecord

    root = tmp_path / "node"
    base = make_record("zeros", rows=40, layers=4, k=3, num_experts=40)
    ids = base.ids_TLK.copy()
    ids[:32] = 0  # inner chunks 0 and 1 (16 rows each) are all fill
    records = [RequestRecord("roll-0", "zeros", ids, base.layer_map, 40), make_record("r1", rows=21, layers=4, k=3, num_experts=40)]
    with LocalRoutingStore(root, zstd_level=level, chunk_rows=16) as store:
        store.commit(records)
    node = node_root(root)
    whole = read_first_array(node)
    want = zarr.open_array(LocalStore(root), path="roll-0/b00000001", mode="r")[:]
    assert whole is not None and np.array_equal(whole, want) and not whole[:32].any()
    assert_reads_back(node, records)


def spread_chunks_apart(root: Path) -> None:
    """Rewrite b00000001's shard with 8 unused bytes before every chunk (valid Zarr: a shard's
    chunks lie wherever its index says)."""
    meta = json.loads((root / "roll-0" / "b00000001" / "zarr.json").read_text())
    decoder = shard_codec.ShardDecoder.of(meta)
    shard = root.joinpath("roll-0", "b00000001", *SHARD)
    blob = shard.read_bytes()
    n, gap = decoder.index_bytes, b"\xee" * 8
    index = np.frombuffer(blob[: n - 4], dtype="<u8").reshape(-1, 2).copy()
    parts = []
    for c, (offset, nbytes) in enumerate(index):
        parts += [gap, blob[offset : offset + nbytes]]
        index[c, 0] = n + sum(len(p) for p in parts) - nbytes
    raw_index = index.astype("<u8").tobytes()
    shard.write_bytes(raw_index + struct.pack("<I", buffer_checksum(raw_index)) + b"".join(parts))


def test_chunks_with_gaps_between_them_still_read(tmp_path, make_record, node_root):
    """With unused bytes between chunks an uncompressed shard cannot be placed in runs: its
    chunks are checked and copied one by one."""
    root = tmp_path / "node"
    records = populate(root, make_record, level=0)
    spread_chunks_apart(root)
    want = zarr.open_array(LocalStore(root), path="roll-0/b00000001", mode="r")[:]  # zarr reads it too
    node = node_root(root)
    whole = read_first_array(node)
    assert whole is not None and np.array_equal(whole, want)
    assert_reads_back(node, records)


@pytest.mark.timeout(60)
def test_wrong_token_is_an_authentication_error(tmp_path, make_record, node_root):
    """A refused token is AuthenticationError (a PermissionError) naming the node, the path and
    the status, never "corrupt data", and the token is in no message."""
    root = tmp_path / "node"
    populate(root, make_record, level=3)
    node = node_root(root)
    wrong = new_token()
    reader = RoutingReader(node.http_url, token=wrong)
    with reader, pytest.raises(AuthenticationError, match="HTTP 401") as raised:
        reader.info("roll-0")
    assert isinstance(raised.value, PermissionError)
    assert node.http_url in str(raised.value) and "/zarr/roll-0/zarr.json" in str(raised.value)
    assert wrong not in str(raised.value) and node.token not in str(raised.value)
    client = NodeHttpClient(node.http_url, wrong)
    try:  # the array path says the same (no internal HTTP status type leaks out)
        with pytest.raises(AuthenticationError, match=r"b00000001/c/0/0/0: HTTP 401"):
            client.read_array("roll-0/b00000001", "test")
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_a_refused_connection_is_a_transport_error(tmp_path):
    """Nothing listens on the port: TransportError (a ConnectionError, retryable)."""
    with socket.socket() as bound:  # bound, not listening: the kernel refuses connections
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        reader = RoutingReader(url, token="t")
        with reader, pytest.raises(TransportError, match="ConnectionRefusedError") as raised:
            reader.info("roll-0")
    assert isinstance(raised.value, ConnectionError) and url in str(raised.value)


@pytest.mark.timeout(60)
def test_a_node_that_never_answers_is_a_timeout(tmp_path):
    """The node accepts the connection and never answers: R3TimeoutError after ``timeout_s``."""
    with socket.socket() as silent:  # listening, never accepting: connects, no answer
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        reader = RoutingReader(url, token="t", timeout_s=0.3)
        with reader, pytest.raises(R3TimeoutError, match="did not answer in time") as raised:
            reader.info("roll-0")
    assert isinstance(raised.value, TimeoutError) and url in str(raised.value)


@contextlib.contextmanager
def serving(handler):
    """An aiohttp server on 127.0.0.1 that answers ``GET /zarr/{path}`` with ``handler``, in a
    thread; yields its base URL."""
    app = web.Application()
    app.router.add_get("/zarr/{path:.*}", handler)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.mark.parametrize("level", [0, 3])
def test_a_connection_lost_mid_shard_is_reported(tmp_path, make_record, level):
    """The node dies after sending half a shard: the read fails naming the array and how far it
    got (no hang, no half-filled array returned), and the next read on the same reader works."""
    root = tmp_path / "node"
    records = [make_record(f"r{i}", rows=3000, layers=48, k=8, num_experts=128) for i in range(4)]
    with LocalRoutingStore(root, zstd_level=level, chunk_rows=256) as store:
        store.commit(records)
    cut = {"on": True}

    async def serve(request: web.Request) -> web.StreamResponse:
        path = root / request.match_info["path"]
        if not path.is_file():
            raise web.HTTPNotFound()
        if path.parts[-4:] != SHARD or not cut["on"]:
            return web.FileResponse(path)
        body = path.read_bytes()
        response = web.StreamResponse(headers={"Content-Length": str(len(body))})
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
        request.transport.close()
        return response

    ids = [r.request_id for r in records]
    with serving(serve) as url, RoutingReader(url) as reader:
        # A transfer cut short is the connection's failure, not damage: worth a retry.
        with pytest.raises(TransportError, match=r"b00000001.*(shard body ended after \d+ of \d+ bytes|ConnectionResetError)"):
            reader.get_numpy("roll-0", ids)
        cut["on"] = False
        got = reader.get_numpy("roll-0", ids)
    for r in records:
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)


def test_chunks_decode_while_the_shard_streams(tmp_path, make_record, monkeypatch):
    """The server sends the first half of the shard, then holds the rest until a chunk of that
    half has been decoded. A reader that decodes only after the last byte would stall here.
    (The reader hands chunks to decoding every 1 MiB received: the shard is ~4.6 MB.)"""
    root = tmp_path / "node"
    records = [make_record(f"r{i}", rows=3000, layers=48, k=8, num_experts=128) for i in range(4)]
    with LocalRoutingStore(root, zstd_level=0, chunk_rows=256) as store:
        store.commit(records)
    decoded = threading.Event()
    held = {"released_by_decode": None}
    # Uncompressed chunks are placed in runs, compressed ones decoded one by one; then hashed.
    for cls, name in [(shard_codec.ShardDecoder, "place_run"), (shard_codec.ShardDecoder, "decode_chunk"),
                      (RowRangeChecksums, "final")]:
        def spy(self, *args, real=getattr(cls, name)):
            real(self, *args)
            decoded.set()

        monkeypatch.setattr(cls, name, spy)

    async def serve(request: web.Request) -> web.StreamResponse:
        path = root / request.match_info["path"]
        if not path.is_file():
            raise web.HTTPNotFound()
        body = path.read_bytes()
        if path.parts[-4:] != SHARD or "Range" in request.headers:
            return web.FileResponse(path)
        response = web.StreamResponse(headers={"Content-Length": str(len(body))})
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
        held["released_by_decode"] = await asyncio.to_thread(decoded.wait, 10)
        await response.write(body[len(body) // 2 :])
        await response.write_eof()
        return response

    with serving(serve) as url, RoutingReader(url) as reader:
        got = reader.get_numpy("roll-0", [r.request_id for r in records[:4]])
    assert held["released_by_decode"] is True
    for r in records[:4]:
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)


@pytest.mark.parametrize("layout", ["contiguous", "zstd", "gaps", "index-at-end", "no-shard-file"])
def test_request_crcs_are_computed_while_the_rows_arrive(tmp_path, make_record, node_root, layout, monkeypatch):
    """The client hashes the rows of each requested range as they land or decode: its CRCs equal
    a checksum of the finished rows in every layout, and the reader then skips its own pass."""
    from r3rdma.read import reader as reader_module
    from r3rdma.records import checksum

    root = tmp_path / "node"
    records = populate(root, make_record, level=3 if layout in ("zstd", "index-at-end") else 0)
    if layout == "gaps":
        spread_chunks_apart(root)
    elif layout == "index-at-end":
        rows = sum(r.num_rows for r in records[:4])
        rewrite_first_array(root, shards={"shape": (-(-rows // 16) * 16, 4, 3), "index_location": "end"},
                            compressors=zarr_codecs(3))
    elif layout == "no-shard-file":
        root.joinpath("roll-0", "b00000001", *SHARD).unlink()
    node = node_root(root)
    want = zarr.open_array(LocalStore(root), path="roll-0/b00000001", mode="r")[:]
    ranges = [(0, 17), (17, 43), (5, 6), (30, want.shape[0]), (9, 9)]
    client = NodeHttpClient(node.http_url, node.read_token)
    try:
        got = client.read_array("roll-0/b00000001", "test", ranges)
        with pytest.raises(CorruptDataError, match=f"has {want.shape[0]} rows; the index lists rows up to {want.shape[0] + 1}"):
            client.read_array("roll-0/b00000001", "test", [(0, want.shape[0] + 1)])
    finally:
        client.close()
    assert np.array_equal(got.array, want)
    assert got.crc32c == [checksum(want[lo:hi]) for lo, hi in ranges]
    if layout != "no-shard-file":
        hashed = []
        monkeypatch.setattr(reader_module, "checksum", lambda a: hashed.append(a) or checksum(a))
        assert_reads_back(node, records)
        assert hashed == []


@pytest.mark.parametrize("level", [0, 3])
def test_rows_that_differ_from_the_index_are_refused(tmp_path, make_record, node_root, level):
    """A batch array rewritten with one id changed is valid Zarr (every chunk CRC holds): only
    the index's per-request CRC, computed while the rows arrive, can tell."""
    root = tmp_path / "node"
    records = populate(root, make_record, level=level)
    data = zarr.open_array(LocalStore(root), path="roll-0/b00000001", mode="r")[:]
    data[20, 1, 2] ^= 1  # a row of r1 (rows 17..42)
    zarr.create_array(LocalStore(root / "roll-0"), name="b00000001", data=data, chunks=(16, 4, 3), fill_value=0,
                      overwrite=True, shards={"shape": (128, 4, 3), "index_location": "start"},
                      compressors=zarr_codecs(level))
    node = node_root(root)
    assert read_first_array(node) is not None  # our layout: read by the client, not zarr
    with RoutingReader(node.http_url, token=node.read_token) as reader:
        np.testing.assert_array_equal(reader.get_numpy("roll-0", ["r0"])["r0"], records[0].ids_TLK)
        with pytest.raises(CorruptDataError, match=r"request 'r1' .* rows 17\.\.42: crc32c"):
            reader.get_numpy("roll-0", [r.request_id for r in records[:4]])


# -- every remote read path says what went wrong ----------------------------------------------


class FaultyNode:
    """A store node's read service in a thread (aiohttp, 127.0.0.1, port 0) serving ``root``'s
    files, Range included, except the requests ``fault`` matches; it does ``action`` to those:
    answer an HTTP status, "hang" (answer nothing), "stall" (send half the body, then nothing),
    "drop" (send half the body, then close the connection). ``stop()`` takes it down."""

    def __init__(self, root: Path, fault, action) -> None:
        self.root, self.fault, self.action = root, fault, action
        self._release = threading.Event()  # lets hanging handlers end, so the server can stop
        self._stack = contextlib.ExitStack()
        self.url = self._stack.enter_context(serving(self._serve))

    def stop(self) -> None:
        self._release.set()
        self._stack.close()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        action = self.action if self.fault(request) else None
        if isinstance(action, int):
            return web.Response(status=action, text="injected failure\n")
        if action == "hang":
            await asyncio.to_thread(self._release.wait, 30)
            raise web.HTTPServiceUnavailable()
        path = self.root / request.match_info["path"]
        if not path.is_file():
            raise web.HTTPNotFound()
        if action is None:
            return web.FileResponse(path)
        body = path.read_bytes()
        headers = {}
        if "Range" in request.headers:
            start, stop, _ = request.http_range.indices(len(body))
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(body)}"
            body = body[start:stop]
        headers["Content-Length"] = str(len(body))
        response = web.StreamResponse(status=206 if "Content-Range" in headers else 200, headers=headers)
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
        if action == "stall":
            await asyncio.to_thread(self._release.wait, 30)
        request.transport.close()
        return response


def _is_shard(request: web.Request) -> bool:
    return request.match_info["path"].endswith("b00000001/c/0/0/0")


# Each remote read path: which request to fail, and the read that makes it. b00000001 holds
# r0..r3 (122 rows): all four are read whole by NodeHttpClient, r0 alone (17 rows) through
# zarr's fsspec store (ranged GETs); stored_bytes asks fsspec for file sizes (HEAD, then GET).
READ_PATHS = {
    "index": (lambda rq: rq.match_info["path"] == "roll-0/zarr.json", lambda reader: reader.info("roll-0")),
    "array-metadata": (lambda rq: rq.match_info["path"] == "roll-0/b00000001/zarr.json",
                       lambda reader: reader.get_numpy("roll-0", ["r0", "r1", "r2", "r3"])),
    "shard-whole": (_is_shard, lambda reader: reader.get_numpy("roll-0", ["r0", "r1", "r2", "r3"])),
    "metadata-fsspec": (lambda rq: rq.match_info["path"] == "roll-0/b00000001/zarr.json",
                        lambda reader: reader.get_numpy("roll-0", ["r0"])),
    "shard-fsspec": (_is_shard, lambda reader: reader.get_numpy("roll-0", ["r0"])),
    "stored-bytes": (_is_shard, lambda reader: reader.stored_bytes("roll-0")),
}

EXPECTED = {401: (AuthenticationError, "refused the token"), 403: (AuthenticationError, "refused the token"),
            500: (StoreError, "failed the read"), 503: (StoreError, "failed the read")}


@pytest.fixture(scope="module")
def served_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults") / "node"
    with LocalRoutingStore(root, zstd_level=0, chunk_rows=16) as store:  # as populate() lays it out
        store.commit([_record(f"r{i}", rows=17 + 9 * i) for i in range(4)])
        store.commit([_record(f"r{i}", rows=17 + 9 * i) for i in range(4, 6)])
    return root


def _record(request_id: str, *, rows: int):
    from r3rdma.records import RequestRecord

    rng = np.random.default_rng(sum(request_id.encode()))
    return RequestRecord("roll-0", request_id, rng.integers(0, 40, size=(rows, 4, 3)).astype(np.uint8), (0, 1, 2, 3), 40)


def faulty(root: Path, path: str, action) -> FaultyNode:
    return FaultyNode(root, READ_PATHS[path][0], action)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("status", sorted(EXPECTED))
@pytest.mark.parametrize("path", sorted(READ_PATHS))
def test_http_status_says_what_happened(served_root, path, status):
    """401/403: AuthenticationError; 5xx: StoreError (the node's own failure); each names the
    node and the status, on every read path."""
    node = faulty(served_root, path, status)
    try:
        with RoutingReader(node.url, token="t", timeout_s=10) as reader:
            cls, words = EXPECTED[status]
            with pytest.raises(cls, match=f"{words}.*HTTP {status}") as raised:
                READ_PATHS[path][1](reader)
    finally:
        node.stop()
    assert node.url in str(raised.value) and not isinstance(raised.value, CorruptDataError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", sorted(READ_PATHS))
def test_a_node_that_stops_answering_is_a_timeout(served_root, path):
    node = faulty(served_root, path, "hang")
    try:
        reader = RoutingReader(node.url, token="t", timeout_s=0.5)
        with reader, pytest.raises(R3TimeoutError, match="did not answer in time") as raised:
            READ_PATHS[path][1](reader)
    finally:
        node.stop()
    assert node.url in str(raised.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["index", "shard-whole", "shard-fsspec"])
@pytest.mark.parametrize("action", ["drop", "stall"])
def test_a_body_cut_short_is_retryable(served_root, path, action):
    """Half a body, then the connection closes (TransportError) or goes silent (R3TimeoutError):
    either is retryable, neither is "corrupt data"; the same read then succeeds."""
    node = faulty(served_root, path, action)
    try:
        with RoutingReader(node.url, token="t", timeout_s=0.5) as reader:
            with pytest.raises(TransportError if action == "drop" else R3TimeoutError) as raised:
                READ_PATHS[path][1](reader)
            node.action = None
            READ_PATHS[path][1](reader)
    finally:
        node.stop()
    assert node.url in str(raised.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["array-metadata", "shard-whole", "shard-fsspec", "stored-bytes"])
def test_a_node_gone_mid_read_is_a_transport_error(served_root, path):
    """The reader holds the rollout's index; then the node goes away: connections refused."""
    node = faulty(served_root, path, None)
    try:
        with RoutingReader(node.url, token="t", timeout_s=10) as reader:
            reader.info("roll-0")
            node.stop()
            with pytest.raises(TransportError) as raised:
                READ_PATHS[path][1](reader)
    finally:
        node.stop()  # again, if the read above failed first: stopping twice is harmless
    assert isinstance(raised.value, ConnectionError) and node.url in str(raised.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("read", ["shard-whole", "shard-fsspec"])
def test_a_flipped_byte_is_still_corrupt_data(served_root, tmp_path, read):
    """Bytes that arrived whole and fail their checksum: CorruptDataError, on both paths."""
    import shutil

    root = tmp_path / "node"
    shutil.copytree(served_root, root)
    meta = json.loads((root / "roll-0" / "b00000001" / "zarr.json").read_text())
    shard = root.joinpath("roll-0", "b00000001", *SHARD)
    blob = bytearray(shard.read_bytes())
    blob[shard_codec.ShardDecoder.of(meta).index_bytes + 5] ^= 0x01  # a byte of chunk 0 (r0's rows)
    shard.write_bytes(bytes(blob))
    node = faulty(root, read, None)
    try:
        reader = RoutingReader(node.url, token="t", timeout_s=10)
        with reader, pytest.raises(CorruptDataError, match="b00000001"):
            READ_PATHS[read][1](reader)
    finally:
        node.stop()
