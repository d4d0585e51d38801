"""Property: every request is stored as said, over random trees of requests on 1-3 store nodes.

Issue #50 ("Stored as said"). Hypothesis draws a run of an engine: prompts, samples that hit
another request's blocks (``attach_cached``: a sample of a prompt, a sample of a sample, a hit
on a conversation), GRPO groups decoded together and finished in any order, multi-turn
conversations stored under one id (each turn its own engine request, ``store_as``,
``start_row``), aborted requests, flushes, and in some runs a store node killed at any point.
The capturer is driven as an engine drives it (steps with KV slots, prefix hits, finishes) into
a :class:`RoutingWriter` over store nodes in this process (``tests/inproc_nodes.py``: the node's
ingest behind the loopback transport, the real client placing, replicating and failing over):
1 node (1 replica), 2 or 3 nodes (2 replicas). Then, read back with :class:`RoutingReader`:

- every copy on every node (a killed node's disk included) holds exactly the rows the engine
  computed for its positions (for a conversation: one of its turns, whole);
- a request not reported failed (``RoutingWriter.failures()``) reads back exact from the nodes
  merged, and is held whole by ``replicas`` nodes; a request reported failed is not, by live
  nodes (a node killed in the middle of a commit may have made it durable, unacked);
- without a kill nothing fails, each request is on exactly ``replicas`` nodes, and a request
  that shares rows with another is on the same nodes as it (its root source's replicas).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from r3rdma import RoutingCapturer, RoutingReader
from r3rdma.errors import R3Error
from r3rdma.write.writer import RoutingWriter
from tests.inproc_nodes import InProcessNodes

ROLLOUT = "prop"
LAYERS, K, E = (0, 2, 3), 2, 64


def _rows_of_slots(slots: np.ndarray) -> np.ndarray:
    """The routing the fake router computes for the token written to each slot ``[T, L, K]``
    (slots are never reused in a run, so a slot's row is one computation's)."""
    h = (slots.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    shifts = np.arange(len(LAYERS) * K, dtype=np.uint64).reshape(1, len(LAYERS), K) * np.uint64(6)
    return ((h.reshape(-1, 1, 1) >> (shifts + np.uint64(7))) % np.uint64(E)).astype(np.uint8)


class Engine:
    """An engine's bookkeeping: fresh KV slots per computed token, each stored id's positions."""

    def __init__(self, cap: RoutingCapturer) -> None:
        self.cap = cap
        self.next_slot = 0
        self.stored: dict[str, np.ndarray] = {}  # stored id -> slots of its rows (latest turn)
        self.turns: dict[str, list[int]] = {}  # stored id -> rows after each turn
        self.prompt_len: dict[str, int] = {}  # stored id -> prompt length of its latest turn
        self.order: list[str] = []  # stored ids, first finish first
        self.turn_count: dict[str, int] = {}
        self.names = 0

    def new_id(self, kind: str) -> str:
        self.names += 1
        return f"{kind}{self.names}"

    def slots(self, n: int) -> np.ndarray:
        out = np.arange(self.next_slot, self.next_slot + n, dtype=np.int64)
        self.next_slot += n
        return out

    def step(self, work: list[tuple[str, int, np.ndarray]]) -> None:
        """One forward: each ``(request, first position, slots)`` computes ``len(slots)`` tokens."""
        ids = [rid for rid, _, _ in work]
        starts = [start for _, start, _ in work]
        counts = [len(s) for _, _, s in work]
        slots = np.concatenate([s for _, _, s in work])
        rows = _rows_of_slots(slots)
        self.cap.begin_step(ids, starts, counts, slots)
        for li, layer in enumerate(LAYERS):
            self.cap.record(layer, torch.from_numpy(rows[:, li, :].astype(np.int64)))
        self.cap.end_step()

    def finish(self, rid: str, positions: np.ndarray, prompt_len: int, generated_len: int, *, store_as=None, start_row=0):
        sid = store_as or rid
        self.cap.finish_request(rid, prompt_len=prompt_len, generated_len=generated_len, store_as=store_as, start_row=start_row)
        self.stored[sid] = positions
        self.prompt_len[sid] = prompt_len
        self.turns.setdefault(sid, []).append(len(positions))
        if sid not in self.order:
            self.order.append(sid)

    # -- what an engine does ------------------------------------------------------------------

    def prompt(self, length: int, generated: int, chunks: int) -> None:
        rid = self.new_id("p")
        slots = self.slots(length + generated - 1)
        bounds = np.linspace(0, length, min(chunks, length) + 1).astype(int)
        for a, b in zip(bounds, bounds[1:]):
            self.step([(rid, int(a), slots[a:b])])
        for p in range(length, length + generated - 1):
            self.step([(rid, p, slots[p : p + 1])])
        self.finish(rid, slots, length, generated)

    def sample(self, pick: int, hit: int, own: int, generated: int) -> None:
        """A request whose prompt starts with positions of a stored request's sequence (a
        prefix-cache hit on its blocks), then ``own`` tokens of its own: ``hit`` -1 hits the
        source's whole prompt (what a sample of it shares), -2 its whole sequence, else
        ``1 + hit % rows`` positions."""
        if not self.order:
            return
        sid = self.order[-1 - pick % len(self.order)]  # 0: the newest stored request
        src = self.stored[sid]
        h = {-1: self.prompt_len[sid], -2: len(src)}.get(hit, 1 + hit % len(src))
        rid = self.new_id("s")
        self.cap.attach_cached(rid, np.arange(h), src[:h])
        mine = self.slots(own + generated - 1)
        self.step([(rid, h, mine[:own])])
        for j in range(generated - 1):
            self.step([(rid, h + own + j, mine[own + j : own + j + 1])])
        self.finish(rid, np.concatenate([src[:h], mine]), h + own, generated)

    def group(self, length: int, n: int, generated: int, order: list[int]) -> None:
        """GRPO: a prompt computed once, ``n`` samples that hit it, all decoded together, then
        finished in ``order`` (a sample finished before the prompt cannot point at it)."""
        rids = [self.new_id("g") for _ in range(n + 1)]
        prompt = self.slots(length)
        self.step([(rids[0], 0, prompt)])
        for rid in rids[1:]:
            self.cap.attach_cached(rid, np.arange(length), prompt)
        own = {rid: self.slots(generated - 1) for rid in rids}
        for j in range(generated - 1):
            self.step([(rid, length + j, own[rid][j : j + 1]) for rid in rids])
        for i in order:
            rid = rids[i % len(rids)]
            if rid in self.stored:
                continue
            self.finish(rid, np.concatenate([prompt, own[rid]]), length, generated)
        for rid in rids:
            if rid not in self.stored:
                self.finish(rid, np.concatenate([prompt, own[rid]]), length, generated)

    def turn(self, pick: int, user: int, generated: int) -> None:
        """The next turn of a stored request's conversation: its whole sequence (hit) plus its
        last sampled token and ``user`` new tokens, computed; stored under the conversation."""
        if not self.order:
            return
        sid = self.order[-1 - pick % len(self.order)]  # 0: the newest stored request
        prev = self.stored[sid]
        r = len(prev)
        self.turn_count[sid] = self.turn_count.get(sid, 1) + 1
        rid = f"{sid}.t{self.turn_count[sid]}"
        self.cap.attach_cached(rid, np.arange(r), prev)
        mine = self.slots(1 + user + generated - 1)
        self.step([(rid, r, mine[: 1 + user])])
        for j in range(generated - 1):
            p = r + 1 + user + j
            self.step([(rid, p, mine[1 + user + j : 2 + user + j])])
        self.finish(rid, np.concatenate([prev, mine]), r + 1 + user, generated, store_as=sid, start_row=r)

    def abort(self, length: int) -> None:
        rid = self.new_id("x")
        self.step([(rid, 0, self.slots(length))])
        self.cap.abort_request(rid)


_sample = st.tuples(
    st.just("sample"),
    st.integers(0, 3),  # which stored request, newest first
    st.one_of(st.just(-1), st.just(-2), st.integers(0, 200)),  # its whole prompt, whole sequence, or any prefix
    st.integers(1, 20),
    st.integers(1, 3),
)
# The engine's requests: a tree of prompts, samples hitting stored requests (often the newest,
# so samples of samples), GRPO groups and later turns; aborts, flushes and one kill besides.
op = st.one_of(
    st.tuples(st.just("prompt"), st.integers(1, 48), st.integers(1, 4), st.integers(1, 2)),
    _sample,
    _sample,
    _sample,
    st.tuples(st.just("group"), st.integers(2, 40), st.integers(1, 3), st.integers(1, 3), st.permutations(range(4))),
    st.tuples(st.just("turn"), st.integers(0, 3), st.integers(0, 5), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(1, 8)),
)
kill = st.one_of(st.none(), st.tuples(st.integers(0, 9), st.integers(0, 2), st.booleans()))  # (before op i, node, settled)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# The case: a sample of a sample of a prompt (s3 -> s2 -> p1) on 3 nodes, 2 replicas.
@example(
    num_nodes=3,
    ops=[("prompt", 32, 2, 1), ("sample", 0, -1, 16, 2), ("sample", 0, -1, 8, 2), ("turn", 0, 2, 2)],
    kill=None,
    flushes=set(),
    interval=0.0,
)
# A later turn after one of its two nodes died (p1 lies on nodes 2 and 1): only the nodes
# holding the earlier turn can take it, so it fails, said so; the prompt committed in the same
# batch is stored, and not reported failed.
@example(
    num_nodes=3,
    ops=[("prompt", 20, 3, 1), ("turn", 0, 2, 2), ("prompt", 10, 2, 1)],
    kill=(1, 1, True),
    flushes=set(),
    interval=0.02,
)
# A node of a GRPO group's replica set dies before the samples finish: they fail over, refused
# by reference where the prompt is not, stored inline; 2 nodes: nothing after the kill is stored.
@example(
    num_nodes=3,
    ops=[("group", 24, 3, 2, [0, 2, 1, 3]), ("sample", 1, -1, 4, 2), ("sample", 0, -1, 4, 2)],
    kill=(2, 0, False),
    flushes=set(),
    interval=0.02,
)
@example(
    num_nodes=2,
    ops=[("group", 24, 2, 2, [2, 0, 1, 3]), ("turn", 1, 1, 2), ("prompt", 5, 1, 2)],
    kill=(1, 1, False),
    flushes=set(),
    interval=0.0,
)
@example(
    num_nodes=1, ops=[("prompt", 17, 2, 2), ("sample", 0, -1, 3, 2), ("abort", 3)], kill=(2, 0, False), flushes={1}, interval=0.0
)
@given(
    num_nodes=st.sampled_from([1, 2, 3]),
    ops=st.lists(op, min_size=3, max_size=10),
    kill=kill,
    flushes=st.sets(st.integers(0, 9), max_size=3),
    interval=st.sampled_from([0.0, 0.02]),
)
def test_every_request_is_stored_as_said(tmp_path_factory, num_nodes, ops, kill, flushes, interval):
    replicas = 1 if num_nodes == 1 else 2
    root = tmp_path_factory.mktemp("nodes")
    sent: dict[str, list] = {}
    with InProcessNodes(root, num_nodes, replicas=replicas) as nodes:
        writer = RoutingWriter(nodes.client, flush_interval_s=interval)
        hand_over = writer.hand_over

        def spy(record):
            sent.setdefault(record.request_id, []).append(record)
            hand_over(record)

        writer.hand_over = spy
        cap = RoutingCapturer(layer_map=LAYERS, top_k=K, num_experts=E, num_slots=1 << 14, sink=writer, rollout_id=ROLLOUT)
        engine = Engine(cap)
        for i, (kind, *args) in enumerate(ops):
            if i in flushes:
                _flush(writer)
            if kill is not None and kill[0] == i:
                if kill[2]:
                    _flush(writer)  # the node dies between commits
                nodes.kill(kill[1] % num_nodes)  # else maybe during one
            getattr(engine, kind)(*args)
        cap.close()
        _flush(writer)
        writer.close(timeout=60)
        failed = {f.request_id for f in writer.failures()}
        assert None not in failed
        assert cap.active_requests == 0
    killed = bool(nodes.dead)
    refs = {rid: r.shared_prefix.request_id for rid, rs in sent.items() for r in rs if r.shared_prefix is not None}
    event(f"{num_nodes} nodes" + (", a node killed" if killed else ""))
    event(
        "a sample of a sample" if any(src in refs for src in refs.values()) else "shared prefixes" if refs else "no shared prefix"
    )
    event("a later turn" if any(len(t) > 1 for t in engine.turns.values()) else "single turns")
    event("failures reported" if failed else "no failure")
    _check(engine, nodes, failed, replicas, killed, sent)


def _flush(writer: RoutingWriter) -> None:
    try:
        writer.flush(timeout=60)
    except R3Error as e:  # failures are checked against what was stored at the end
        assert getattr(e, "failed_request_ids", None) is not None, e


def _check(engine: Engine, nodes: InProcessNodes, failed: set[str], replicas: int, killed: bool, sent: dict) -> None:
    want = {sid: _rows_of_slots(slots) for sid, slots in engine.stored.items()}
    assert failed <= set(want)
    whole: dict[str, list[int]] = {sid: [] for sid in want}  # nodes holding each request whole
    for i, node_root in enumerate(nodes.roots):
        if not (node_root / ROLLOUT).exists():
            continue
        with RoutingReader(str(node_root)) as reader:
            listed = set(reader.info(ROLLOUT).request_ids)
            assert listed <= set(want), f"node {i} lists requests never finished: {listed - set(want)}"
            got = reader.get_numpy(ROLLOUT, sorted(listed))
        for sid in listed:
            rows = got[sid]
            # One of the request's turns, whole, and the rows computed for its positions.
            assert rows.shape[0] in engine.turns[sid], (sid, i, rows.shape[0], engine.turns[sid])
            np.testing.assert_array_equal(rows, want[sid][: rows.shape[0]], err_msg=f"{sid} on node {i}")
            if rows.shape[0] == want[sid].shape[0]:
                whole[sid].append(i)
    # Stored as said: a request not reported failed is held whole by `replicas` nodes (a node
    # killed after it acked counts: its disk holds it); one reported failed is not, by live nodes
    # (a node killed after a commit made the request durable on its disk, before it acked, may
    # hold it: nobody heard of it).
    stored = {sid for sid, holders in whole.items() if len(holders) >= replicas}
    stored_live = {sid for sid, holders in whole.items() if len([i for i in holders if i not in nodes.dead]) >= replicas}
    assert not (failed & stored_live) and set(want) - stored <= failed, (
        f"reported failed {sorted(failed)}, not held whole by {replicas} nodes {sorted(set(want) - stored)}; "
        f"holders {whole}, killed {sorted(nodes.dead)}"
    )
    readable = [sid for sid in want if sid not in failed]
    if readable:
        with RoutingReader([str(r) for r in nodes.roots if (r / ROLLOUT).exists()]) as reader:
            got = reader.get_numpy(ROLLOUT, readable)  # merged: copies compared, each read from any
        for sid in readable:
            np.testing.assert_array_equal(got[sid], want[sid], err_msg=sid)
    if not killed:
        assert failed == set()
        for sid, holders in whole.items():
            assert len(holders) == replicas, (sid, holders)
            for record in sent.get(sid, []):
                if record.shared_prefix is not None:  # on its source's nodes (its root's)
                    assert holders == whole[record.shared_prefix.request_id], (sid, record.shared_prefix.request_id, whole)
