"""The node's Zarr file service (GET|HEAD /zarr/{path}): whole files and byte ranges of large
files (sent with sendfile, store/http_app.py ``_send_file``) and small ones (from memory), the
headers zarr's HTTP stores rely on, conditional requests (FileResponse), and paths that must
not be served. Every answer is checked against the file's own bytes."""

import asyncio
import os

import pytest
from aiohttp import ClientSession, web

from r3rdma.store.http_app import make_http_app
from r3rdma.store.metrics import NodeMetrics

TOKEN = "read-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BIG = 3 * (1 << 20) + 12345  # past the small-file size: sendfile
SMALL = 4097


@pytest.fixture
def root(tmp_path):
    files = tmp_path / "root" / "roll-0" / "b00000001" / "c" / "0" / "0"
    files.mkdir(parents=True)
    (files / "0").write_bytes(os.urandom(BIG))
    (files / "1").write_bytes(os.urandom(SMALL))
    (files / "2").write_bytes(b"")
    (tmp_path / "root" / "roll-0" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    (tmp_path / "secret").write_text("outside the root")
    (files / "escape").symlink_to(tmp_path / "secret")
    return tmp_path / "root"


async def _serve(root, checks):
    metrics = NodeMetrics()
    runner = web.AppRunner(make_http_app(root, read_token=TOKEN, admin_token=None, public_read=False, metrics=metrics))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with ClientSession() as session:
            await checks(session, url)
    finally:
        await runner.cleanup()
    return metrics


async def _get(session, url, headers=None, method="GET"):
    async with session.request(method, url, headers={**AUTH, **(headers or {})}) as r:
        return r.status, await r.read(), r.headers


@pytest.mark.parametrize("name,size", [("0", BIG), ("1", SMALL)])
def test_whole_files_and_every_range_form(root, name, size):
    data = (root / "roll-0" / "b00000001" / "c" / "0" / "0" / name).read_bytes()
    assert len(data) == size

    sent = []  # bytes the node should count as sent

    async def checks(session, url):
        f = f"{url}/zarr/roll-0/b00000001/c/0/0/{name}"
        status, body, h = await _get(session, f)
        assert status == 200 and body == data and h["Content-Length"] == str(size) and h["Accept-Ranges"] == "bytes"
        sent.append(size)
        assert h["Content-Type"] == "application/octet-stream"
        for spec, lo, hi in [
            ("0-0", 0, 1), ("5-9", 5, 10), (f"100-{size - 1}", 100, size), (f"7-{size + 500}", 7, size),
            ("7-", 7, size), ("-20", size - 20, size), (f"-{size + 9}", 0, size), (f"{size - 1}-", size - 1, size),
        ]:
            status, body, h = await _get(session, f, {"Range": f"bytes={spec}"})
            assert status == 206 and body == data[lo:hi], spec
            sent.append(hi - lo)
            assert h["Content-Range"] == f"bytes {lo}-{hi - 1}/{size}" and h["Content-Length"] == str(hi - lo), spec
        for bad in [f"bytes={size}-", f"bytes={size + 10}-{size + 20}", "bytes=9-5", "bytes=abc", "bytes=0-1,4-5", "items=0-1"]:
            status, _, h = await _get(session, f, {"Range": bad})
            assert status == 416 and h["Content-Range"] == f"bytes */{size}", bad
        status, body, h = await _get(session, f, method="HEAD")
        assert status == 200 and body == b"" and h["Content-Length"] == str(size)
        status, body, h = await _get(session, f, {"Range": "bytes=10-19"}, method="HEAD")
        assert status == 206 and body == b"" and h["Content-Length"] == "10"
        # Conditional requests go through FileResponse: same validators, their semantics.
        etag = h["ETag"]
        assert (await _get(session, f, {"If-None-Match": etag}))[0] == 304
        status, body, _ = await _get(session, f, {"If-Match": etag, "Range": "bytes=3-6"})
        assert status == 206 and body == data[3:7]
        sent.append(4)
        assert (await _get(session, f, {"If-Match": '"nope"'}))[0] == 412

    metrics = asyncio.run(_serve(root, checks))
    assert metrics.http_bytes._value.get() == sum(sent)  # what was sent: not 304/412/416s, not HEADs


def test_empty_file_metadata_and_what_is_never_served(root):
    async def checks(session, url):
        status, body, _ = await _get(session, f"{url}/zarr/roll-0/b00000001/c/0/0/2")
        assert status == 200 and body == b""
        assert (await _get(session, f"{url}/zarr/roll-0/b00000001/c/0/0/2", {"Range": "bytes=0-"}))[0] == 416
        status, body, h = await _get(session, f"{url}/zarr/roll-0/zarr.json")
        assert status == 200 and h["Content-Type"] == "application/json" and b'"group"' in body
        for path in ["roll-0/b00000001/c/0/0/escape", "roll-0/b00000001/c", "roll-0/b00000001/c/0/0/0/x",
                     "roll-0/nope", ".r3rdma.lock", "roll-0/..%2F..%2Fsecret"]:
            assert (await _get(session, f"{url}/zarr/{path}"))[0] in (400, 404), path
            assert (await _get(session, f"{url}/zarr/{path}", {"Range": "bytes=0-3"}))[0] in (400, 404), path
        assert (await _get(session, f"{url}/zarr/roll-0/b00000001/c/0/0/0", {"Authorization": "Bearer no"}))[0] == 401

    asyncio.run(_serve(root, checks))


def test_obstore_and_zarr_http_stores_read_ranges_through_it(root):
    """The clients r3rdma's reader uses (obstore's HTTPStore, through zarr's ObjectStore) and
    zarr's FsspecStore get the same bytes as the file holds."""
    from obstore.store import HTTPStore
    from zarr.abc.store import RangeByteRequest, SuffixByteRequest
    from zarr.core.buffer import default_buffer_prototype
    from zarr.storage import FsspecStore, ObjectStore

    data = (root / "roll-0" / "b00000001" / "c" / "0" / "0" / "0").read_bytes()

    async def checks(_session, url):
        stores = [
            ObjectStore(HTTPStore.from_url(f"{url}/zarr", client_options={"allow_http": True, "default_headers": AUTH}),
                        read_only=True),
            FsspecStore.from_url(f"{url}/zarr", storage_options={"headers": AUTH}, read_only=True),
        ]
        for store in stores:
            key = "roll-0/b00000001/c/0/0/0"
            got = await store.get(key, prototype=default_buffer_prototype(), byte_range=RangeByteRequest(1000, 700000))
            assert got.to_bytes() == data[1000:700000], store
            got = await store.get(key, prototype=default_buffer_prototype(), byte_range=SuffixByteRequest(100))
            assert got.to_bytes() == data[-100:], store
            assert (await store.get(key, prototype=default_buffer_prototype())).to_bytes() == data
            assert await store.getsize(key) == len(data)

    asyncio.run(_serve(root, checks))
