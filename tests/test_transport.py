"""Conformance suite of r3rdma.transport: loopback (in-process) and UCXX (server in another
process, talking over loopback TCP/shared memory) must pass the same tests."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import numpy as np
import pytest

from r3rdma.errors import (
    AuthenticationError,
    CorruptDataError,
    DuplicateRequestError,
    ProtocolError,
    R3TimeoutError,
    StoreError,
    TransportError,
)
from r3rdma.records import RequestRecord
from r3rdma.transport import PackedBatch, RecordMeta, TransportLimits
from r3rdma.transport.frames import Kind
from r3rdma.transport.session import recv_header, recv_preamble, send_message
from r3rdma.transport.testing import LoopbackHarness, UcxxProcessHarness

pytestmark = pytest.mark.timeout(60)

SECRET = b"conformance-secret-0123456789abcdef"
# Small limits so that the refusal tests stay fast; identical for both implementations.
SERVER_LIMITS = TransportLimits(
    max_header_bytes=64 << 10,
    max_payload_bytes=4 << 20,
    max_records=4096,
    timeout_s=5.0,
    handler_timeout_s=10.0,
    ack_timeout_s=15.0,
    idle_timeout_s=60.0,
)
CLIENT_LIMITS = TransportLimits(max_header_bytes=16 << 20, max_payload_bytes=64 << 20, timeout_s=5.0, ack_timeout_s=15.0)
_rollouts = itertools.count()


def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def rollout(prefix: str = "roll") -> str:
    return f"{prefix}-{next(_rollouts)}"


def make(rollout_id: str, request_id: str, rows: int = 7, *, layers: int = 3, k: int = 2, num_experts: int = 128,
         seed: int = 0, start_row: int = 0) -> RequestRecord:
    rng = np.random.default_rng(seed)
    dtype = np.uint8 if num_experts <= 256 else (np.uint16 if num_experts <= 65536 else np.int32)
    ids = rng.integers(0, num_experts, size=(rows, layers, k)).astype(dtype)
    return RequestRecord(rollout_id, request_id, ids, tuple(range(1, 2 * layers, 2)), num_experts, start_row=start_row)


def assert_same(sent: list[RequestRecord], got) -> None:
    assert [g.request_id for g in got] == [s.request_id for s in sent]
    for s, g in zip(sent, got):
        assert g.ids_TLK.dtype == s.ids_TLK.dtype
        assert g.ids_TLK.shape == s.ids_TLK.shape
        assert g.ids_TLK.tobytes() == s.ids_TLK.tobytes()
        assert (g.rollout_id, g.layer_map, g.num_experts, g.start_row, g.crc32c) == (
            s.rollout_id, s.layer_map, s.num_experts, s.start_row, s.crc32c)
        assert (g.final, g.total_rows) == (s.final, s.total_rows)


@pytest.fixture(scope="module")
def ucxx_harness():
    h = UcxxProcessHarness(SECRET, SERVER_LIMITS)
    h.spawn()
    yield h
    h.kill()


@pytest.fixture(params=["loopback", "ucxx"])
def harness(request):
    if request.param == "loopback":
        return LoopbackHarness(SECRET, SERVER_LIMITS)
    return request.getfixturevalue("ucxx_harness")


class Session:
    """Starts/stops the harness inside the test's event loop and closes clients."""

    def __init__(self, harness):
        self.h = harness
        self.clients = []

    async def __aenter__(self):
        await self.h.start()
        return self

    async def __aexit__(self, *exc):
        for c in self.clients:
            await c.close()
        await self.h.stop()

    async def client(self, secret: bytes = SECRET, limits: TransportLimits = CLIENT_LIMITS, connect: bool = True):
        c = self.h.client(secret, limits)
        self.clients.append(c)
        if connect:
            await c.connect()
        return c


def test_roundtrip_bit_exact_all_dtypes(harness):
    async def main():
        async with Session(harness) as s:
            c = await s.client()
            rid = rollout()
            sent = [
                make(rid, "a.u8", 9, num_experts=256, seed=1),
                make(rid, "b.u16", 5, layers=4, k=8, num_experts=1000, seed=2, start_row=3),
                make(rid, "c.i32", 13, layers=2, k=1, num_experts=70000, seed=3),
                make(rid, "d.one", 1, num_experts=16),
                make(rid, "e:u8", 1, num_experts=8, seed=4),
            ]
            if "final" in RequestRecord.__dataclass_fields__:  # request segments (prefill part, decode tail)
                part = make(rid, "f.part", 4, seed=5)
                sent.append(RequestRecord(rid, "f.part", part.ids_TLK, part.layer_map, 128, final=False))
                sent.append(RequestRecord(rid, "g.tail", part.ids_TLK, part.layer_map, 128, start_row=6, total_rows=10))
            ack = await c.push(sent)
            assert (ack.requests, ack.bytes) == (len(sent), sum(r.nbytes for r in sent))
            kind, _, got = await harness.next_event(rid)
            assert kind == "batch"
            assert_same(sent, got)

    run(main())


def test_large_records_use_zero_copy_frames(harness):
    async def main():
        async with Session(harness) as s:
            c = await s.client()
            rid = rollout()
            sent = [make(rid, "big", 1 << 16, layers=4, k=4, seed=5), make(rid, "small", 3, seed=6),
                    make(rid, "big2", 40000, layers=2, k=8, num_experts=300, seed=7)]
            await c.push(sent)
            _, _, got = await harness.next_event(rid)
            assert_same(sent, got)

    run(main())


def test_ack_only_after_handler_returns(harness):
    async def main():
        async with Session(harness) as s:
            c = await s.client()
            rid = rollout("gate")
            push = asyncio.ensure_future(c.push([make(rid, "r0")]))
            assert (await harness.next_event(rid))[0] == "entered"
            # The handler is blocked inside; the ack is causally after release().
            assert not push.done()
            harness.release()
            ack = await push
            assert ack.requests == 1
            assert (await harness.next_event(rid))[0] == "batch"

    run(main())


def test_wrong_secret_refused(harness):
    async def main():
        async with Session(harness) as s:
            bad = await s.client(b"not-the-secret-0123456789abcdef!", connect=False)
            with pytest.raises(AuthenticationError):
                await bad.connect()
            assert not bad.connected
            # A push on the refused client reconnects, and is refused again.
            with pytest.raises(AuthenticationError):
                await bad.push([make(rollout(), "x")])
            # Nothing reached the handler: the next report is the good client's batch.
            good = await s.client()
            rid = rollout()
            await good.push([make(rid, "ok")])
            assert (await harness.next_event(rid))[0] == "batch"

    run(main())


def test_payload_before_auth_is_refused(harness):
    async def main():
        async with Session(harness) as s:
            c = await s.client(connect=False)
            conn = await c._open()  # raw connection: no hello
            rec = make(rollout(), "sneaky")
            meta = RecordMeta.of(rec, 0).to_wire()
            header = {"seq": 1, "frames": [rec.nbytes], "records": [meta]}
            await send_message(conn, 1, Kind.BATCH, header, [rec.ids_TLK.reshape(-1).view(np.uint8)], timeout=5)
            pre = await recv_preamble(conn, 5, "error")
            reply = await recv_header(conn, pre, 1 << 14, 5, "error")
            assert pre.kind is Kind.ERROR and reply["error"] == "ProtocolError" and reply["fatal"]
            assert "HELLO" in reply["message"]
            with pytest.raises(TransportError):  # the server closed this connection
                await recv_preamble(conn, 5, "closed")
            await conn.close()

    run(main())


def test_oversized_payload_refused_and_server_keeps_serving(harness):
    async def main():
        async with Session(harness) as s:
            other = await s.client()
            c = await s.client()
            rid = rollout()
            huge = make(rid, "huge", (5 << 20) // 64, layers=4, k=16)  # 5 MiB > 4 MiB limit
            with pytest.raises(ProtocolError, match="payload"):
                await c.push([huge])
            assert not c.connected
            rid2 = rollout()
            await other.push([make(rid2, "fine")])
            assert (await harness.next_event(rid2))[0] == "batch"
            rid3 = rollout()
            await c.push([make(rid3, "again")])  # reconnects after the fatal refusal
            assert (await harness.next_event(rid3))[0] == "batch"

    run(main())


def test_oversized_header_refused(harness):
    async def main():
        async with Session(harness) as s:
            c = await s.client()
            rid = "r" * 150
            many = [make(rid, f"request-{'x' * 120}-{i}", 1, seed=i) for i in range(600)]  # ~200 KiB table
            with pytest.raises(ProtocolError, match="header"):
                await c.push(many)
            rid2 = rollout()
            await c.push([make(rid2, "after")])
            assert (await harness.next_event(rid2))[0] == "batch"

    run(main())


@pytest.mark.parametrize("error", [DuplicateRequestError, StoreError, CorruptDataError])
def test_handler_error_comes_back_typed(harness, error):
    async def main():
        async with Session(harness) as s:
            c = await s.client()
            with pytest.raises(error, match="scripted failure"):
                await c.push([make(rollout(f"fail.{error.__name__}"), "r")])
            assert c.connected  # a handler error leaves the stream in sync
            rid = rollout()
            ack = await c.push([make(rid, "next")])
            assert ack.seq == 2
            assert (await harness.next_event(rid))[0] == "batch"

    run(main())


def test_checksum_mismatch_is_corrupt_data(harness):
    async def main():
        async with Session(harness) as s:
            c = await s.client()
            rec = make(rollout(), "bad-crc")
            wrong = dataclasses.replace(RecordMeta.of(rec, 0), crc32c=rec.crc32c ^ 1)
            with pytest.raises(CorruptDataError, match="crc32c"):
                await c.push_packed(PackedBatch((wrong,), rec.ids_TLK.reshape(-1).view(np.uint8)))
            # Every payload needs the sender's checksum (device senders included): a packed
            # batch without one is refused before anything is sent; the connection stays usable.
            rid = rollout()
            rec2 = make(rid, "no-crc", seed=9)
            nocrc = RecordMeta(rid, "no-crc", 7, 3, 2, "uint8", 128, rec2.layer_map, 0, None, 0)
            with pytest.raises(ProtocolError, match="crc32c"):
                await c.push_packed(PackedBatch((nocrc,), rec2.ids_TLK.reshape(-1).view(np.uint8)))
            await c.push_packed(PackedBatch((RecordMeta.of(rec2, 0),), rec2.ids_TLK.reshape(-1).view(np.uint8)))
            _, _, got = await harness.next_event(rid)
            assert_same([rec2], got)

    run(main())


def test_probe_batch_is_checked_and_acked_but_never_handled(harness):
    async def main():
        async with Session(harness) as s:
            c = await s.client()
            rid = rollout()
            rec = make(rid, "probe", rows=40, seed=11)
            payload = rec.ids_TLK.reshape(-1).view(np.uint8)
            ack = await c.push_packed(PackedBatch((RecordMeta.of(rec, 0),), payload, probe=True))
            assert (ack.requests, ack.bytes) == (1, rec.nbytes)
            # Checked like any batch: a corrupt probe is refused, typed.
            wrong = dataclasses.replace(RecordMeta.of(rec, 0), crc32c=rec.crc32c ^ 1)
            with pytest.raises(CorruptDataError, match="crc32c"):
                await c.push_packed(PackedBatch((wrong,), payload, probe=True))
            # The handler reports batches in the order they arrive on this connection: had the
            # probe reached it, its report ("probe") would come before this normal batch's.
            real = make(rid, "real", seed=12)
            await c.push([real])
            kind, got_rollout, got = await harness.next_event(rid)
            assert (kind, got_rollout) == ("batch", rid)
            assert_same([real], got)

    run(main())


def test_ack_timeout_raises_r3_timeout(harness):
    async def main():
        async with Session(harness) as s:
            impatient = TransportLimits(timeout_s=5.0, ack_timeout_s=0.3)
            c = await s.client(limits=impatient)
            rid = rollout("gate")
            with pytest.raises(R3TimeoutError, match="ack"):
                await c.push([make(rid, "slow")])
            assert not c.connected  # state unknown after a timeout: never reused
            assert (await harness.next_event(rid))[0] == "entered"
            harness.release()
            assert (await harness.next_event(rid))[0] == "batch"  # delivered, just too late

    run(main())


def test_connect_timeout_or_refusal_is_typed():
    async def main():
        from r3rdma.transport import UcxxClient

        # Nothing listens on port 1: a typed error, not a hang or a raw UCX exception.
        c = UcxxClient("127.0.0.1", 1, secret=SECRET, limits=TransportLimits(timeout_s=1.0, connect_timeout_s=1.0))
        with pytest.raises((TransportError, R3TimeoutError)):
            await c.connect()

    run(main())


def test_many_batches_in_sequence(harness):
    async def main():
        async with Session(harness) as s:
            c = await s.client()
            rid = rollout()
            for i in range(60):
                batch = [make(rid, f"r{i}.{j}", 1 + (i + j) % 9, seed=i * 10 + j) for j in range(5)]
                ack = await c.push(batch)
                assert (ack.seq, ack.requests) == (i + 1, 5)
                _, _, got = await harness.next_event(rid)
                assert_same(batch, got)

    run(main(), 45)


def test_concurrent_clients(harness):
    async def main():
        async with Session(harness) as s:
            clients = [await s.client() for _ in range(4)]
            rids = [rollout() for _ in clients]

            async def pusher(c, rid):
                sent = []
                for i in range(5):
                    batch = [make(rid, f"q{i}.{j}", 3, seed=i + j) for j in range(3)]
                    await c.push(batch)
                    sent.append(batch)
                return sent

            sent = await asyncio.gather(*(pusher(c, rid) for c, rid in zip(clients, rids)))
            for rid, batches in zip(rids, sent):
                for batch in batches:
                    _, _, got = await harness.next_event(rid)
                    assert_same(batch, got)

    run(main())
