"""Fuzzers against a live store node: :func:`gen_frame` / :func:`fuzz_node` (malformed,
truncated, oversized and out-of-order protocol messages, before and after authentication, while a
well-behaved client keeps pushing) and :func:`fuzz_http` (raw HTTP: bad paths, traversal, ranges,
methods, tokens)."""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3rdma.records import buffer_checksum
from r3rdma.store.process import NodeProcess, new_token
from r3rdma.testing.harness import make_record

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

    return struct.pack("<2sBBIQ", b"R3", version & 0xFF, kind & 0xFF, header_len & 0xFFFFFFFF, payload_len & 0xFFFFFFFFFFFFFFFF)


def _message(
    kind: int,
    header: bytes,
    frames: Sequence[bytes] = (),
    *,
    version: int = 1,
    header_len: int | None = None,
    payload_len: int | None = None,
) -> list[bytes]:
    from r3rdma.transport.frames import INLINE_HEADER_BYTES

    hl = len(header) if header_len is None else header_len
    pl = sum(len(f) for f in frames) if payload_len is None else payload_len
    pre = _preamble(version, kind, hl, pl)
    head = [pre + header] if len(header) <= INLINE_HEADER_BYTES else [pre, header]
    return head + [f for f in frames if f]


_WEIRD_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    1,
    2**31,
    2**63 - 1,
    -(2**63),
    1.5,
    float("nan"),
    "",
    "x" * 300,
    b"",
    b"\x00" * 40,
    [],
    [1, 2],
    {},
    {"a": 1},
    "../etc",
    "a/b",
    "..",
    ".r3rdma.lock",
    "zarr.json",
    "\u00e9",
    "roll\x00",
]


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
    # no write (a durable commit's fsync would dominate the run: BENCHMARKS.md, Reliability).
    rid = f"f{n}-{rng.randrange(1 << 30)}" if rng.random() < 0.2 else f"dup{rng.randrange(16)}"
    # -- before authentication (a new connection each) -- 30 %
    if r < 0.06:
        size = rng.choice([1, 5, 15, 16, 17, 100, 4096, 4097, 9000])
        return FuzzFrame("garbage", [rng.randbytes(size)], auth=False)
    if r < 0.12:
        pre = _preamble(
            rng.choice([0, 1, 2, 255]),
            rng.choice([0, 1, 3, 5, 6, 7, 8, 255]),
            rng.choice([0, 1, 1024, 1025, 2**32 - 1, rng.randrange(2**32)]),
            rng.choice([0, 1, 2**63, 2**64 - 1, rng.randrange(2**64)]),
        )
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
        return FuzzFrame(label, _message(BATCH, pack(header), [bytes(data)], payload_len=len(payload)), auth=True, keep=True)
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
    """What a fuzz run against one node saw: frames sent, replies counted per ``label:outcome``, worker
    seconds per label, untyped replies, hangs, the legit client's pushes and failures, node RSS in bytes."""

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
        """Count one reply ``outcome`` (e.g. ``ack``, ``error:ProtocolError``, ``hang``) to a frame of kind ``label``."""
        key = f"{label}:{outcome}"
        self.outcomes[key] = self.outcomes.get(key, 0) + 1


async def _fuzz(node: NodeProcess, frames: Sequence[FuzzFrame], concurrency: int, reply_timeout: float, stats: FuzzStats) -> None:
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
        ep = await asyncio.wait_for(ucxx.create_endpoint(node.host, node.ucx_port, connect_timeout=reply_timeout), reply_timeout)
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
                        from r3rdma.transport.frames import SUPPORTED_VERSIONS
                        from r3rdma.transport.session import send_message

                        await send_message(
                            conn,
                            1,
                            Kind.HELLO,
                            {"versions": list(SUPPORTED_VERSIONS), "nonce": secrets.token_bytes(32)},
                            timeout=reply_timeout,
                        )
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


def fuzz_node(node: NodeProcess, frames: Sequence[FuzzFrame], *, concurrency: int = 8, reply_timeout: float = 10.0) -> FuzzStats:
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
    "/zarr/{r}/b00000001/c/0/0/0",
    "/zarr/{r}/zarr.json",
    "/zarr/zarr.json",
    "/v1/rollouts",
    "/v1/rollouts/{r}",
    "/zarr/../../etc/passwd",
    "/zarr/%2e%2e/%2e%2e/etc/passwd",
    "/zarr/{r}/..%2f..%2f.r3rdma.lock",
    "/zarr/.r3rdma.lock",
    "/zarr/{r}/.zarr.json.tmp-1",
    "/zarr//etc/passwd",
    "/zarr/{r}/b00000001/c/0/0/0%00",
    "/zarr/" + "a/" * 20,
    "/v1/rollouts/..",
    "/v1/rollouts/.r3rdma.lock",
    "/v1/rollouts/zarr.json",
    "/v1/rollouts/%2e%2e%2f",
    "/metrics",
    "/healthz",
    "/",
    "/zarr/",
    "/zarr/{r}/b00000001/../../../x",
    "/zarr/" + "x" * 5000,
    "/v1/rollouts/" + "r" * 300,
    "/zarr/{r}/b00000001/c/0/0/0?x=../../",
    "/zarr/\\..\\..\\etc",
    "/zarr/~root",
    "/zarr/{r}/%ff%fe",
]
_RANGES = [
    "bytes=0-0",
    "bytes=-1",
    "bytes=5-",
    "bytes=10-5",
    "bytes=-0",
    "bytes=0-99999999999999999999",
    "bytes=abc",
    "bytes=1-2,3-4",
    "bytes=",
    "items=0-1",
    "bytes=--1",
    "bytes=-99999999999",
    "bytes=1-1-1",
]


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
            path = rng.choice(
                [
                    "/v1/rollouts/nope-" + str(i),
                    "/v1/rollouts/..",
                    "/v1/rollouts/.r3rdma.lock",
                    "/v1/rollouts?older_than_s=abc",
                    "/v1/rollouts?older_than_s=-1",
                    "/v1/rollouts?older_than_s=nan",
                    "/v1/rollouts",
                ]
            )
        raw = f"{method} {path} HTTP/1.1\r\n" + "\r\n".join(headers) + "\r\n\r\n"
        async with sem:
            try:
                status = await _http_one(node.host, node.http_port, raw.encode("latin-1", "replace"), 10)
            except (TimeoutError, OSError) as e:
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


def fuzz_http(
    node: NodeProcess, n: int = 2000, *, seed: int = 0, rollout: str = "legit", concurrency: int = 16
) -> dict[str, Any]:
    """``n`` raw HTTP requests with bad paths, ranges, methods and tokens; no 5xx, no leak."""
    out = asyncio.run(_fuzz_http(node, random.Random(seed), n, rollout, concurrency))
    out["node_crashed"] = not node.alive
    return out
