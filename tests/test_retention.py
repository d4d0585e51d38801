"""Issue 7: retention. Delete a rollout on every node, delete by age, readers get a clear error."""

import json
import os
import time

import pytest

from r3rdma import RoutingReader
from r3rdma.bench import reliability_bench as rb
from r3rdma.cli import main as cli_main
from r3rdma.errors import AuthenticationError, InvalidIdError, UnknownRolloutError
from r3rdma.store.local_store import LocalRoutingStore
from r3rdma.store.retention import delete_older_than, delete_rollout
from r3rdma.write.push_client import StoreNodesClient
from r3rdma.transport import TransportLimits


def test_local_delete_older_than(tmp_path):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([rb.make_record("old", "a"), rb.make_record("new", "b")])
        past = time.time() - 3600
        os.utime(tmp_path / "old" / "zarr.json", (past, past))
        assert store.delete_older_than(600) == ["old"]
        assert sorted(store.rollouts()) == ["new"]
        with pytest.raises(UnknownRolloutError):
            store.delete_rollout("old")
        store.commit([rb.make_record("old", "a2")])  # the id can be used again
    with RoutingReader(str(tmp_path)) as reader:
        assert reader.info("old").request_ids == ("a2",)


@pytest.fixture
def two_nodes(tmp_path):
    token = rb.new_token()
    nodes = [rb.spawn_node(tmp_path / f"n{i}", token) for i in range(2)]
    yield nodes
    for n in nodes:
        n.kill()


def test_delete_rollout_on_every_node_and_by_age(two_nodes, tmp_path):
    a, b = two_nodes
    recs = [rb.make_record(ro, f"q{i}") for ro in ("r1", "r2", "keep") for i in range(12)]
    with StoreNodesClient([a.push_url, b.push_url], secret=a.token, limits=TransportLimits(timeout_s=5)) as client:
        client.commit(recs)
    urls = [a.http_url, b.http_url]
    reader = RoutingReader(urls, token=a.token)
    assert len(reader.info("r1").request_ids) == 12
    # A trainer holding r1's index while it is deleted: a clear error, not "corrupt".
    reader.get_numpy("r1", ["q0"])

    with pytest.raises(AuthenticationError):
        delete_rollout(urls, "r1", token=rb.new_token())
    with pytest.raises(InvalidIdError):
        delete_rollout(urls, "..", token=a.token)
    held = delete_rollout(urls, "r1", token=a.token)
    assert held == {a.http_url: True, b.http_url: True}
    with pytest.raises(UnknownRolloutError):
        reader.get_numpy("r1", ["q1", "q2", "q3", "q4", "q5", "q6", "q7"])
    with pytest.raises(UnknownRolloutError):
        RoutingReader(urls, token=a.token).info("r1")
    with pytest.raises(UnknownRolloutError, match="not found on any"):
        delete_rollout(urls, "r1", token=a.token)
    reader.close()

    # By age: nothing is a day old; everything is older than 0 s except what is written after.
    assert delete_older_than(urls, 86400, token=a.token) == {a.http_url: [], b.http_url: []}
    out = delete_older_than(urls, 0, token=a.token)
    assert sorted(set(sum(out.values(), []))) == ["keep", "r2"]
    for n in two_nodes:
        assert sorted(p.name for p in n.root.iterdir()) == [".r3rdma.lock", "zarr.json"]
    # The nodes keep ingesting afterwards.
    with StoreNodesClient([a.push_url, b.push_url], secret=a.token, limits=TransportLimits(timeout_s=5)) as client:
        client.commit([rb.make_record("r1", "again")])
    assert RoutingReader(urls, token=a.token).info("r1").request_ids == ("again",)


def test_delete_needs_the_token_even_with_public_read(tmp_path, capsys):
    node = rb.spawn_node(tmp_path / "pub", rb.new_token(), "--public-read")
    try:
        with StoreNodesClient([node.push_url], secret=node.token, limits=TransportLimits(timeout_s=5)) as client:
            client.commit([rb.make_record("p", "x")])
        with pytest.raises(AuthenticationError):
            delete_rollout([node.http_url], "p", token="wrong" * 8)
        token_file = tmp_path / "tok"
        token_file.write_text(node.token)
        assert cli_main(["delete", "--nodes", node.http_url, "--rollout", "p", "--token-file", str(token_file)]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"deleted": {"p": {node.http_url: True}}}
        assert cli_main(["delete", "--nodes", node.http_url, "--rollout", "p", "--token-file", str(token_file)]) == 2
        assert cli_main(["delete", "--nodes", node.http_url, "--older-than-s", "0", "--token-file", str(token_file)]) == 0
    finally:
        node.kill()
    assert rb.token_leaks(node) == []
