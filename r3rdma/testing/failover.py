"""Failover and refusal scenarios: :func:`node_lost` (replicas=2, a node lost with its root),
:func:`bad_records` (refused typed at every layer, the good ones stored), :func:`multiturn`,
:func:`restart_same_port`, :func:`stalled_announce` (stalled senders against node RSS) and
:func:`replicas_ingest_ratio`; :func:`failover_figures` runs them all for the bench's JSON."""

from __future__ import annotations

import asyncio
import random
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from r3rdma.store.process import NodeProcess, new_token, spawn_node
from r3rdma.testing.fuzz import _message
from r3rdma.testing.harness import (
    EXPERTS,
    LAYERS,
    TOP_K,
    _http_reader,
    _visible,
    free_port,
    make_record,
    spawn_nodes,
    unchecked_record,
)

# -- replicas, bad records, multi-turn, restarts, stalled senders -----------------------------


def node_lost(work: Path, *, requests: int = 200, seed: int = 0, timeout_s: float = 3.0) -> dict[str, Any]:
    """Three nodes, ``replicas=2``; after every request is acknowledged one node is SIGKILLed and
    its root deleted; every acknowledged request must still read back bit-exact over HTTP."""
    import shutil

    from r3rdma.errors import R3Error
    from r3rdma.transport import TransportLimits, configure_ucx_env
    from r3rdma.write.push_client import StoreNodesClient
    from r3rdma.write.writer import RoutingWriter

    configure_ucx_env()
    work = Path(work)
    token = new_token()
    nodes = spawn_nodes([work / f"replica-{i}" for i in range(3)], token)
    recs = [make_record("lost", f"q{i}") for i in range(requests)]
    out: dict[str, Any] = {"nodes": 3, "replicas": 2, "requests": requests}
    try:
        with StoreNodesClient(
            [n.push_url for n in nodes], secret=token, replicas=2, limits=TransportLimits(timeout_s=timeout_s)
        ) as client:
            with RoutingWriter(client, flush_bytes=64 << 10) as writer:  # several commits
                for r in recs:
                    writer.submit(r)
                writer.flush(timeout=120)
            failed = set(writer.failed_requests())
            acked = [r for r in recs if (r.rollout_id, r.request_id) not in failed]
            out["acked"] = len(acked)
            out["copies"] = client.copies_pushed
            victim = nodes[random.Random(seed).randrange(3)]
            out["victim_held"] = sum(1 for r in acked if victim.push_url in client.replica_set(r))
        reader = _http_reader(nodes)
        reader.info("lost")  # index cached with all three nodes: reads of the victim's must fail over
        victim.stop(signal.SIGKILL)
        shutil.rmtree(victim.root)
        lost = differing = 0
        with reader:
            for i in range(0, len(acked), 64):
                part = acked[i : i + 64]
                try:
                    got = reader.get_numpy("lost", [r.request_id for r in part])
                except R3Error as e:
                    out.setdefault("errors", []).append(f"{type(e).__name__}: {e}"[:300])
                    lost += len(part)
                    continue
                for r in part:
                    if r.request_id not in got:
                        lost += 1
                    elif got[r.request_id].dtype != r.ids_TLK.dtype or not np.array_equal(got[r.request_id], r.ids_TLK):
                        differing += 1
            out["read_failovers"] = reader.read_failovers
        out["acked_lost"] = lost + differing
        out["lost"], out["differing"] = lost, differing
        return out
    finally:
        for n in nodes:
            n.kill()


def bad_records(work: Path, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """Bad records offered at the capturer, ``RequestRecord``, the writer (over a local store and
    over a store node) and the store itself. Each must be refused with a typed ``R3Error`` before
    any acknowledgement (nothing of it stored); the good records of the same batches are stored
    (the writer commits a refused batch again record by record)."""
    from r3rdma.read.reader import RoutingReader
    from r3rdma.transport import configure_ucx_env

    configure_ucx_env()
    work = Path(work)
    offers = _Offers()
    capturer_good = _capturer_refusals(offers)
    _record_refusals(offers)
    local_root, node_root = work / "bad-local", work / "bad-node"
    _local_store_refusals(offers, local_root)
    visible_node = _node_refusals(offers, node_root, timeout_s)
    visible_local = _visible([local_root]).get("bad", {})
    # Nothing of a refused record is stored anywhere; every good record is, bit-exact.
    leaked = [
        rid
        for rid in list(visible_node) + list(visible_local)
        if rid.endswith(("zero", "geo", "geo2", "crc", "crc2", "batch-good"))
    ]
    stored = 0
    for root, prefix in ((local_root, "local"), (node_root, "node")):
        mine = [g for g in offers.good if g.request_id.startswith(prefix)]
        got = RoutingReader(str(root)).get_numpy("bad", [g.request_id for g in mine])
        stored += sum(np.array_equal(got[g.request_id], g.ids_TLK) for g in mine)
    dups_intact = (
        visible_local.get("dup-local") == make_record("bad", "dup-local").crc32c
        and visible_node.get("dup-node") == make_record("bad", "dup-node").crc32c
    )
    # A refusal that left something stored is no refusal.
    return {
        "tried": len(offers.tried),
        "refused": len(offers.refused) - len(leaked),
        "accepted": offers.accepted,
        "leaked": leaked,
        "good_total": len(offers.good) + 1,
        "good_stored": stored + int(capturer_good),
        "duplicates_intact": bool(dups_intact),
    }


class _Offers:
    """What :func:`bad_records` offered: each bad record's label, refused or accepted (a bad
    record that got through), and the good records submitted beside them."""

    def __init__(self) -> None:
        self.tried: list[str] = []
        self.refused: list[str] = []
        self.accepted: list[str] = []  # must stay empty
        self.good: list[Any] = []

    def offer(self, label: str, fn: Callable[[], Any]) -> None:
        """Call ``fn``, which hands over a bad record: refused if it raises an ``R3Error``."""
        from r3rdma.errors import R3Error

        self.tried.append(label)
        try:
            fn()
        except R3Error:
            self.refused.append(label)
            return
        self.accepted.append(label)

    def through_writer(self, store: Any, bads: list[Any], prefix: str) -> None:
        """Submit good and bad records interleaved in one batch; check what the writer says."""
        from r3rdma.errors import R3Error
        from r3rdma.write.writer import RoutingWriter

        writer = RoutingWriter(store, flush_bytes=1 << 30, flush_interval_s=3600)
        try:
            self.offer(f"{prefix} writer.submit: 0 rows", lambda: writer.submit(_zero(f"{prefix}-zero")))
            mine = [make_record("bad", f"{prefix}-good{i}") for i in range(len(bads) + 1)]
            for g, b in zip(mine, bads + [None]):
                writer.submit(g)
                if b is not None:
                    writer.submit(b)
            self.good.extend(mine)
            try:
                writer.flush(timeout=60)
            except R3Error:
                pass
            failed = set(writer.failed_requests())
        finally:
            try:
                writer.close(timeout=60)
            except R3Error:
                pass
        for b in bads:
            self.tried.append(f"{prefix} batch: {b.request_id}")
            (self.refused if (b.rollout_id, b.request_id) in failed else self.accepted).append(f"{prefix} batch: {b.request_id}")


def _zero(rid: str) -> Any:
    return unchecked_record("bad", rid, np.zeros((0, LAYERS, TOP_K), np.uint8), start_row=50)


def _conflicting(rid: str) -> Any:
    return make_record("bad", rid, variant=1)


def _capturer_refusals(offers: _Offers) -> bool:
    """The capturer: start_row past the rows, router ids the uint8 dtype cannot hold; whether
    the good request beside them was stored."""
    import torch

    from r3rdma.capture.capturer import RoutingCapturer

    class Sink:
        def __init__(self) -> None:
            self.records: list[Any] = []

        def submit(self, record: Any) -> None:
            self.records.append(record)

    layer_map, k, experts = (0, 2, 5), 2, 16
    sink = Sink()
    cap = RoutingCapturer(
        layer_map=layer_map, top_k=k, num_experts=experts, num_slots=64, sink=sink, rollout_id="bad", check_ids=True
    )

    def step(rid: str, slots: list[int], bad_id: int | None = None) -> None:
        n = len(slots)
        ids = np.arange(n * len(layer_map) * k).reshape(n, len(layer_map), k) % experts
        if bad_id is not None:
            ids[n // 2, 1, 0] = bad_id
        cap.begin_step([rid], [0], [n], slots)
        for i, layer in enumerate(layer_map):
            cap.record(layer, torch.as_tensor(ids[:, i]))
        cap.end_step()

    offer = offers.offer
    step("past", [0, 1, 2, 3])
    offer("capturer: start_row past the rows", lambda: cap.finish_request("past", prompt_len=3, generated_len=1, start_row=4))
    step("wide", [4, 5, 6], bad_id=300)  # e.g. an EPLB physical id: would wrap to 44 in uint8
    offer("capturer: router id out of the dtype's range", lambda: cap.finish_request("wide", prompt_len=2, generated_len=1))
    step("neg", [7, 8], bad_id=-1)
    offer("capturer: negative router id", lambda: cap.finish_request("neg", prompt_len=1, generated_len=1))
    step("fine", [9, 10, 11])
    cap.finish_request("fine", prompt_len=2, generated_len=1)
    return [r.request_id for r in sink.records] == ["fine"]


def _record_refusals(offers: _Offers) -> None:
    """``RequestRecord``: no rows, ids wider than the dtype, a short layer map, a negative start."""
    from r3rdma.records import RequestRecord

    lm = tuple(range(LAYERS))
    offers.offer("RequestRecord: 0 rows", lambda: RequestRecord("bad", "z", np.zeros((0, LAYERS, TOP_K), np.uint8), lm, EXPERTS))
    offers.offer(
        "RequestRecord: ids wider than the storage dtype",
        lambda: RequestRecord("bad", "w", np.full((3, LAYERS, TOP_K), 300, np.int64), lm, EXPERTS),
    )
    offers.offer(
        "RequestRecord: layer_map of another length",
        lambda: RequestRecord("bad", "l", np.zeros((3, LAYERS, TOP_K), np.uint8), lm[:-1], EXPERTS),
    )
    offers.offer(
        "RequestRecord: negative start_row",
        lambda: RequestRecord("bad", "s", np.zeros((3, LAYERS, TOP_K), np.uint8), lm, EXPERTS, start_row=-1),
    )


def _local_store_refusals(offers: _Offers, root: Path) -> None:
    """The store itself, and the writer over it."""
    from r3rdma.store.local_store import LocalRoutingStore

    with LocalRoutingStore(root) as store:
        store.commit([make_record("bad", "dup-local")])
        offers.offer(
            "LocalRoutingStore.commit: 0 rows in a batch",
            lambda: store.commit([make_record("bad", "local-batch-good"), _zero("local-zero")]),
        )
        offers.offer(
            "LocalRoutingStore.commit: other geometry in a batch",
            lambda: store.commit(
                [
                    make_record("bad", "local-batch-good"),
                    unchecked_record("bad", "local-geo", np.ones((3, LAYERS - 1, TOP_K), np.uint8)),
                ]
            ),
        )
        offers.through_writer(
            store,
            [_conflicting("dup-local"), unchecked_record("bad", "local-geo2", np.ones((3, LAYERS - 1, TOP_K), np.uint8))],
            "local",
        )


def _node_refusals(offers: _Offers, root: Path, timeout_s: float) -> dict[str, int]:
    """A store node, through ``StoreNodesClient`` and a writer over it; what the node shows of rollout "bad"."""
    from r3rdma.transport import TransportLimits
    from r3rdma.write.push_client import StoreNodesClient

    token = new_token()
    node = spawn_node(root, token)
    try:
        with StoreNodesClient([node.push_url], secret=token, limits=TransportLimits(timeout_s=timeout_s)) as client:
            client.commit([make_record("bad", "dup-node")])
            offers.offer(
                "node: 0 rows in a batch", lambda: client.commit([make_record("bad", "node-batch-good"), _zero("node-zero")])
            )
            offers.offer(
                "node: wrong sender checksum in a batch",
                lambda: client.commit(
                    [
                        make_record("bad", "node-batch-good"),
                        unchecked_record("bad", "node-crc", np.ones((3, LAYERS, TOP_K), np.uint8)),
                    ]
                ),
            )
            bad_crc = unchecked_record("bad", "node-crc2", np.ones((3, LAYERS, TOP_K), np.uint8))
            offers.through_writer(client, [_conflicting("dup-node"), bad_crc], "node")
        return _visible([node.root]).get("bad", {})
    finally:
        node.stop()


def multiturn(work: Path, *, conversations: int = 8, turns: int = 4, seed: int = 0) -> dict[str, Any]:
    """Conversations of ``turns`` turns (one stored id each, TP's pushing rank keyed on it) whose
    turns are committed out of order (a later turn first), through a ``LocalRoutingStore`` and
    through a store node; count the turns readable, bit-exact, at the end."""
    from r3rdma.read.reader import RoutingReader
    from r3rdma.records import RequestRecord
    from r3rdma.store.local_store import LocalRoutingStore
    from r3rdma.transport import TransportLimits, configure_ucx_env
    from r3rdma.write.push_client import StoreNodesClient

    configure_ucx_env()
    work = Path(work)
    rng = random.Random(seed)
    convs: dict[str, tuple[np.ndarray, list[Any]]] = {}
    for c in range(conversations):
        whole = make_record("mt", f"conv{c}", rows=turns * 6 + c).ids_TLK
        cuts = sorted(rng.sample(range(1, len(whole)), turns - 1))
        bounds = list(zip([0] + cuts, cuts + [len(whole)]))
        parts = [RequestRecord("mt", f"conv{c}", whole[a:b], tuple(range(LAYERS)), EXPERTS, start_row=a) for a, b in bounds]
        convs[f"conv{c}"] = (whole, parts)

    def order(c: int, parts: list[Any]) -> list[list[Any]]:
        """Always a later turn first: reversed, last-then-rest, or all in one batch reversed."""
        kind = c % 3
        if kind == 0:
            return [[p] for p in reversed(parts)]
        if kind == 1:
            return [[parts[-1]]] + [[p] for p in parts[:-1]]
        return [list(reversed(parts))]

    def readable(reader: Any) -> int:
        n = 0
        for cid, (_whole, parts) in convs.items():
            try:
                got = reader.get_numpy("mt", [cid])[cid]
            except (KeyError, ValueError):
                continue
            n += sum(
                1
                for p in parts
                if len(got) >= p.start_row + len(p.ids_TLK)
                and np.array_equal(got[p.start_row : p.start_row + len(p.ids_TLK)], p.ids_TLK)
            )
        return n

    out: dict[str, Any] = {"turns": 2 * conversations * turns}
    with LocalRoutingStore(work / "mt-local") as store:
        for c, (_, parts) in enumerate(convs.values()):
            for batch in order(c, parts):
                store.commit(batch)
        out["pending_local"] = len(store.pending("mt"))
    with RoutingReader(str(work / "mt-local")) as reader:
        out["stored_local"] = readable(reader)
    token = new_token()
    node = spawn_node(work / "mt-node", token)
    try:
        with StoreNodesClient([node.push_url], secret=token, limits=TransportLimits(timeout_s=10)) as client:
            for c, (_, parts) in enumerate(convs.values()):
                for batch in order(c + 1, parts):  # other orders than the local store's
                    client.commit(batch)
        with _http_reader([node]) as reader:
            out["stored_node"] = readable(reader)
    finally:
        node.kill()
    out["stored"] = out["stored_local"] + out["stored_node"]
    return out


def restart_same_port(work: Path, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """SIGKILL a node with a connection open, restart it on the same fixed ports at once; seconds
    from the kill's reaping to the restarted node's ready line; both commits read back."""
    from r3rdma.transport import TransportLimits, configure_ucx_env
    from r3rdma.write.push_client import StoreNodesClient

    configure_ucx_env()
    root = Path(work) / "restart"
    token = new_token()
    ucx, http = free_port(), free_port()
    fixed = ("--ucx-port", str(ucx), "--http-port", str(http), "--timeout-s", str(timeout_s))
    node = spawn_node(root, token, *fixed)
    limits = TransportLimits(timeout_s=timeout_s)
    try:
        with StoreNodesClient([node.push_url], secret=token, limits=limits) as client:
            client.commit([make_record("restart", "before")])
            node.kill()  # SIGKILL with the connection open: the node's side closes first
    finally:
        node.kill()
    t0 = time.perf_counter()
    again = spawn_node(root, token, *fixed)
    seconds = time.perf_counter() - t0
    try:
        same = (again.ucx_port, again.http_port) == (ucx, http)
        with StoreNodesClient([again.push_url], secret=token, limits=limits) as client:
            client.commit([make_record("restart", "after")])
        intact = set(_visible([root]).get("restart", {})) == {"before", "after"}
    finally:
        again.kill()
    return {"seconds": round(seconds, 3), "same_ports": same, "intact": intact}


async def announce_and_stall(node: NodeProcess, payload_mb: int, *, with_crc: bool = True) -> tuple[Any, int]:
    """Authenticate, announce one batch of ``payload_mb`` MiB with its table, send no payload
    byte; return (conn, version) with the node's reply not yet read."""
    import msgpack

    from r3rdma.transport import TransportLimits
    from r3rdma.transport.auth import coerce_secret
    from r3rdma.transport.batch import RecordMeta, batch_header
    from r3rdma.transport.frames import Kind
    from r3rdma.transport.session import client_handshake
    from r3rdma.transport.ucx_env import import_ucxx
    from r3rdma.transport.ucxx_transport import _UcxxConn

    rows = (payload_mb << 20) // (LAYERS * TOP_K)
    meta = RecordMeta(
        "stall",
        f"s{secrets.token_hex(4)}",
        rows,
        LAYERS,
        TOP_K,
        "uint8",
        EXPERTS,
        tuple(range(LAYERS)),
        0,
        0x1234 if with_crc else None,
        0,
    )
    header = msgpack.packb(batch_header(1, [meta.to_wire()], [meta.nbytes]))
    ucxx = import_ucxx()
    ep = await ucxx.create_endpoint(node.host, node.ucx_port, connect_timeout=10)
    conn = _UcxxConn(ep, "staller")
    version = await client_handshake(conn, coerce_secret(node.token), TransportLimits(timeout_s=10))
    for m in _message(int(Kind.BATCH), header, [], payload_len=meta.nbytes):
        await conn.send(np.frombuffer(m, np.uint8))
    return conn, version


async def stall_while_pushing(
    node: NodeProcess, record: Any, *, connections: int, payload_mb: int
) -> tuple[Any, bool, list[Any]]:
    """``connections`` stallers announce ``payload_mb`` MiB each and send nothing while a normal
    client pushes ``record``: (its ack, whether it was acked before any staller was answered,
    how each staller's wait for a reply ended)."""
    from r3rdma.transport import TransportLimits, UcxxClient
    from r3rdma.transport.session import recv_reply

    stallers = [await announce_and_stall(node, payload_mb) for _ in range(connections)]
    replies = [asyncio.ensure_future(recv_reply(c, v, 1, TransportLimits(ack_timeout_s=30))) for c, v in stallers]
    client = UcxxClient(node.host, node.ucx_port, secret=node.token, limits=TransportLimits(timeout_s=10))
    try:
        ack = await client.push([record])
    finally:
        await client.close()
    pushed_while_stalled = not any(r.done() for r in replies)
    outcomes = await asyncio.gather(*replies, return_exceptions=True)
    for c, _ in stallers:
        await c.close()
    return ack, pushed_while_stalled, outcomes


def stalled_announce(
    work: Path, *, connections: int = 6, payload_mb: int = 255, inflight_mb: int = 1024, node_timeout_s: float = 3.0
) -> dict[str, Any]:
    """``connections`` authenticated connections each announce a ``payload_mb`` MiB batch and
    send nothing while a normal client pushes; node peak RSS growth, and how each staller ends."""
    from r3rdma.errors import R3TimeoutError
    from r3rdma.transport import configure_ucx_env

    configure_ucx_env()
    node = spawn_node(
        Path(work) / "stall",
        new_token(),
        "--max-payload-mb",
        str(payload_mb + 1),
        "--timeout-s",
        str(node_timeout_s),
        "--max-inflight-mb",
        str(inflight_mb),
    )
    try:
        base = node.rss()

        run = stall_while_pushing(node, make_record("stall", "normal"), connections=connections, payload_mb=payload_mb)
        _, pushed, outcomes = asyncio.run(asyncio.wait_for(run, 120))
        growth = node.peak_rss() - base
        return {
            "connections": connections,
            "announced_mb": connections * payload_mb,
            "peak_rss_growth_mb": round(growth / 2**20, 1),
            "pushed_while_stalled": pushed,
            # ``fatal`` is set on errors decoded from the node's ERROR frame (transport.session.recv_reply);
            # a timeout raised here while waiting for that frame has none and is not the node's typed answer.
            "typed_timeouts": sum(isinstance(o, R3TimeoutError) and getattr(o, "fatal", False) for o in outcomes),
            "alive": node.alive,
        }
    finally:
        node.kill()


def replicas_ingest_ratio(
    work: Path, *, rounds: int = 5, requests: int = 64, rows: int = 2048, timeout_s: float = 30.0
) -> dict[str, Any]:
    """Ingest MB/s of the same records to the same three nodes with ``replicas=2`` and
    ``replicas=1``, rounds interleaved (r1, r2, r2, r1, ...), median of each; ratio r2 / r1.
    MB/s counts each request once (bytes durable per second), not each copy."""
    from r3rdma.records import RequestRecord
    from r3rdma.transport import TransportLimits, configure_ucx_env
    from r3rdma.write.push_client import StoreNodesClient

    configure_ucx_env()
    token = new_token()
    nodes = spawn_nodes([Path(work) / f"ingest-{i}" for i in range(3)], token)
    base = [make_record("ingest", f"q{i}", rows=rows).ids_TLK for i in range(requests)]
    nbytes = sum(a.nbytes for a in base)
    mb_s: dict[int, list[float]] = {1: [], 2: []}
    try:
        clients = {
            r: StoreNodesClient(
                [n.push_url for n in nodes], secret=token, replicas=r, limits=TransportLimits(timeout_s=timeout_s)
            )
            for r in (1, 2)
        }
        try:
            for i in range(-1, rounds):  # round -1: warm-up (connections, first index), not counted
                for r in (1, 2) if i % 2 == 0 else (2, 1):
                    # Same bytes each round, fresh ids (a re-push of stored ids would be a no-op).
                    recs = [
                        RequestRecord(f"ingest-r{r}-{i + 1}", f"q{j}", a, tuple(range(LAYERS)), EXPERTS)
                        for j, a in enumerate(base)
                    ]
                    t0 = time.perf_counter()
                    for j in range(0, len(recs), 16):
                        clients[r].commit(recs[j : j + 16])
                    if i >= 0:
                        mb_s[r].append(nbytes / (time.perf_counter() - t0) / 1e6)
        finally:
            for c in clients.values():
                c.close()
    finally:
        for n in nodes:
            n.stop()
    med = {r: float(np.median(v)) for r, v in mb_s.items()}
    return {
        "rounds": rounds,
        "mb_per_round": round(nbytes / 1e6, 2),
        "r1_mb_s": round(med[1], 2),
        "r2_mb_s": round(med[2], 2),
        "ratio": round(med[2] / med[1], 3),
        "r1_all": [round(x, 2) for x in mb_s[1]],
        "r2_all": [round(x, 2) for x in mb_s[2]],
    }


def failover_figures(
    work: Path, *, quick: bool = False, seed: int = 0, log: Callable[[str], None] = lambda s: None
) -> dict[str, Any]:
    """Every scenario of this module run once, their figures flat as the bench's JSON has them
    (``quick``: smaller sizes, well under a minute)."""
    work = Path(work)
    out: dict[str, Any] = {}
    lost = node_lost(work / "lost", requests=60 if quick else 400, seed=seed)
    log(f"node lost: {lost}")
    bad = bad_records(work / "bad")
    log(f"bad records: {bad}")
    mt = multiturn(work / "mt", conversations=3 if quick else 12, turns=3 if quick else 4, seed=seed)
    log(f"multi-turn: {mt}")
    restart = restart_same_port(work / "restart")
    log(f"restart: {restart}")
    stall = stalled_announce(
        work / "stall",
        connections=3 if quick else 6,
        payload_mb=64 if quick else 255,
        inflight_mb=256 if quick else 1024,
        node_timeout_s=2 if quick else 3,
    )
    log(f"stalled: {stall}")
    ingest = replicas_ingest_ratio(work / "ingest", rounds=3 if quick else 7, requests=16 if quick else 64)
    log(f"replicas ingest: {ingest}")
    out.update(
        {
            "node_lost_acked": lost["acked"],
            "node_lost_acked_lost": lost["acked_lost"],
            "bad_records_tried": bad["tried"],
            "bad_records_refused": bad["refused"],
            "bad_records_good_stored": bad["good_stored"],
            "bad_records_good_total": bad["good_total"],
            "tp_multiturn_turns": mt["turns"],
            "tp_multiturn_turns_stored": mt["stored"],
            "restart_same_port_s": restart["seconds"],
            "restart_same_port_ok": restart["same_ports"] and restart["intact"],
            "stalled_announce_mb": stall["announced_mb"],
            "stalled_announce_peak_rss_mb": stall["peak_rss_growth_mb"],
            "stalled_typed_timeouts": stall["typed_timeouts"],
            "replicas1_ingest_mb_s": ingest["r1_mb_s"],
            "replicas2_ingest_mb_s": ingest["r2_mb_s"],
            "replicas2_ingest_ratio": ingest["ratio"],
        }
    )
    return out
