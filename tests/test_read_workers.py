"""A store node whose HTTP port is served by read-worker processes (--http-workers N)."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import numpy as np
import pytest

from r3rdma import RoutingReader
from r3rdma.write.push_client import StoreNodesClient

from .store_nodes import new_token, start_node
from .test_store_node import _http_checks


def _workers(node) -> list[int]:
    """Pids of the node's read workers (its children running r3rdma.store.read_workers)."""
    pids = []
    for task in os.listdir(f"/proc/{node.proc.pid}/task"):
        with open(f"/proc/{node.proc.pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"r3rdma.store.read_workers" in f.read():
                    out.append(pid)
        except FileNotFoundError:
            pass
    return sorted(out)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


@pytest.fixture
def node(tmp_path):
    running = start_node(tmp_path / "node", new_token(), "--http-workers", "2")
    yield running
    if running.alive:
        running.stop(signal.SIGKILL)


@pytest.mark.timeout(180)
def test_workers_serve_reads_auth_ranges_and_pass_on_metrics(node, make_record):
    assert node.http_workers == 2
    _wait(lambda: len(_workers(node)) == 2, 30, "two read workers running")
    rec = make_record("h0", rows=300)
    with StoreNodesClient([node.push_url], secret=node.token) as client:  # ingest still works
        client.commit([rec])
    # The same checks as a node serving HTTP itself: tokens, ranges, traversal, /metrics
    # (which a worker passes on to the node process: ingest counters live there).
    asyncio.run(asyncio.wait_for(_http_checks(node, rec), 60))


async def _request(method, url, token):
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, headers={"Authorization": f"Bearer {token}"}) as response:
            return response.status, await response.text()


@pytest.mark.timeout(180)
def test_reads_over_many_connections_are_counted_once_and_deletes_reach_the_writer(node, make_record):
    recs = [make_record(f"r{i}", rows=50 + 40 * i) for i in range(24)]
    with StoreNodesClient([node.push_url], secret=node.token) as client:
        client.commit(recs[:12])
        client.commit(recs[12:])
    _wait(lambda: len(_workers(node)) == 2, 30, "two read workers running")
    # Several readers, several connections each: both workers end up serving.
    readers = [RoutingReader([node.http_url], token=node.read_token) for _ in range(4)]
    for reader in readers:
        got = reader.get_numpy("roll-0", [r.request_id for r in recs])
        for r in recs:
            np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)
        reader.close()

    async def checks():
        status, text = await _request("GET", f"{node.http_url}/metrics", node.read_token)
        assert status == 200
        served = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                  if line.startswith("r3rdma_store_http_")}
        # One family each (the workers' counts added up, not one series per worker).
        assert sum(1 for line in text.splitlines() if line.startswith("# TYPE r3rdma_store_http_bytes")) == 1
        assert served["r3rdma_store_http_bytes_total"] > sum(r.nbytes for r in recs) * 0.05 * 4
        assert sum(v for k, v in served.items() if 'route="/zarr/{path}"' in k and 'status="2' in k) >= 4
        assert "r3rdma_store_requests_ingested_total 24.0" in text
        # DELETE reaches the node's writer through whichever worker took it; tokens still checked.
        assert (await _request("DELETE", f"{node.http_url}/v1/rollouts/roll-0", node.read_token))[0] == 403
        assert (await _request("DELETE", f"{node.http_url}/v1/rollouts/roll-0", "nope"))[0] == 401
        status, text = await _request("DELETE", f"{node.http_url}/v1/rollouts/roll-0", node.admin_token)
        assert status == 200 and "roll-0" in text
        assert (await _request("DELETE", f"{node.http_url}/v1/rollouts/roll-0", node.admin_token))[0] == 404
        assert (await _request("GET", f"{node.http_url}/v1/rollouts/roll-0", node.read_token))[0] == 404

    asyncio.run(asyncio.wait_for(checks(), 60))
    # The writer knows the rollout is gone: committing it again starts a new one.
    with StoreNodesClient([node.push_url], secret=node.token) as client:
        client.commit(recs[:1])
    assert RoutingReader([node.http_url], token=node.read_token).info("roll-0").request_ids == ("r0",)


@pytest.mark.timeout(180)
def test_a_worker_that_dies_is_started_again_and_reads_go_on(node, make_record):
    rec = make_record("k", rows=200)
    with StoreNodesClient([node.push_url], secret=node.token) as client:
        client.commit([rec])
    first = _wait(lambda: (w := _workers(node)) and len(w) == 2 and w, 30, "two read workers running")
    os.kill(first[0], signal.SIGKILL)
    for _ in range(20):  # the other worker keeps serving meanwhile
        reader = RoutingReader([node.http_url], token=node.read_token)
        np.testing.assert_array_equal(reader.get_numpy("roll-0", ["k"])["k"], rec.ids_TLK)
        reader.close()
    again = _wait(lambda: (w := _workers(node)) and len(w) == 2 and first[0] not in w and w, 30, "the worker restarted")
    assert first[1] in again
    assert "exited with -9; starting it again" in node.log.read_text()


@pytest.mark.timeout(120)
def test_workers_stop_with_the_node_and_free_the_port(tmp_path):
    for how in (signal.SIGTERM, signal.SIGKILL):
        node = start_node(tmp_path / f"n{how}", new_token(), "--http-workers", "2")
        workers = _wait(lambda: (w := _workers(node)) and len(w) == 2 and w, 30, "two read workers running")
        code = node.stop(how)
        assert code == (0 if how == signal.SIGTERM else -9)
        # Killed or drained, the node takes its workers along (they watch its pipe), and with
        # them the last holders of the listening socket.
        _wait(lambda: not any(_alive(p) for p in workers), 30, f"workers gone after {how!r}")
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", node.http_port))


def test_bad_worker_count_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "r3rdma.store.cli", "--root", str(tmp_path / "n"), "--http-workers", "-1"],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, R3_STORE_TOKEN=new_token()))
    assert out.returncode == 2 and "expected 'auto' or a number >= 0, got '-1'" in out.stderr
