"""Issue 31, item 11: a client that stays connected and idle costs a store node no CPU.

The node kept 61-74% of a core busy while an idle client stayed connected (a whole core over 10 s
after one small push), 0% once it left: ucxx awaits a request by yielding to the event loop in a
loop, and the node always had a receive posted per connection. Real store nodes in subprocesses,
UCX over TCP loopback; the node's CPU time is read from /proc via psutil.
"""

import time

import numpy as np
import psutil
import pytest

from r3rdma.records import RequestRecord
from r3rdma.transport import TransportLimits, configure_ucx_env
from r3rdma.write.push_client import StoreNodesClient

from .store_nodes import new_token, start_node

IDLE_S = 3.0  # the interval measured
BOUND_CPU_S = 0.2  # generous: measured ~0.0 after the fix, ~2 before (61-100% of a core)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process and its children (read workers) so far."""
    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            times = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def idle_cpu(pid: int, seconds: float = IDLE_S) -> float:
    """CPU seconds ``pid`` used over ``seconds`` of wall time in which nothing is asked of it.
    (Sleeping here is the measurement window, not a wait for an event.)"""
    before = cpu_seconds(pid)
    time.sleep(seconds)
    return cpu_seconds(pid) - before


def record(request_id: str) -> RequestRecord:
    rng = np.random.default_rng(0)
    return RequestRecord("idle", request_id, rng.integers(0, 64, (256, 8, 4), dtype=np.uint8), tuple(range(8)), 64)


@pytest.mark.timeout(120)
def test_an_idle_connected_client_costs_the_node_no_cpu(tmp_path):
    configure_ucx_env()
    node = start_node(tmp_path / "root", new_token())
    try:
        pid = node.proc.pid
        with StoreNodesClient([node.push_url], secret=node.token, limits=TransportLimits(timeout_s=10)) as client:
            client.commit([record("first")])  # connected, one small push, then idle
            used = idle_cpu(pid)
            assert used < BOUND_CPU_S, f"the node used {used:.2f} CPU-s in {IDLE_S} s with an idle client connected"
            # Still serving: the next push is acknowledged on the same connection.
            client.commit([record("second")])
            used = idle_cpu(pid)
            assert used < BOUND_CPU_S, f"the node used {used:.2f} CPU-s in {IDLE_S} s after a second push"
        used = idle_cpu(pid)  # the client left
        assert used < BOUND_CPU_S, f"the node used {used:.2f} CPU-s in {IDLE_S} s after the client left"
        assert node.alive
    finally:
        node.kill()


@pytest.mark.timeout(120)
def test_a_connected_client_that_never_pushed_costs_no_cpu_and_is_still_served(tmp_path):
    """Connected (hello done), no batch yet: the node waits for its first message without a
    receive spinning, then receives it normally."""
    import asyncio

    from r3rdma.transport import UcxxClient

    configure_ucx_env()
    node = start_node(tmp_path / "root", new_token())
    try:
        async def run():
            client = UcxxClient(node.host, node.ucx_port, secret=node.token, limits=TransportLimits(timeout_s=10))
            try:
                await client.connect()
                used = await asyncio.to_thread(idle_cpu, node.proc.pid)
                ack = await client.push([record("late")])
            finally:
                await client.close()
            return used, ack

        used, ack = asyncio.run(asyncio.wait_for(run(), 60))
        assert used < BOUND_CPU_S, f"the node used {used:.2f} CPU-s in {IDLE_S} s with a client connected"
        assert ack.requests == 1
    finally:
        node.kill()


@pytest.mark.timeout(60)
def test_nodes_started_here_make_their_own_ucx_choices(tmp_path, monkeypatch):
    """The tests' (and benches') nodes inherited UCXPY_PROGRESS_MODE=thread that
    configure_ucx_env() had set for this process's clients, so they ran in thread mode, not
    the blocking mode of a node started from a shell (STORE_NODE_UCX_ENV). A value the user
    set still wins."""
    import os

    from r3rdma.transport.ucx_env import without_our_choices

    configure_ucx_env()
    assert os.environ["UCXPY_PROGRESS_MODE"]  # set here, for this process's clients
    if "UCXPY_PROGRESS_MODE" in without_our_choices(os.environ):
        pytest.skip("UCXPY_PROGRESS_MODE was set by the user: nodes inherit it")
    node = start_node(tmp_path / "root", new_token())
    try:
        raw = open(f"/proc/{node.proc.pid}/environ", "rb").read().split(b"\0")
        environ = dict(e.split(b"=", 1) for e in raw if b"=" in e)
        assert b"UCXPY_PROGRESS_MODE" not in environ, environ.get(b"UCXPY_PROGRESS_MODE")
    finally:
        node.kill()
    monkeypatch.setenv("UCXPY_PROGRESS_MODE", "polling")  # a value other than ours: the user's, passed on
    assert without_our_choices(os.environ)["UCXPY_PROGRESS_MODE"] == "polling"
