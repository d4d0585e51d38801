"""Issue 7: retention. Delete a rollout on every node, delete by age, readers get a clear error."""

import json
import os
import socket
import time

import pytest
from aiohttp import web

from r3rdma import RoutingReader
from r3rdma.store.process import new_token, spawn_node
from r3rdma.testing.harness import make_record, token_leaks
from r3rdma.cli import main as cli_main
from r3rdma.errors import (
    AuthenticationError,
    CorruptDataError,
    InvalidIdError,
    R3TimeoutError,
    StoreError,
    TransportError,
    UnknownRolloutError,
)
from r3rdma.store.local_store import LocalRoutingStore
from r3rdma.store.retention import delete_older_than, delete_rollout
from r3rdma.write.push_client import StoreNodesClient
from r3rdma.transport import TransportLimits

from .store_nodes import serve_in_thread


def test_local_delete_older_than(tmp_path):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("old", "a"), make_record("new", "b")])
        past = time.time() - 3600
        os.utime(tmp_path / "old" / "zarr.json", (past, past))
        assert store.delete_older_than(600) == ["old"]
        assert sorted(store.rollouts()) == ["new"]
        with pytest.raises(UnknownRolloutError):
            store.delete_rollout("old")
        store.commit([make_record("old", "a2")])  # the id can be used again
    with RoutingReader(str(tmp_path)) as reader:
        assert reader.info("old").request_ids == ("a2",)


@pytest.fixture
def two_nodes(tmp_path):
    token = new_token()
    nodes = [spawn_node(tmp_path / f"n{i}", token) for i in range(2)]
    yield nodes
    for n in nodes:
        n.kill()


def test_delete_rollout_on_every_node_and_by_age(two_nodes, tmp_path):
    a, b = two_nodes
    recs = [make_record(ro, f"q{i}") for ro in ("r1", "r2", "keep") for i in range(12)]
    with StoreNodesClient([a.push_url, b.push_url], secret=a.token, limits=TransportLimits(timeout_s=5)) as client:
        client.commit(recs)
    urls = [a.http_url, b.http_url]
    reader = RoutingReader(urls, token=a.read_token)
    assert len(reader.info("r1").request_ids) == 12
    # A trainer holding r1's index while it is deleted: a clear error, not "corrupt".
    reader.get_numpy("r1", ["q0"])

    with pytest.raises(AuthenticationError):
        delete_rollout(urls, "r1", token=new_token())
    # Neither the push secret nor a reader's token deletes: only the admin token.
    with pytest.raises(AuthenticationError, match="HTTP 401"):
        delete_rollout(urls, "r1", token=a.token)
    with pytest.raises(AuthenticationError, match="HTTP 403"):
        delete_rollout(urls, "r1", token=a.read_token)
    with pytest.raises(InvalidIdError):
        delete_rollout(urls, "..", token=a.admin_token)
    held = delete_rollout(urls, "r1", token=a.admin_token)
    assert held == {a.http_url: True, b.http_url: True}
    with pytest.raises(UnknownRolloutError):
        reader.get_numpy("r1", ["q1", "q2", "q3", "q4", "q5", "q6", "q7"])
    with pytest.raises(UnknownRolloutError):
        RoutingReader(urls, token=a.read_token).info("r1")
    with pytest.raises(UnknownRolloutError, match="not found on any"):
        delete_rollout(urls, "r1", token=a.admin_token)
    reader.close()

    # By age: nothing is a day old; everything is older than 0 s except what is written after.
    assert delete_older_than(urls, 86400, token=a.admin_token) == {a.http_url: [], b.http_url: []}
    out = delete_older_than(urls, 0, token=a.admin_token)
    assert sorted(set(sum(out.values(), []))) == ["keep", "r2"]
    for n in two_nodes:
        assert sorted(p.name for p in n.root.iterdir()) == [".r3rdma.lock", "zarr.json"]
    # The nodes keep ingesting afterwards.
    with StoreNodesClient([a.push_url, b.push_url], secret=a.token, limits=TransportLimits(timeout_s=5)) as client:
        client.commit([make_record("r1", "again")])
    assert RoutingReader(urls, token=a.read_token).info("r1").request_ids == ("again",)


def test_delete_needs_the_token_even_with_public_read(tmp_path, capsys):
    node = spawn_node(tmp_path / "pub", new_token(), "--public-read")
    try:
        with StoreNodesClient([node.push_url], secret=node.token, limits=TransportLimits(timeout_s=5)) as client:
            client.commit([make_record("p", "x")])
        with pytest.raises(AuthenticationError):
            delete_rollout([node.http_url], "p", token="wrong" * 8)
        with pytest.raises(AuthenticationError, match="HTTP 403"):  # public reads, but not deletes
            delete_rollout([node.http_url], "p", token=node.read_token)
        # The command is given the push secret file and sends the admin token derived from it.
        token_file = tmp_path / "tok"
        token_file.write_text(node.token)
        assert cli_main(["delete", "--nodes", node.http_url, "--rollout", "p", "--token-file", str(token_file)]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"deleted": {"p": {node.http_url: True}}}
        assert cli_main(["delete", "--nodes", node.http_url, "--rollout", "p", "--token-file", str(token_file)]) == 2
        assert cli_main(["delete", "--nodes", node.http_url, "--older-than-s", "0", "--token-file", str(token_file)]) == 0
    finally:
        node.kill()
    assert token_leaks(node) == []


# -- a node that fails the delete: each failure says what it was ------------------------------


def answering(status: int, text: str):
    """An HTTP server on 127.0.0.1 (aiohttp, in a thread) that answers every request with
    ``status`` and ``text``; yields its base URL."""

    async def handler(_request: web.Request) -> web.Response:
        return web.Response(status=status, text=text)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return serve_in_thread(app)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "status, text, expected",
    [
        (500, "StoreError: disk on fire", StoreError),
        (503, "", StoreError),
        (401, "missing or wrong bearer token", AuthenticationError),
        (403, "forbidden", AuthenticationError),
        (200, "<html>not json</html>", CorruptDataError),
    ],
)
def test_delete_errors_name_the_node_and_status(status, text, expected):
    with answering(status, text) as url, pytest.raises(expected) as raised:
        delete_rollout([url], "r1", token="t" * 32)
    assert url in str(raised.value) and "t" * 32 not in str(raised.value)
    if status != 200:
        assert f"HTTP {status}" in str(raised.value)


@pytest.mark.timeout(60)
def test_delete_older_than_refuses_an_answer_without_the_deleted_list():
    with answering(200, '{"removed": []}') as url, pytest.raises(CorruptDataError, match="not {'deleted'"):
        delete_older_than([url], 0, token="t" * 32)


@pytest.mark.timeout(60)
def test_unreachable_and_silent_nodes_are_retryable(tmp_path, capsys):
    """A refused connection is TransportError, a node that never answers R3TimeoutError (both
    retryable: deletes are idempotent); the command prints one line and exits 2."""
    with socket.socket() as bound, socket.socket() as silent:
        bound.bind(("127.0.0.1", 0))  # bound, not listening: refused
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # listening, never accepting: connects, no answer
        refused = f"http://127.0.0.1:{bound.getsockname()[1]}"
        quiet = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(TransportError, match=f"{refused}.*retryable") as raised:
            delete_rollout([refused], "r1", token="t" * 32)
        assert isinstance(raised.value, ConnectionError)
        with pytest.raises(R3TimeoutError, match=f"{quiet} did not answer DELETE /v1/rollouts within 0.3 s"):
            delete_older_than([quiet], 0, token="t" * 32, timeout_s=0.3)
        token_file = tmp_path / "tok"
        token_file.write_text("t" * 32)
        assert cli_main(["delete", "--nodes", refused, "--rollout", "r1", "--token-file", str(token_file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("r3rdma delete: TransportError: ") and len(err.strip().splitlines()) == 1


@pytest.mark.timeout(60)
def test_one_node_down_leaves_the_run_incomplete_and_says_which():
    with answering(200, '{"deleted": ["r1"]}') as good, socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{bound.getsockname()[1]}"
        with pytest.raises(TransportError, match=f"retention incomplete on 1 of 2 nodes \\(done on \\['{good}'\\]\\): {down}"):
            delete_rollout([good, down], "r1", token="t" * 32)


def test_local_delete_older_than_refuses_a_bad_age(tmp_path):
    from r3rdma.errors import ConfigError

    with LocalRoutingStore(tmp_path) as store, pytest.raises(ConfigError, match="age_s"):
        store.delete_older_than(-1)
