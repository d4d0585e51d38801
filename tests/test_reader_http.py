"""Remote reads through RoutingReader over HTTP: bit-exact, damage refused, and failures that
say what happened on every read path (a refused token, a node-side failure, a refused or
dropped connection, a timeout, damaged bytes): the index entry point, an index part, array
metadata, a partial shard read, a whole shard, file sizes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import zarr
from aiohttp import web
from zarr.storage import LocalStore

from r3rdma.errors import (
    AuthenticationError,
    CorruptDataError,
    R3TimeoutError,
    StoreError,
    TransportError,
)
from r3rdma.store.local_store import LocalRoutingStore
from r3rdma.read.reader import RoutingReader

from .store_nodes import new_token, serve_in_thread, start_node

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


def assert_reads_back(node, records) -> None:
    with RoutingReader(node.http_url, token=node.read_token) as reader:
        got = reader.get_numpy("roll-0", [r.request_id for r in records])
    for r in records:
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)


@pytest.mark.parametrize("level", [0, 3])
def test_arrays_read_back_bit_exact(tmp_path, make_record, node_root, level):
    root = tmp_path / "node"
    records = populate(root, make_record, level=level)
    node = node_root(root)
    assert_reads_back(node, records)
    with RoutingReader(node.http_url, token=node.read_token) as reader:  # whole arrays and single requests
        array = zarr.open_array(LocalStore(root), path="roll-0/b00000001", mode="r")[:]
        whole = reader.get_packed("roll-0", ["r0", "r1", "r2", "r3"]).ids_TLK.numpy()
        assert np.array_equal(whole, np.concatenate([r.ids_TLK for r in records[:4]]))
        # Each request starts on a chunk boundary (it would straddle one otherwise): the rows
        # between them hold the fill value.
        offsets = [0, 32, 64, 112]
        for r, at in zip(records[:4], offsets):
            assert np.array_equal(array[at : at + r.num_rows], r.ids_TLK)
        assert array.shape[0] == offsets[-1] + records[3].num_rows and not array[17:32].any()
        np.testing.assert_array_equal(reader.get_numpy("roll-0", ["r2"])["r2"], records[2].ids_TLK)


@pytest.mark.parametrize("level", [0, 3])  # 0: chunks are checked and copied in runs
@pytest.mark.parametrize("damage", ["last-chunk", "middle-chunk", "truncated"])
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


@pytest.mark.parametrize("damage", ["index", "metadata"])
def test_rows_read_without_the_shard_index_or_metadata(tmp_path, make_record, node_root, damage):
    """The index part carries each array's chunk places: r3rdma reads rows with one ranged GET
    and checks each chunk's CRC-32C, so a damaged shard index or a lost zarr.json (which a
    plain Zarr reader needs) does not stop it."""
    root = tmp_path / "node"
    records = populate(root, make_record, level=3)
    if damage == "index":
        shard = root.joinpath("roll-0", "b00000001", *SHARD)
        blob = bytearray(shard.read_bytes())
        blob[10] ^= 0xFF
        shard.write_bytes(bytes(blob))
    else:
        (root / "roll-0" / "b00000001" / "zarr.json").unlink()
    assert_reads_back(node_root(root), records)


def written_by_another_writer(root: Path) -> None:
    """Drop the chunk places r3rdma's writer copies into index part 1: a rollout whose arrays
    another writer made, whose layout only their zarr.json says."""
    path = root / "roll-0" / "i00000001" / "zarr.json"
    doc = json.loads(path.read_text())
    del doc["attributes"]["r3rdma"]["shards"]
    path.write_text(json.dumps(doc))


def test_other_layouts_read_back(tmp_path, make_record, node_root):
    """Any valid Zarr layout of a batch array reads (the reader goes through zarr): blosc, no
    shards, the shard index at the end (r3rdma wrote it there before 2026-11-21)."""
    root = tmp_path / "node"
    records = populate(root, make_record, level=3)
    data = zarr.open_array(LocalStore(root), path="roll-0/b00000001", mode="r")[:]
    written_by_another_writer(root)
    node = node_root(root)
    for layout in ({"compressors": [zarr.codecs.BloscCodec()]}, {"shards": None},
                   {"shards": {"shape": (128, 4, 3), "index_location": "end"}}):
        zarr.create_array(LocalStore(root / "roll-0"), name="b00000001", data=data, chunks=(16, 4, 3),
                          fill_value=0, overwrite=True, **layout)
        assert_reads_back(node, records)


@pytest.mark.parametrize("level", [0, 3])
def test_rows_that_differ_from_the_index_are_refused(tmp_path, make_record, node_root, level):
    """A batch array rewritten with one id changed is valid Zarr (every chunk CRC holds): only
    the index's request CRC-32C catches it."""
    root = tmp_path / "node"
    records = populate(root, make_record, level=level)
    data = zarr.open_array(LocalStore(root), path="roll-0/b00000001", mode="r")[:]
    data[40, 1, 1] ^= 1  # a row of r1 (rows 32-57)
    zarr.create_array(LocalStore(root / "roll-0"), name="b00000001", data=data, chunks=(16, 4, 3),
                      shards=(160, 4, 3), fill_value=0, overwrite=True)
    written_by_another_writer(root)
    node = node_root(root)
    with RoutingReader(node.http_url, token=node.read_token) as reader:
        with pytest.raises(CorruptDataError, match="'r1'.*index says"):
            reader.get_numpy("roll-0", ["r0", "r1", "r2", "r3"])
        np.testing.assert_array_equal(reader.get_numpy("roll-0", ["r0"])["r0"], records[0].ids_TLK)


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
    assert node.http_url in str(raised.value) and "rollout 'roll-0'" in str(raised.value)
    assert wrong not in str(raised.value) and node.token not in str(raised.value)


@pytest.mark.timeout(60)
def test_a_refused_connection_is_a_transport_error(tmp_path):
    """Nothing listens on the port: TransportError (a ConnectionError, retryable)."""
    with socket.socket() as bound:  # bound, not listening: the kernel refuses connections
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        reader = RoutingReader(url, token="t")
        with reader, pytest.raises(TransportError, match="ConnectionRefused") as raised:
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


def serving(handler):
    """An aiohttp server on 127.0.0.1 that answers ``GET /zarr/{path}`` with ``handler``, in a
    thread; yields its base URL."""
    app = web.Application()
    app.router.add_get("/zarr/{path:.*}", handler)
    return serve_in_thread(app)


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
# r0..r3 (122 rows): all four are read as the whole array (one ranged GET), r0 alone (17 rows)
# as a ranged GET of its chunks (their places come from the index part: no metadata or shard
# index GET); stored_bytes asks for file sizes, metadata included.
READ_PATHS = {
    "index": (lambda rq: rq.match_info["path"] == "roll-0/zarr.json", lambda reader: reader.info("roll-0")),
    "index-part": (lambda rq: rq.match_info["path"] == "roll-0/i00000002/zarr.json", lambda reader: reader.info("roll-0")),
    "shard-whole": (_is_shard, lambda reader: reader.get_numpy("roll-0", ["r0", "r1", "r2", "r3"])),
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
@pytest.mark.parametrize("path", ["index", "index-part", "shard-whole", "shard-fsspec"])
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
@pytest.mark.parametrize("path", ["shard-whole", "shard-fsspec", "stored-bytes"])
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
    sharding = meta["codecs"][0]["configuration"]
    chunks = -(-meta["shape"][0] // sharding["chunk_shape"][0])
    blob[16 * chunks + 4 + 5] ^= 0x01  # past the shard index (16 B per chunk + CRC): chunk 0, r0's rows
    shard.write_bytes(bytes(blob))
    node = faulty(root, read, None)
    try:
        reader = RoutingReader(node.url, token="t", timeout_s=10)
        with reader, pytest.raises(CorruptDataError, match="b00000001"):
            READ_PATHS[read][1](reader)
    finally:
        node.stop()
