"""``r3rdma bench reliability``: crash, fuzz, auth, disk-full and load figures, one JSON line last.

Each part runs real store nodes (``r3rdma-store`` subprocesses) on loopback and checks its own
invariant; the tests (tests/test_reliability*.py, tests/test_fuzz*.py) call the same functions
with smaller sizes. docs/RELIABILITY.md states what is guaranteed and how each part tests it.

- :func:`crash_cycles`: two nodes; clients push while one node is SIGKILLed at a random
  moment; after the restart every acknowledged request reads back bit-exact, nothing partial
  or foreign is visible, unacknowledged batches are retried (same node after the restart, or
  the other node) and acknowledged ones re-pushed (idempotent; different bytes: refused).
- :func:`fuzz_node`: malformed, truncated, oversized and out-of-order protocol messages (pre-
  and post-authentication) to a live node while a well-behaved client keeps pushing; every
  message is answered with a typed error frame, an ack, or that connection's close.
- :func:`fuzz_http`: raw HTTP requests (bad paths, traversal, ranges, methods, tokens).
- :func:`disk_full`: a node under ``RLIMIT_FSIZE`` refuses an oversized batch with a clear
  ``StoreError``, leaves nothing partial, keeps serving; after a restart without the limit
  the batch goes in and earlier data is intact.
- :func:`load`: N clients push for T seconds to two nodes; zero loss, ack latency, throughput,
  node peak RSS against the configured in-flight budget.
- :func:`issue19` (``--quick``: smaller sizes): :func:`node_lost` (three nodes, ``replicas=2``,
  one SIGKILLed and its root deleted: every acknowledged request still reads over HTTP),
  :func:`bad_records` (bad records offered at the capturer, ``RequestRecord``, the writer, the
  store and a node: each refused typed, the good ones of the same batches stored),
  :func:`multiturn` (turns committed later-first: all readable in the end),
  :func:`restart_same_port` (SIGKILL, restart on the same fixed ports: seconds to ready),
  :func:`stalled_announce` (connections announce big batches and send nothing: node RSS), and
  :func:`replicas_ingest_ratio` (ingest MB/s with ``replicas=2`` over ``replicas=1``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from r3rdma.store.process import NodeProcess, new_token, spawn_node
from r3rdma.records import buffer_checksum

__all__ = [
    "make_record",
    "crash_cycles",
    "fuzz_node",
    "fuzz_http",
    "disk_full",
    "load",
    "free_port",
    "unchecked_record",
    "announce_and_stall",
    "node_lost",
    "bad_records",
    "multiturn",
    "restart_same_port",
    "stalled_announce",
    "replicas_ingest_ratio",
    "issue19",
    "add_arguments",
    "main",
]

LAYERS, TOP_K, EXPERTS = 8, 4, 64


# -- records -----------------------------------------------------------------------------------


def make_record(rollout_id: str, request_id: str, *, variant: int = 0, rows: int | None = None,
                layers: int = LAYERS, top_k: int = TOP_K):
    """A record whose bytes depend only on (rollout, request, variant): checkable after a crash."""
    from r3rdma.records import RequestRecord

    seed = zlib.crc32(f"{rollout_id}/{request_id}/{variant}".encode())
    rng = np.random.default_rng(seed)
    n = rows if rows is not None else int(8 + seed % 120)
    ids = rng.integers(0, EXPERTS, size=(n, layers, top_k), dtype=np.uint8)
    return RequestRecord(rollout_id, request_id, ids, tuple(range(layers)), EXPERTS)


def _owner(key: str, n: int) -> int:
    from r3rdma.write.push_client import rendezvous_order

    names = [f"node{i}" for i in range(n)]
    return names.index(rendezvous_order(names, key)[0])


def _visible(roots: Sequence[Path]) -> dict[str, dict[str, int]]:
    """rollout -> {request_id: crc32c} of every committed request under ``roots`` (merged)."""
    from r3rdma.store.rollout_index import load_index, read_file

    out: dict[str, dict[str, int]] = {}
    for root in roots:
        if not root.is_dir():
            continue
        for child in root.iterdir():
            index = load_index(child.name, read_file(child), str(root)) if child.is_dir() else None
            if index is not None:
                mine = out.setdefault(child.name, {})
                for rid, entry in index.requests.items():
                    mine[rid] = entry["segments"][0]["crc32c"]
    return out


def _verify(roots: Sequence[Path], acked: dict[tuple[str, str], int], pushed: set[tuple[str, str]],
            *, read_bytes: bool = True, exact: bool = True) -> dict[str, int]:
    """Check acknowledged requests against the roots; return loss / phantom / corrupt counts.

    Reads every visible request back through :class:`RoutingReader` (checksums verified) and
    compares its bytes with the deterministic record (``read_bytes``), else compares CRCs.
    """
    from r3rdma.read.reader import RoutingReader

    visible = _visible(roots)
    lost = sum(1 for (ro, rid) in acked if rid not in visible.get(ro, {}))
    phantom = sum(1 for ro, reqs in visible.items() for rid in reqs if (ro, rid) not in pushed)
    corrupt = 0
    with RoutingReader([str(r) for r in roots if r.is_dir()]) as reader:
        for ro, reqs in visible.items():
            ids = sorted(reqs)
            for i in range(0, len(ids), 256):
                part = ids[i : i + 256]
                if read_bytes:
                    got = reader.get_numpy(ro, part)  # CRC-32C of every segment verified
                    for rid in part:
                        # Records made with default rows are reproducible: compare the bytes.
                        if exact and not np.array_equal(got[rid], make_record(ro, rid).ids_TLK):
                            corrupt += 1
                for rid in part:
                    want = acked.get((ro, rid))
                    if want is not None and reqs[rid] != want:
                        corrupt += 1
    return {"lost": lost, "phantom": phantom, "corrupt": corrupt, "visible": sum(map(len, visible.values()))}


def _orphans(root: Path) -> int:
    """Batch arrays and index parts on disk the entry point does not count (what a crash
    mid-commit leaves)."""
    from r3rdma.store.layout import read_group_attrs
    from r3rdma.store.rollout_index import check_entry, parse_part_name
    from r3rdma.store.layout import parse_array_name

    n = 0
    for child in root.iterdir() if root.is_dir() else []:
        if not child.is_dir():
            continue
        entry = check_entry(child.name, read_group_attrs(child / "zarr.json") or {}, str(root)) or {}
        counted = entry.get("parts", 0)
        n += sum(1 for a in child.iterdir() if (parse_array_name(a.name) or parse_part_name(a.name) or 0) > counted)
    return n


# -- crash cycles ------------------------------------------------------------------------------


async def _crash_cycles(work: Path, cycles: int, clients: int, seed: int, timeout_s: float,
                        log: Callable[[str], None]) -> dict[str, Any]:
    from r3rdma.errors import DuplicateRequestError, R3Error
    from r3rdma.transport import TransportLimits, UcxxClient

    rng = random.Random(seed)
    token = new_token()
    roots = [work / "crash-a", work / "crash-b"]
    nodes = [spawn_node(r, token) for r in roots]
    limits = TransportLimits(timeout_s=timeout_s, ack_timeout_s=4 * timeout_s)
    acked: dict[tuple[str, str], int] = {}  # (rollout, request) -> crc32c
    where: dict[tuple[str, str], int] = {}  # node that acked it
    pushed: set[tuple[str, str]] = set()
    stats = {"kill_cycles": 0, "acked_before_kill": 0, "unacked_retried": 0, "retried_same_node": 0,
             "retried_other_node": 0, "idempotent_repushes": 0, "different_bytes_refused": 0,
             "orphan_arrays_after_kill": 0, "acked_lost": 0, "phantom": 0, "corrupt": 0, "errors": []}

    def client(i: int) -> Any:
        return UcxxClient(nodes[i].host, nodes[i].ucx_port, secret=token, limits=limits)

    try:
        for cycle in range(cycles):
            victim = rng.randrange(2)
            kill_after = rng.randint(1, 4 * clients)
            jitter = rng.uniform(0, 0.03)
            acks = 0
            killed = asyncio.Event()
            unacked: list[tuple[list[Any], int]] = []
            loop = asyncio.get_running_loop()

            def kill() -> None:
                os.kill(nodes[victim].proc.pid, signal.SIGKILL)
                killed.set()

            async def pusher(p: int) -> None:
                nonlocal acks
                conns = {0: client(0), 1: client(1)}
                n = 0
                try:
                    while not killed.is_set():
                        rollout = f"crash-{p % 3}"
                        batch = [make_record(rollout, f"c{cycle}-p{p}-{n + j}") for j in range(rng.randint(1, 6))]
                        n += len(batch)
                        groups: dict[int, list[Any]] = {}
                        for r in batch:
                            pushed.add((r.rollout_id, r.request_id))
                            groups.setdefault(_owner(f"{r.rollout_id}/{r.request_id}", 2), []).append(r)
                        for i, group in groups.items():
                            if killed.is_set() and i == victim:
                                unacked.append((group, i))  # never sent: the node is gone
                                continue
                            try:
                                await conns[i].push(group)
                            except R3Error as e:
                                if i != victim:
                                    stats["errors"].append(f"survivor refused a push: {type(e).__name__}: {e}")
                                unacked.append((group, i))
                                continue
                            for r in group:
                                acked[(r.rollout_id, r.request_id)] = r.crc32c
                                where[(r.rollout_id, r.request_id)] = i
                            acks += 1
                            if acks == kill_after:
                                loop.call_later(jitter, kill)
                finally:
                    for c in conns.values():
                        await c.close()

            await asyncio.gather(*(pusher(p) for p in range(clients)))
            await asyncio.to_thread(nodes[victim].proc.wait, 30)
            stats["kill_cycles"] += 1
            stats["acked_before_kill"] = len(acked)
            stats["orphan_arrays_after_kill"] += _orphans(roots[victim])
            nodes[victim] = spawn_node(roots[victim], token)
            # Every acknowledged request is there, bit-exact; nothing partial or foreign.
            check = await asyncio.to_thread(_verify, roots, acked, pushed)
            for key in ("lost", "phantom", "corrupt"):
                stats["acked_lost" if key == "lost" else key] += check[key]
            # Retry what was not acknowledged: the restarted node or the other one.
            for group, i in unacked:
                target = i if rng.random() < 0.5 else 1 - i
                c = client(target)
                try:
                    await c.push(group)
                except R3Error as e:
                    stats["errors"].append(f"retry refused: {type(e).__name__}: {e}")
                    continue
                finally:
                    await c.close()
                stats["unacked_retried"] += len(group)
                stats["retried_same_node" if target == i else "retried_other_node"] += len(group)
                for r in group:
                    acked[(r.rollout_id, r.request_id)] = r.crc32c
                    where[(r.rollout_id, r.request_id)] = target
            # Idempotence: same bytes accepted again; different bytes for the same id refused.
            if acked:
                ro, rid = rng.choice(sorted(acked))
                c = client(where[(ro, rid)])
                try:
                    await c.push([make_record(ro, rid)])
                    stats["idempotent_repushes"] += 1
                    try:
                        await c.push([make_record(ro, rid, variant=1)])
                        stats["errors"].append(f"different bytes for {ro}/{rid} were accepted")
                    except DuplicateRequestError:
                        stats["different_bytes_refused"] += 1
                except R3Error as e:
                    stats["errors"].append(f"idempotent re-push failed: {type(e).__name__}: {e}")
                finally:
                    await c.close()
            log(f"cycle {cycle + 1}/{cycles}: killed node {victim} after {kill_after} acks, "
                f"{len(acked)} acked so far, {len(unacked)} batches retried, check {check}")
        for node in nodes:
            node.stop()
        final = await asyncio.to_thread(_verify, roots, acked, pushed)
        stats["acked_lost"] += final["lost"]
        stats["corrupt"] += final["corrupt"]
        stats["phantom"] += final["phantom"]
        stats["acked_total"] = len(acked)
        return stats
    finally:
        for node in nodes:
            node.kill()


def crash_cycles(work: Path, cycles: int = 20, *, clients: int = 6, seed: int = 0, timeout_s: float = 3.0,
                 log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """SIGKILL a node ``cycles`` times under load; see the module docstring for the checks."""
    from r3rdma.transport import configure_ucx_env

    configure_ucx_env()
    return asyncio.run(_crash_cycles(Path(work), cycles, clients, seed, timeout_s, log))


# -- protocol fuzzer ---------------------------------------------------------------------------


@dataclass
class FuzzFrame:
    """One malformed (or valid) protocol message and how to deliver it.

    ``auth``: sent on an authenticated connection (else as the first message of a new one).
    ``keep``: the connection stays usable after a non-fatal reply (only for messages that
    are consumed whole). ``wrong_proof``: a real HELLO, then an AUTH with a bad proof.
    """

    label: str
    messages: list[bytes]
    auth: bool
    keep: bool = False
    wrong_proof: bool = False


def _preamble(version: int, kind: int, header_len: int, payload_len: int) -> bytes:
    import struct

    return struct.pack("<2sBBIQ", b"R3", version & 0xFF, kind & 0xFF, header_len & 0xFFFFFFFF,
                       payload_len & 0xFFFFFFFFFFFFFFFF)


def _message(kind: int, header: bytes, frames: Sequence[bytes] = (), *, version: int = 1,
             header_len: int | None = None, payload_len: int | None = None) -> list[bytes]:
    from r3rdma.transport.frames import INLINE_HEADER_BYTES

    hl = len(header) if header_len is None else header_len
    pl = sum(len(f) for f in frames) if payload_len is None else payload_len
    pre = _preamble(version, kind, hl, pl)
    head = [pre + header] if len(header) <= INLINE_HEADER_BYTES else [pre, header]
    return head + [f for f in frames if f]


_WEIRD_VALUES: list[Any] = [None, True, -1, 0, 1, 2**31, 2**63 - 1, -(2**63), 1.5, float("nan"), "", "x" * 300,
                            b"", b"\x00" * 40, [], [1, 2], {}, {"a": 1}, "../etc", "a/b", "..", ".r3rdma.lock",
                            "zarr.json", "\u00e9", "roll\x00"]


def _mutate_header(rng: random.Random, header: dict[str, Any]) -> dict[str, Any]:
    header = json.loads(json.dumps(header))  # deep copy (plain types only)
    entry = header["records"][rng.randrange(len(header["records"]))]
    choice = rng.randrange(6)
    if choice == 0:
        entry.pop(rng.choice(sorted(entry)))
    elif choice == 1:
        entry[rng.choice(sorted(entry))] = rng.choice(_WEIRD_VALUES)
    elif choice == 2:
        header[rng.choice(sorted(header))] = rng.choice(_WEIRD_VALUES)
    elif choice == 3:
        entry["extra"] = 1
    elif choice == 4:
        key = rng.choice(["rows", "layers", "top_k", "offset", "start_row", "num_experts", "total_rows"])
        entry[key] = rng.choice([-1, 0, 1, entry.get(key) or 0, (entry.get(key) or 0) + 1, 2**40])
    else:
        header["frames"] = [rng.choice([0, 1, 7, 4096, 2**40])] * rng.randint(0, 3)
    return header


def _valid_batch(rng: random.Random, rollout: str, rid: str, seq: int) -> tuple[dict[str, Any], bytes]:
    from r3rdma.transport.batch import batch_header, encode_records

    rec = make_record(rollout, rid)
    table, frames = encode_records([rec], max_frames=8)
    payload = b"".join(bytes(f) for f in frames)
    return batch_header(seq, table, [len(payload)]), payload


def gen_frame(rng: random.Random, n: int) -> FuzzFrame:
    """The ``n``-th fuzz message, drawn from ``rng`` (a ``random.Random``)."""
    import msgpack

    from r3rdma.transport.frames import Kind

    pack = lambda h: msgpack.packb(h, use_bin_type=True)  # noqa: E731
    HELLO, AUTH, BATCH = int(Kind.HELLO), int(Kind.AUTH), int(Kind.BATCH)
    r = rng.random()
    rollout = "fuzz"
    # Mostly ids from a small set: once stored, a re-push is an idempotent duplicate that costs
    # no write (a durable commit costs ~40 ms of fsync here and would dominate the run).
    rid = f"f{n}-{rng.randrange(1 << 30)}" if rng.random() < 0.2 else f"dup{rng.randrange(16)}"
    # -- before authentication (a new connection each) -- 30 %
    if r < 0.06:
        size = rng.choice([1, 5, 15, 16, 17, 100, 4096, 4097, 9000])
        return FuzzFrame("garbage", [rng.randbytes(size)], auth=False)
    if r < 0.12:
        pre = _preamble(rng.choice([0, 1, 2, 255]), rng.choice([0, 1, 3, 5, 6, 7, 8, 255]),
                        rng.choice([0, 1, 1024, 1025, 2**32 - 1, rng.randrange(2**32)]),
                        rng.choice([0, 1, 2**63, 2**64 - 1, rng.randrange(2**64)]))
        return FuzzFrame("bad_preamble_preauth", [pre + rng.randbytes(rng.randrange(0, 64))], auth=False)
    if r < 0.20:
        hello: Any = {"versions": [1], "nonce": secrets.token_bytes(32)}
        m = rng.randrange(6)
        if m == 0:
            hello["versions"] = rng.choice(_WEIRD_VALUES)
        elif m == 1:
            hello["nonce"] = rng.choice(_WEIRD_VALUES)
        elif m == 2:
            hello = rng.choice([[1, 2], "hello", 7, None])
        elif m == 3:
            hello["pad"] = "x" * rng.choice([10, 1000, 2000])
        elif m == 4:
            hello["versions"] = [rng.randrange(2, 300) for _ in range(rng.randint(0, 5))]
        raw = pack(hello)
        if m == 5:
            raw = raw[: rng.randrange(len(raw))] + rng.randbytes(rng.randrange(3))  # truncated msgpack
        return FuzzFrame("hello_mutant", _message(HELLO, raw), auth=False)
    if r < 0.25:
        return FuzzFrame("wrong_proof", [], auth=False, wrong_proof=True)
    if r < 0.30:
        header, payload = _valid_batch(rng, rollout, rid, 1)
        kind = rng.choice([BATCH, AUTH])
        return FuzzFrame("before_auth", _message(kind, pack(header), [payload]), auth=False)
    # -- after authentication -- 70 %
    header, payload = _valid_batch(rng, rollout, rid, n + 1)
    if r < 0.38:
        return FuzzFrame("valid", _message(BATCH, pack(header), [payload]), auth=True, keep=True)
    if r < 0.52:
        data = bytearray(payload)
        if rng.random() < 0.5 and len(data) > 1:
            # Shorter than announced: the zero-filled tail fails the CRC (unless the cut-off
            # bytes were zeros: then the data is right and an ack is correct).
            data = data[: rng.randrange(1, len(data))]
            label = "short_payload"
        else:
            for i in rng.sample(range(len(data)), min(len(data), rng.randint(1, 4))):
                data[i] ^= rng.randrange(1, 256)
            label = "corrupt_payload"
        return FuzzFrame(label, _message(BATCH, pack(header), [bytes(data)], payload_len=len(payload)),
                         auth=True, keep=True)
    if r < 0.56:
        m = rng.randrange(2)
        bad = dict(header)
        rec = dict(header["records"][0])
        if m == 0:  # handler refusal: reserved rollout id (valid syntax)
            rec["rollout_id"] = rng.choice([".r3rdma.lock", "zarr.json", ".hidden"])
        else:  # geometry that the rollout does not store
            rec["num_experts"] = 300
            rec["dtype"] = "uint16"
            rec["rows"] = len(payload) // (rec["layers"] * rec["top_k"] * 2)
            if rec["rows"] < 1:
                rec["rows"] = 1
            payload = payload[: rec["rows"] * rec["layers"] * rec["top_k"] * 2]
            rec["crc32c"] = buffer_checksum(payload)  # the sender's checksum of what is sent: the refusal is the handler's
            bad["frames"] = [len(payload)]
        bad["records"] = [rec]
        return FuzzFrame("handler_refusal", _message(BATCH, pack(bad), [payload]), auth=True, keep=True)
    if r < 0.76:
        bad = _mutate_header(rng, header)
        try:
            raw = pack(bad)
        except (TypeError, ValueError, OverflowError):
            raw = pack(header)
        return FuzzFrame("header_mutant", _message(BATCH, raw, [payload]), auth=True)
    if r < 0.86:
        raw = pack(header)
        m = rng.randrange(5)
        if m == 0:
            msgs = _message(BATCH, raw, [payload], header_len=rng.choice([0, len(raw) - 1, len(raw) + 1, 2**32 - 1]))
        elif m == 1:
            msgs = _message(BATCH, raw, [payload], payload_len=rng.choice([0, len(payload) + 1, 2**40, 2**64 - 1]))
        elif m == 2:
            msgs = _message(BATCH, raw, [payload], version=rng.choice([0, 2, 255]))
        elif m == 3:
            msgs = _message(BATCH, rng.randbytes(rng.randrange(1, 200)), [payload])
        else:
            msgs = _message(BATCH, raw[:-1] + b"\xc1" + raw[-1:], [payload])  # msgpack with a never-used byte
        return FuzzFrame("preamble_or_msgpack_mutant", msgs, auth=True)
    if r < 0.93:
        kind = rng.choice([int(k) for k in Kind if k != Kind.BATCH] + [0, 99])
        return FuzzFrame("out_of_order", _message(kind, pack({"seq": 1})), auth=True)
    if r < 0.99:
        # A longer payload frame than announced (UCX truncation), or a valid batch followed by junk.
        if rng.random() < 0.5:
            longer = payload + rng.randbytes(rng.randint(1, 64))
            return FuzzFrame("longer_frame", _message(BATCH, pack(header), [longer], payload_len=len(payload)), auth=True)
        return FuzzFrame("trailing_junk", _message(BATCH, pack(header), [payload]) + [rng.randbytes(20)], auth=True)
    # Fewer frames than announced: the node waits its timeout, then closes this connection.
    return FuzzFrame("missing_frames", _message(BATCH, pack(header), [], payload_len=len(payload)), auth=True)


@dataclass
class FuzzStats:
    frames: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # worker time per label
    untyped: list[str] = field(default_factory=list)
    hangs: int = 0
    legit_pushes: int = 0
    legit_failures: list[str] = field(default_factory=list)
    node_crashed: bool = False
    rss_start: int = 0
    rss_max: int = 0
    rss_end: int = 0

    def note(self, label: str, outcome: str) -> None:
        key = f"{label}:{outcome}"
        self.outcomes[key] = self.outcomes.get(key, 0) + 1


async def _fuzz(node: NodeProcess, frames: Sequence[FuzzFrame], concurrency: int, reply_timeout: float,
                stats: FuzzStats) -> None:
    import r3rdma.errors as errors
    from r3rdma.errors import R3Error, R3TimeoutError, TransportError
    from r3rdma.transport import TransportLimits, UcxxClient
    from r3rdma.transport.auth import coerce_secret
    from r3rdma.transport.frames import REPLY_MAX_HEADER_BYTES, Kind
    from r3rdma.transport.session import client_handshake, recv_header, recv_preamble
    from r3rdma.transport.ucx_env import import_ucxx
    from r3rdma.transport.ucxx_transport import _UcxxConn

    ucxx = import_ucxx()
    secret = coerce_secret(node.token)
    limits = TransportLimits(timeout_s=reply_timeout)
    queue = list(reversed(frames))
    done = asyncio.Event()
    progress = asyncio.Event()  # set every 50 fuzz frames: paces the legit client

    async def open_conn() -> Any:
        ep = await asyncio.wait_for(ucxx.create_endpoint(node.host, node.ucx_port, connect_timeout=reply_timeout),
                                    reply_timeout)
        return _UcxxConn(ep, node.push_url)

    async def reply(conn: Any) -> tuple[str, bool]:
        """('ack'|'error:<Name>'|'closed'|'hang', connection still usable)."""
        try:
            pre = await recv_preamble(conn, reply_timeout, "fuzz reply")
            header = await recv_header(conn, pre, REPLY_MAX_HEADER_BYTES, reply_timeout, "fuzz reply header")
        except TransportError:
            return "closed", False
        except R3TimeoutError:
            return "hang", False
        if pre.kind is Kind.ACK:
            return "ack", True
        if pre.kind is Kind.ERROR:
            name = header.get("error")
            if not (isinstance(name, str) and name in errors.__all__):
                stats.untyped.append(repr(header)[:300])
            return f"error:{name}", not header.get("fatal", True)
        if pre.kind in (Kind.CHALLENGE,):
            return "challenge", False
        stats.untyped.append(f"unexpected reply kind {pre.kind.name}")
        return f"unexpected:{pre.kind.name}", False

    async def send_all(conn: Any, messages: Sequence[bytes]) -> bool:
        try:
            for m in messages:
                await asyncio.wait_for(conn.send(np.frombuffer(m, np.uint8)), reply_timeout)
            return True
        except (R3Error, TimeoutError):
            return False  # the node closed on an earlier message: fine, read its answer

    async def worker() -> None:
        authed: Any = None
        try:
            while queue:
                frame = queue.pop()
                stats.frames += 1
                if stats.frames % 50 == 0:
                    progress.set()
                started = time.perf_counter()
                if frame.auth:
                    if authed is None:
                        authed = await open_conn()
                        await client_handshake(authed, secret, limits)
                    conn = authed
                else:
                    conn = await open_conn()
                try:
                    if frame.wrong_proof:
                        from r3rdma.transport.session import send_message
                        from r3rdma.transport.frames import SUPPORTED_VERSIONS

                        await send_message(conn, 1, Kind.HELLO, {"versions": list(SUPPORTED_VERSIONS),
                                                                 "nonce": secrets.token_bytes(32)}, timeout=reply_timeout)
                        outcome, _ = await reply(conn)
                        if outcome != "challenge":
                            stats.note(frame.label, outcome)
                            continue
                        await send_message(conn, 1, Kind.AUTH, {"proof": secrets.token_bytes(32)}, timeout=reply_timeout)
                    else:
                        await send_all(conn, frame.messages)
                    outcome, usable = await reply(conn)
                    if outcome == "challenge":  # a valid-enough HELLO: not ours to finish
                        outcome = "challenge"
                    stats.note(frame.label, outcome)
                    stats.seconds[frame.label] = stats.seconds.get(frame.label, 0.0) + time.perf_counter() - started
                    if outcome == "hang":
                        stats.hangs += 1
                    if not (frame.auth and frame.keep and usable):
                        await conn.close()
                        if conn is authed:
                            authed = None
                except BaseException:
                    await conn.close()
                    if conn is authed:
                        authed = None
                    raise
        finally:
            if authed is not None:
                await authed.close()

    async def legit() -> None:
        """A well-behaved client pushing throughout: it must never be refused or cut."""
        c = UcxxClient(node.host, node.ucx_port, secret=node.token, limits=TransportLimits(timeout_s=10))
        n = 0
        try:
            while not done.is_set():
                await progress.wait()
                progress.clear()
                rec = make_record("legit", f"l{n}")
                n += 1
                try:
                    await c.push([rec])
                    stats.legit_pushes += 1
                except R3Error as e:
                    stats.legit_failures.append(f"{type(e).__name__}: {e}")
                stats.rss_max = max(stats.rss_max, node.rss())
        finally:
            await c.close()

    legit_task = asyncio.ensure_future(legit())
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        done.set()
        progress.set()
        await legit_task


def fuzz_node(node: NodeProcess, frames: Sequence[FuzzFrame], *, concurrency: int = 8,
              reply_timeout: float = 10.0) -> FuzzStats:
    """Send ``frames`` to ``node`` over ``concurrency`` connections; a legit client pushes alongside."""
    from r3rdma.transport import configure_ucx_env

    configure_ucx_env()
    stats = FuzzStats(rss_start=node.rss())
    stats.rss_max = stats.rss_start
    asyncio.run(_fuzz(node, frames, concurrency, reply_timeout, stats))
    stats.node_crashed = not node.alive
    if not stats.node_crashed:
        stats.rss_end = node.rss()
    return stats


# -- HTTP fuzzer -------------------------------------------------------------------------------

_HTTP_PATHS = [
    "/zarr/{r}/b00000001/c/0/0/0", "/zarr/{r}/zarr.json", "/zarr/zarr.json", "/v1/rollouts", "/v1/rollouts/{r}",
    "/zarr/../../etc/passwd", "/zarr/%2e%2e/%2e%2e/etc/passwd", "/zarr/{r}/..%2f..%2f.r3rdma.lock", "/zarr/.r3rdma.lock",
    "/zarr/{r}/.zarr.json.tmp-1", "/zarr//etc/passwd", "/zarr/{r}/b00000001/c/0/0/0%00", "/zarr/" + "a/" * 20,
    "/v1/rollouts/..", "/v1/rollouts/.r3rdma.lock", "/v1/rollouts/zarr.json", "/v1/rollouts/%2e%2e%2f", "/metrics",
    "/healthz", "/", "/zarr/", "/zarr/{r}/b00000001/../../../x", "/zarr/" + "x" * 5000, "/v1/rollouts/" + "r" * 300,
    "/zarr/{r}/b00000001/c/0/0/0?x=../../", "/zarr/\\..\\..\\etc", "/zarr/~root", "/zarr/{r}/%ff%fe",
]
_RANGES = ["bytes=0-0", "bytes=-1", "bytes=5-", "bytes=10-5", "bytes=-0", "bytes=0-99999999999999999999",
           "bytes=abc", "bytes=1-2,3-4", "bytes=", "items=0-1", "bytes=--1", "bytes=-99999999999", "bytes=1-1-1"]


async def _http_one(host: str, port: int, request: bytes, timeout: float) -> int:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(request)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        parts = line.split()
        status = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else -1
        await asyncio.wait_for(reader.read(), timeout)  # Connection: close: read to EOF
        return status
    finally:
        writer.close()


async def _fuzz_http(node: NodeProcess, rng: random.Random, n: int, rollout: str, concurrency: int) -> dict[str, Any]:
    statuses: dict[int, int] = {}
    failures: list[str] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        path = rng.choice(_HTTP_PATHS).replace("{r}", rollout)
        if rng.random() < 0.3:
            path = path[: rng.randrange(1, len(path) + 1)]
        if rng.random() < 0.1:
            path = "/" + "".join(chr(rng.randrange(33, 127)) for _ in range(rng.randrange(1, 40)))
        method = rng.choice(["GET", "GET", "GET", "HEAD", "POST", "PUT", "OPTIONS", "DELETE", "TRACE"])
        who = rng.choice(["right", "right", "none", "wrong", "garbage", "secret", "other"])
        headers = [f"Host: {node.host}", "Connection: close"]
        reading = method in ("GET", "HEAD")
        if who == "right":  # the token for this method: read for GET/HEAD, admin otherwise
            headers.append(f"Authorization: Bearer {node.read_token if reading else node.admin_token}")
        elif who == "other":  # a valid token for the other kind of request: 403
            headers.append(f"Authorization: Bearer {node.admin_token if reading else node.read_token}")
        elif who == "secret":  # the push secret is never an HTTP credential
            headers.append(f"Authorization: Bearer {node.token}")
        elif who == "wrong":
            headers.append(f"Authorization: Bearer {new_token()}")
        elif who == "garbage":
            headers.append("Authorization: " + rng.choice(["Basic Zm9vOmJhcg==", "Bearer", "", "Bearer " + "x" * 9000]))
        if rng.random() < 0.5:
            headers.append("Range: " + rng.choice(_RANGES))
        if method == "DELETE" and who == "right":
            # Never the rollout under test; deletes of garbage ids must be refused or not found.
            path = rng.choice(["/v1/rollouts/nope-" + str(i), "/v1/rollouts/..", "/v1/rollouts/.r3rdma.lock",
                               "/v1/rollouts?older_than_s=abc", "/v1/rollouts?older_than_s=-1",
                               "/v1/rollouts?older_than_s=nan", "/v1/rollouts"])
        raw = f"{method} {path} HTTP/1.1\r\n" + "\r\n".join(headers) + "\r\n\r\n"
        async with sem:
            try:
                status = await _http_one(node.host, node.http_port, raw.encode("latin-1", "replace"), 10)
            except (OSError, asyncio.TimeoutError) as e:
                failures.append(f"{method} {path[:80]}: {type(e).__name__}: {e}")
                return
        statuses[status] = statuses.get(status, 0) + 1
        if status >= 500 or status < 0:
            failures.append(f"{method} {path[:80]} ({who}): HTTP {status}")
        if who != "right" and path.split("?")[0] != "/healthz" and 200 <= status < 300:
            failures.append(f"{method} {path[:80]} ({who}): HTTP {status} without the token")
        where = path.split("?")[0]
        if 200 <= status < 300 and (".." in where or "%2e" in where.lower() or ".r3rdma" in where or ".zarr.json.tmp" in where):
            failures.append(f"{method} {path[:80]}: HTTP {status} for a path outside the store's names")

    await asyncio.gather(*(one(i) for i in range(n)))
    return {"requests": n, "statuses": {str(k): v for k, v in sorted(statuses.items())}, "failures": failures}


def fuzz_http(node: NodeProcess, n: int = 2000, *, seed: int = 0, rollout: str = "legit", concurrency: int = 16) -> dict[str, Any]:
    """``n`` raw HTTP requests with bad paths, ranges, methods and tokens; no 5xx, no leak."""
    out = asyncio.run(_fuzz_http(node, random.Random(seed), n, rollout, concurrency))
    out["node_crashed"] = not node.alive
    return out


# -- disk full ---------------------------------------------------------------------------------


def disk_full(work: Path, *, limit: int = 256 << 10) -> dict[str, Any]:
    """A node under ``RLIMIT_FSIZE=limit``: an oversized batch fails cleanly, the node recovers."""
    from r3rdma.errors import StoreError
    from r3rdma.read.reader import RoutingReader
    from r3rdma.write.push_client import StoreNodesClient
    from r3rdma.transport import TransportLimits

    work = Path(work)
    root = work / "full"
    token = new_token()
    small = [make_record("df", f"small-{i}") for i in range(5)]
    # Incompressible and larger than the limit: its shard file cannot be written.
    big = make_record("df", "big", rows=(limit // (LAYERS * TOP_K)) * 2)
    big2 = make_record("df2", "big", rows=(limit // (LAYERS * TOP_K)) * 2)
    out: dict[str, Any] = {"limit_bytes": limit}
    limits = TransportLimits(timeout_s=10)
    node = spawn_node(root, token, fsize_limit=limit)
    try:
        with StoreNodesClient([node.push_url], secret=token, limits=limits) as client:
            client.commit(small)
            for rec in (big, big2):  # big2: a rollout whose very first batch fails
                try:
                    client.commit([rec])
                    out["error"] = None
                except StoreError as e:
                    out["error"] = f"{type(e).__name__}: {e}"
            visible = _visible([root])
            out["big_visible"] = "big" in visible.get("df", {}) or "big" in visible.get("df2", {})
            out["orphans"] = _orphans(root)
            out["temp_files"] = sum(1 for p in root.rglob(".*tmp*"))
            client.commit([make_record("df", "after-full")])  # keeps serving small batches
            out["served_after_full"] = True
    finally:
        node.stop()
    node = spawn_node(root, token)  # space is back
    try:
        with StoreNodesClient([node.push_url], secret=token, limits=limits) as client:
            client.commit([big, big2])
        with RoutingReader(str(root)) as reader:
            got = reader.get_numpy("df", [r.request_id for r in small] + ["big", "after-full"])
            out["intact_after_restart"] = all(np.array_equal(got[r.request_id], r.ids_TLK) for r in small + [big])
            out["intact_after_restart"] &= np.array_equal(reader.get_numpy("df2", ["big"])["big"], big2.ids_TLK)
    finally:
        node.stop()
    return out


# -- load --------------------------------------------------------------------------------------


async def _load(nodes: list[NodeProcess], clients: int, duration_s: float, batch: int, seed: int,
                timeout_s: float) -> dict[str, Any]:
    from r3rdma.errors import R3Error
    from r3rdma.transport import TransportLimits, UcxxClient

    limits = TransportLimits(timeout_s=timeout_s, ack_timeout_s=4 * timeout_s)
    latencies: list[float] = []
    acked: dict[tuple[str, str], int] = {}
    failures: list[str] = []
    nbytes = 0
    rss_max = [0] * len(nodes)
    deadline = time.monotonic() + duration_s

    async def client(p: int) -> None:
        rng = random.Random(seed * 1000 + p)
        conns = [UcxxClient(n.host, n.ucx_port, secret=n.token, limits=limits) for n in nodes]
        k = 0
        try:
            while time.monotonic() < deadline:
                recs = [make_record(f"load-{p % 4}", f"p{p}-{k + j}", rows=rng.randint(64, 1024)) for j in range(batch)]
                k += batch
                groups: dict[int, list[Any]] = {}
                for r in recs:
                    groups.setdefault(_owner(f"{r.rollout_id}/{r.request_id}", len(nodes)), []).append(r)

                async def push(i: int, group: list[Any]) -> None:
                    nonlocal nbytes
                    t0 = time.perf_counter()
                    try:
                        await conns[i].push(group)
                    except R3Error as e:
                        failures.append(f"{type(e).__name__}: {e}")
                        return
                    latencies.append(time.perf_counter() - t0)
                    nbytes += sum(r.nbytes for r in group)
                    for r in group:
                        acked[(r.rollout_id, r.request_id)] = r.crc32c

                await asyncio.gather(*(push(i, g) for i, g in groups.items()))
                for i, n in enumerate(nodes):
                    rss_max[i] = max(rss_max[i], n.rss())
        finally:
            for c in conns:
                await c.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(p) for p in range(clients)))
    seconds = time.perf_counter() - t0
    lat = np.array(latencies) if latencies else np.zeros(1)
    return {
        "clients": clients, "seconds": round(seconds, 2), "pushes": len(latencies), "requests": len(acked),
        "bytes": nbytes, "throughput_mb_s": round(nbytes / seconds / 1e6, 2),
        "requests_per_s": round(len(acked) / seconds, 1),
        "ack_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 2),
        "ack_p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 2),
        "push_failures": failures[:10], "push_failure_count": len(failures),
        "_acked": acked, "rss_sampled_max": rss_max,
    }


def load(work: Path, *, clients: int = 32, duration_s: float = 60.0, batch: int = 32, inflight_mb: int = 64,
         seed: int = 0, timeout_s: float = 30.0, verify_bytes: bool = False) -> dict[str, Any]:
    """``clients`` clients push for ``duration_s`` to two nodes with ``--max-inflight-mb inflight_mb``."""
    from r3rdma.transport import configure_ucx_env

    configure_ucx_env()
    work = Path(work)
    token = new_token()
    roots = [work / "load-a", work / "load-b"]
    nodes = [spawn_node(r, token, "--max-inflight-mb", str(inflight_mb)) for r in roots]
    try:
        base = [n.rss() for n in nodes]
        out = asyncio.run(_load(nodes, clients, duration_s, batch, seed, timeout_s))
        peaks = [n.peak_rss() for n in nodes]
    finally:
        for n in nodes:
            n.stop()
    acked = out.pop("_acked")
    # Load records have random lengths: read back with CRC verification, compare CRCs with
    # what was acknowledged (bit-exact up to CRC-32C).
    check = _verify(roots, acked, set(acked), read_bytes=verify_bytes, exact=False)
    out.update({
        "acked_lost": check["lost"], "corrupt": check["corrupt"], "phantom": check["phantom"],
        "inflight_budget_mb": inflight_mb,
        "node_rss_base_mb": [round(b / 2**20, 1) for b in base],
        "node_rss_peak_mb": [round(p / 2**20, 1) for p in peaks],
        "node_rss_growth_mb": max(round((p - b) / 2**20, 1) for p, b in zip(peaks, base)),
    })
    out.pop("rss_sampled_max", None)
    return out


# -- auth / token hygiene ----------------------------------------------------------------------


def token_leaks(node: NodeProcess, *others: str) -> list[str]:
    """Places the node's secret, its HTTP tokens (or ``others``) appear in its log or its stdout."""
    text = node.log.read_text(errors="replace")
    return [t[:8] + "..." for t in (node.token, node.read_token, node.admin_token, *others) if t and t in text]


# -- issue 19: replicas, bad records, multi-turn, restarts, stalled senders --------------------


def free_port() -> int:
    """A TCP port free right now (for nodes started on fixed ports)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def unchecked_record(rollout_id: str, request_id: str, ids: np.ndarray, *, num_experts: int = EXPERTS,
                     start_row: int = 0, crc32c: int = 0) -> Any:
    """A RequestRecord built around its validation (what a buggy or foreign producer could hand over)."""
    from dataclasses import fields

    from r3rdma.records import RequestRecord

    record = object.__new__(RequestRecord)
    values = {"rollout_id": rollout_id, "request_id": request_id, "ids_TLK": ids, "layer_map": tuple(range(ids.shape[1])),
              "num_experts": num_experts, "start_row": start_row, "crc32c": crc32c, "final": True, "total_rows": None}
    for f in fields(RequestRecord):
        object.__setattr__(record, f.name, values[f.name])
    return record


def _http_reader(nodes: Sequence[NodeProcess]) -> Any:
    from r3rdma.read.reader import RoutingReader

    return RoutingReader([n.http_url for n in nodes], token=nodes[0].read_token, timeout_s=10)


def _spawn_many(roots: Sequence[Path], token: str, *extra: str) -> list[NodeProcess]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(roots)) as pool:  # each start waits for the node's ready line
        return list(pool.map(lambda r: spawn_node(r, token, *extra), roots))


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
    nodes = _spawn_many([work / f"replica-{i}" for i in range(3)], token)
    recs = [make_record("lost", f"q{i}") for i in range(requests)]
    out: dict[str, Any] = {"nodes": 3, "replicas": 2, "requests": requests}
    try:
        with StoreNodesClient([n.push_url for n in nodes], secret=token, replicas=2,
                              limits=TransportLimits(timeout_s=timeout_s)) as client:
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
    import torch

    from r3rdma.capture.capturer import RoutingCapturer
    from r3rdma.errors import R3Error
    from r3rdma.read.reader import RoutingReader
    from r3rdma.records import RequestRecord
    from r3rdma.store.local_store import LocalRoutingStore
    from r3rdma.transport import TransportLimits, configure_ucx_env
    from r3rdma.write.push_client import StoreNodesClient
    from r3rdma.write.writer import RoutingWriter

    configure_ucx_env()
    work = Path(work)
    tried: list[str] = []
    refused: list[str] = []
    accepted: list[str] = []  # bad records that got through (must stay empty)

    def offer(label: str, fn: Callable[[], Any]) -> None:
        tried.append(label)
        try:
            fn()
        except R3Error:
            refused.append(label)
            return
        accepted.append(label)

    # -- capturer: start_row past the rows, router ids the uint8 dtype cannot hold
    class Sink:
        def __init__(self) -> None:
            self.records: list[Any] = []

        def submit(self, record: Any) -> None:
            self.records.append(record)

    layer_map, k, experts = (0, 2, 5), 2, 16
    sink = Sink()
    cap = RoutingCapturer(layer_map=layer_map, top_k=k, num_experts=experts, num_slots=64, sink=sink,
                          rollout_id="bad", check_ids=True)

    def step(rid: str, slots: list[int], bad_id: int | None = None) -> None:
        n = len(slots)
        ids = np.arange(n * len(layer_map) * k).reshape(n, len(layer_map), k) % experts
        if bad_id is not None:
            ids[n // 2, 1, 0] = bad_id
        cap.begin_step([rid], [0], [n], slots)
        for l, layer in enumerate(layer_map):
            cap.record(layer, torch.as_tensor(ids[:, l]))
        cap.end_step()

    step("past", [0, 1, 2, 3])
    offer("capturer: start_row past the rows", lambda: cap.finish_request("past", prompt_len=3, generated_len=1, start_row=4))
    step("wide", [4, 5, 6], bad_id=300)  # e.g. an EPLB physical id: would wrap to 44 in uint8
    offer("capturer: router id out of the dtype's range", lambda: cap.finish_request("wide", prompt_len=2, generated_len=1))
    step("neg", [7, 8], bad_id=-1)
    offer("capturer: negative router id", lambda: cap.finish_request("neg", prompt_len=1, generated_len=1))
    step("fine", [9, 10, 11])
    cap.finish_request("fine", prompt_len=2, generated_len=1)
    capturer_good = [r.request_id for r in sink.records] == ["fine"]

    # -- RequestRecord
    lm = tuple(range(LAYERS))
    offer("RequestRecord: 0 rows", lambda: RequestRecord("bad", "z", np.zeros((0, LAYERS, TOP_K), np.uint8), lm, EXPERTS))
    offer("RequestRecord: ids wider than the storage dtype", lambda: RequestRecord(
        "bad", "w", np.full((3, LAYERS, TOP_K), 300, np.int64), lm, EXPERTS))
    offer("RequestRecord: layer_map of another length", lambda: RequestRecord(
        "bad", "l", np.zeros((3, LAYERS, TOP_K), np.uint8), lm[:-1], EXPERTS))
    offer("RequestRecord: negative start_row", lambda: RequestRecord(
        "bad", "s", np.zeros((3, LAYERS, TOP_K), np.uint8), lm, EXPERTS, start_row=-1))

    def zero(rid: str) -> Any:
        return unchecked_record("bad", rid, np.zeros((0, LAYERS, TOP_K), np.uint8), start_row=50)

    good: list[Any] = []

    def through_writer(store: Any, bads: list[Any], prefix: str) -> None:
        """Submit good and bad records interleaved in one batch; check what the writer says."""
        writer = RoutingWriter(store, flush_bytes=1 << 30, flush_interval_s=3600)
        try:
            offer(f"{prefix} writer.submit: 0 rows", lambda: writer.submit(zero(f"{prefix}-zero")))
            mine = [make_record("bad", f"{prefix}-good{i}") for i in range(len(bads) + 1)]
            for g, b in zip(mine, bads + [None]):
                writer.submit(g)
                if b is not None:
                    writer.submit(b)
            good.extend(mine)
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
            tried.append(f"{prefix} batch: {b.request_id}")
            (refused if (b.rollout_id, b.request_id) in failed else accepted).append(f"{prefix} batch: {b.request_id}")

    def conflicting(rid: str) -> Any:
        return make_record("bad", rid, variant=1)

    # -- the store itself, and the writer over it
    local_root = work / "bad-local"
    with LocalRoutingStore(local_root) as store:
        store.commit([make_record("bad", "dup-local")])
        offer("LocalRoutingStore.commit: 0 rows in a batch", lambda: store.commit(
            [make_record("bad", "local-batch-good"), zero("local-zero")]))
        offer("LocalRoutingStore.commit: other geometry in a batch", lambda: store.commit(
            [make_record("bad", "local-batch-good"), unchecked_record("bad", "local-geo", np.ones((3, LAYERS - 1, TOP_K), np.uint8))]))
        through_writer(store, [conflicting("dup-local"), unchecked_record(
            "bad", "local-geo2", np.ones((3, LAYERS - 1, TOP_K), np.uint8))], "local")
    # -- a store node, through StoreNodesClient and a writer over it
    token = new_token()
    node = spawn_node(work / "bad-node", token)
    try:
        with StoreNodesClient([node.push_url], secret=token, limits=TransportLimits(timeout_s=timeout_s)) as client:
            client.commit([make_record("bad", "dup-node")])
            offer("node: 0 rows in a batch", lambda: client.commit([make_record("bad", "node-batch-good"), zero("node-zero")]))
            offer("node: wrong sender checksum in a batch", lambda: client.commit(
                [make_record("bad", "node-batch-good"), unchecked_record("bad", "node-crc", np.ones((3, LAYERS, TOP_K), np.uint8))]))
            bad_crc = unchecked_record("bad", "node-crc2", np.ones((3, LAYERS, TOP_K), np.uint8))
            through_writer(client, [conflicting("dup-node"), bad_crc], "node")
        visible_node = _visible([node.root]).get("bad", {})
    finally:
        node.stop()
    visible_local = _visible([local_root]).get("bad", {})
    # Nothing of a refused record is stored anywhere; every good record is, bit-exact.
    leaked = [rid for rid in list(visible_node) + list(visible_local)
              if rid.endswith(("zero", "geo", "geo2", "crc", "crc2", "batch-good"))]
    stored = 0
    for root, prefix in ((local_root, "local"), (work / "bad-node", "node")):
        mine = [g for g in good if g.request_id.startswith(prefix)]
        got = RoutingReader(str(root)).get_numpy("bad", [g.request_id for g in mine])
        stored += sum(np.array_equal(got[g.request_id], g.ids_TLK) for g in mine)
    dups_intact = (visible_local.get("dup-local") == make_record("bad", "dup-local").crc32c
                   and visible_node.get("dup-node") == make_record("bad", "dup-node").crc32c)
    # A refusal that left something stored is no refusal.
    return {"tried": len(tried), "refused": len(refused) - len(leaked), "accepted": accepted, "leaked": leaked,
            "good_total": len(good) + 1, "good_stored": stored + int(capturer_good), "duplicates_intact": bool(dups_intact)}


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
        for cid, (whole, parts) in convs.items():
            try:
                got = reader.get_numpy("mt", [cid])[cid]
            except (KeyError, ValueError):
                continue
            n += sum(1 for p in parts if len(got) >= p.start_row + len(p.ids_TLK) and np.array_equal(
                got[p.start_row : p.start_row + len(p.ids_TLK)], p.ids_TLK))
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
    meta = RecordMeta("stall", f"s{secrets.token_hex(4)}", rows, LAYERS, TOP_K, "uint8", EXPERTS,
                      tuple(range(LAYERS)), 0, 0x1234 if with_crc else None, 0)
    header = msgpack.packb(batch_header(1, [meta.to_wire()], [meta.nbytes]))
    ucxx = import_ucxx()
    ep = await ucxx.create_endpoint(node.host, node.ucx_port, connect_timeout=10)
    conn = _UcxxConn(ep, "staller")
    version = await client_handshake(conn, coerce_secret(node.token), TransportLimits(timeout_s=10))
    for m in _message(int(Kind.BATCH), header, [], payload_len=meta.nbytes):
        await conn.send(np.frombuffer(m, np.uint8))
    return conn, version


async def stall_while_pushing(node: NodeProcess, record: Any, *, connections: int, payload_mb: int
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


def stalled_announce(work: Path, *, connections: int = 6, payload_mb: int = 255, inflight_mb: int = 1024,
                     node_timeout_s: float = 3.0) -> dict[str, Any]:
    """``connections`` authenticated connections each announce a ``payload_mb`` MiB batch and
    send nothing while a normal client pushes; node peak RSS growth, and how each staller ends."""
    from r3rdma.errors import R3TimeoutError
    from r3rdma.transport import configure_ucx_env

    configure_ucx_env()
    node = spawn_node(Path(work) / "stall", new_token(), "--max-payload-mb", str(payload_mb + 1),
                      "--timeout-s", str(node_timeout_s), "--max-inflight-mb", str(inflight_mb))
    try:
        base = node.rss()

        run = stall_while_pushing(node, make_record("stall", "normal"), connections=connections, payload_mb=payload_mb)
        _, pushed, outcomes = asyncio.run(asyncio.wait_for(run, 120))
        growth = node.peak_rss() - base
        return {"connections": connections, "announced_mb": connections * payload_mb,
                "peak_rss_growth_mb": round(growth / 2**20, 1), "pushed_while_stalled": pushed,
                "typed_timeouts": sum(isinstance(o, R3TimeoutError) and o.fatal for o in outcomes),
                "alive": node.alive}
    finally:
        node.kill()


def replicas_ingest_ratio(work: Path, *, rounds: int = 5, requests: int = 64, rows: int = 2048,
                          timeout_s: float = 30.0) -> dict[str, Any]:
    """Ingest MB/s of the same records to the same three nodes with ``replicas=2`` and
    ``replicas=1``, rounds interleaved (r1, r2, r2, r1, ...), median of each; ratio r2 / r1.
    MB/s counts each request once (bytes durable per second), not each copy."""
    from r3rdma.records import RequestRecord
    from r3rdma.transport import TransportLimits, configure_ucx_env
    from r3rdma.write.push_client import StoreNodesClient

    configure_ucx_env()
    token = new_token()
    nodes = _spawn_many([Path(work) / f"ingest-{i}" for i in range(3)], token)
    base = [make_record("ingest", f"q{i}", rows=rows).ids_TLK for i in range(requests)]
    nbytes = sum(a.nbytes for a in base)
    mb_s: dict[int, list[float]] = {1: [], 2: []}
    try:
        clients = {r: StoreNodesClient([n.push_url for n in nodes], secret=token, replicas=r,
                                       limits=TransportLimits(timeout_s=timeout_s)) for r in (1, 2)}
        try:
            for i in range(-1, rounds):  # round -1: warm-up (connections, first index), not counted
                for r in ((1, 2) if i % 2 == 0 else (2, 1)):
                    # Same bytes each round, fresh ids (a re-push of stored ids would be a no-op).
                    recs = [RequestRecord(f"ingest-r{r}-{i + 1}", f"q{j}", a, tuple(range(LAYERS)), EXPERTS)
                            for j, a in enumerate(base)]
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
    return {"rounds": rounds, "mb_per_round": round(nbytes / 1e6, 2), "r1_mb_s": round(med[1], 2),
            "r2_mb_s": round(med[2], 2), "ratio": round(med[2] / med[1], 3),
            "r1_all": [round(x, 2) for x in mb_s[1]], "r2_all": [round(x, 2) for x in mb_s[2]]}


def issue19(work: Path, *, quick: bool = False, seed: int = 0, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The issue-19 figures of the bench's JSON (``quick``: smaller sizes, well under a minute)."""
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
    stall = stalled_announce(work / "stall", connections=3 if quick else 6, payload_mb=64 if quick else 255,
                             inflight_mb=256 if quick else 1024, node_timeout_s=2 if quick else 3)
    log(f"stalled: {stall}")
    ingest = replicas_ingest_ratio(work / "ingest", rounds=3 if quick else 7, requests=16 if quick else 64)
    log(f"replicas ingest: {ingest}")
    out.update({
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
    })
    return out


# -- CLI -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kill-cycles", type=int, default=20)
    parser.add_argument("--crash-clients", type=int, default=6)
    parser.add_argument("--frames", type=int, default=10000, help="protocol messages to fuzz")
    parser.add_argument("--http-requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=32, help="load: concurrent pushing clients")
    parser.add_argument("--duration-s", type=float, default=60.0, help="load: seconds")
    parser.add_argument("--inflight-mb", type=int, default=64, help="load: each node's --max-inflight-mb")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes for the issue-19 parts (replicas, bad records, multi-turn, restart, "
                             "stalled senders, replicas ingest ratio): under a minute; the other parts take "
                             "their own options above")


def main(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="r3-reliability-", dir=args.workdir) as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        crash = crash_cycles(work / "crash", args.kill_cycles, clients=args.crash_clients, seed=args.seed, log=log)
        log(f"crash: {crash}")
        node = spawn_node(work / "fuzz" / "root", new_token(), "--max-payload-mb", "8", "--timeout-s", "1")
        try:
            rng = random.Random(args.seed)
            frames = [gen_frame(rng, i) for i in range(args.frames)]
            fz = fuzz_node(node, frames)
            log(f"fuzz: {fz.frames} frames, outcomes {fz.outcomes}")
            http = fuzz_http(node, args.http_requests, seed=args.seed)
            leaks = token_leaks(node)
        finally:
            node.kill()
        full = disk_full(work / "disk")
        log(f"disk full: {full}")
        ld = load(work / "load", clients=args.clients, duration_s=args.duration_s, inflight_mb=args.inflight_mb,
                  seed=args.seed)
        log(f"load: {ld}")
        i19 = issue19(work / "issue19", quick=args.quick, seed=args.seed, log=log)
    result = {
        "bench": "reliability",
        "kill_cycles": crash["kill_cycles"],
        "acked_before_kills": crash["acked_total"],
        "unacked_retried": crash["unacked_retried"],
        "acknowledged_lost": crash["acked_lost"] + ld["acked_lost"],
        "partial_or_corrupt_visible": crash["phantom"] + crash["corrupt"] + ld["corrupt"] + ld["phantom"],
        "frames_fuzzed": fz.frames,
        "fuzz_untyped_replies": len(fz.untyped),
        "fuzz_hangs": fz.hangs,
        "fuzz_legit_pushes": fz.legit_pushes,
        "fuzz_legit_failures": len(fz.legit_failures),
        "fuzz_node_rss_growth_mb": round((fz.rss_max - fz.rss_start) / 2**20, 1),
        "http_requests_fuzzed": http["requests"],
        "http_failures": len(http["failures"]),
        "crashes": int(fz.node_crashed) + int(http["node_crashed"]),
        "token_leaks": len(leaks),
        "disk_full_clear_error": bool(full.get("error")) and not full["big_visible"] and full["orphans"] == 0,
        "disk_full_recovered": bool(full.get("intact_after_restart")),
        "clients": ld["clients"],
        "load_seconds": ld["seconds"],
        "throughput_mb_s": ld["throughput_mb_s"],
        "requests_per_s": ld["requests_per_s"],
        "ack_p50_ms": ld["ack_p50_ms"],
        "ack_p99_ms": ld["ack_p99_ms"],
        "load_push_failures": ld["push_failure_count"],
        "inflight_budget_mb": ld["inflight_budget_mb"],
        "node_rss_growth_mb": ld["node_rss_growth_mb"],
        **i19,
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result))
    return 0
