"""How a server receives payloads: frame layout on the sender, per-request hashing as frames
land, and pooled receive buffers that never change or leak another batch's bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import numpy as np
import pytest

from r3rdma.errors import CorruptDataError, ProtocolError
from r3rdma.records import RequestRecord, buffer_checksum, checksum
from r3rdma.transport import LoopbackClient, LoopbackServer, PackedBatch, RecordMeta, TransportLimits
from r3rdma.transport.batch import ZERO_COPY_MIN_BYTES, batch_header, encode_records
from r3rdma.transport.frames import Kind, Preamble, pack_header
from r3rdma.transport.receive import FrameHasher, ReceiveBuffers
from r3rdma.transport.session import client_handshake, recv_reply

pytestmark = pytest.mark.timeout(60)
SECRET = b"receive-secret-0123456789abcdefgh"


def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def rec(request_id: str, rows: int, seed: int, rollout: str = "roll") -> RequestRecord:
    ids = np.random.default_rng(seed).integers(0, 128, (rows, 4, 8), dtype=np.uint8)
    return RequestRecord(rollout, request_id, ids, (0, 1, 2, 3), 128)


def test_large_requests_travel_without_a_copy_small_ones_coalesced():
    big_rows = ZERO_COPY_MIN_BYTES // 32 + 1
    recs = [rec("s0", 3, 0), rec("s1", 5, 1), rec("b0", big_rows, 2), rec("s2", 2, 3), rec("b1", big_rows, 4)]
    table, frames = encode_records(recs, max_frames=16)
    assert [f.nbytes for f in frames] == [8 * 32, big_rows * 32, 2 * 32, big_rows * 32]
    assert np.shares_memory(frames[1], recs[2].ids_TLK) and np.shares_memory(frames[3], recs[4].ids_TLK)
    whole = np.concatenate([r.ids_TLK.reshape(-1) for r in recs])
    assert np.array_equal(np.concatenate(frames), whole)
    # Over max_frames: frames grow (coalescing more) until they fit; the bytes stay the same.
    _, few = encode_records(recs, max_frames=2)
    assert len(few) <= 2 and np.array_equal(np.concatenate(few), whole)
    assert [t["offset"] for t in table] == [0, 96, 256, 256 + big_rows * 32, 256 + big_rows * 32 + 64]


@pytest.mark.parametrize("seed", range(5))
def test_frame_hasher_waits_for_every_frame_of_a_request(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([0, 32, 96, 4096, 300_000]) for _ in range(12)]
    metas, offset = [], 0
    for i, n in enumerate(sizes):
        metas.append(RecordMeta("roll", f"r{i}", n // 32, 4, 8, "uint8", 128, (0, 1, 2, 3), 0, None, offset))
        offset += n
    payload = np.frombuffer(np.random.default_rng(seed).bytes(offset), np.uint8).copy()
    # Frames cut anywhere, requests straddling them; they land in a random order.
    cuts = sorted(rng.sample(range(1, offset), 5)) if offset > 5 else []
    frame_sizes = [b - a for a, b in zip([0, *cuts], [*cuts, offset])]

    async def main():
        hasher = FrameHasher(metas, frame_sizes, payload)
        order = list(range(len(frame_sizes)))
        rng.shuffle(order)
        for i in order[:-1]:
            hasher.frame_done(i)
        with pytest.raises(AssertionError, match="frames missing"):
            await hasher.results()
        hasher.frame_done(order[-1])
        return await hasher.results()

    got = run(main())
    assert got == [buffer_checksum(payload[m.offset : m.offset + m.nbytes]) for m in metas]


def _server(handler, **limits):
    return LoopbackServer(handler, secret=SECRET, limits=TransportLimits(**limits))


@pytest.mark.parametrize("keep", [False, True])
def test_buffers_reused_only_when_no_record_survives(keep):
    kept: list[RequestRecord] = []

    async def handler(records):
        if keep:
            kept.extend(records)

    async def main():
        server = _server(handler)
        await server.start()
        sent = [[rec(f"b{i}-{j}", 40 + j, seed=10 * i + j, rollout=f"roll{i}") for j in range(3)] for i in range(4)]
        async with LoopbackClient(server, secret=SECRET) as c:
            for batch in sent:
                await c.push(batch)
        await server.stop()
        return server.buffers.reused, sent

    reused, sent = run(main())
    if keep:
        assert reused == 0  # every buffer is still viewed by a kept record
        originals = [r for batch in sent for r in batch]
        assert [r.request_id for r in kept] == [r.request_id for r in originals]
        for got, want in zip(kept, originals):
            assert np.array_equal(got.ids_TLK, want.ids_TLK) and got.crc32c == checksum(want.ids_TLK)
    else:
        assert reused >= 3


async def _raw_batch(server, meta: RecordMeta, announced: int, sent: np.ndarray):
    """Speak the protocol by hand: announce ``announced`` payload bytes, send ``sent``."""
    conn = server._accept()
    version = await client_handshake(conn, SECRET, server.limits)
    raw = pack_header(batch_header(1, [meta.to_wire()], [announced]))
    pre = Preamble(version, Kind.BATCH, len(raw), announced)
    await conn.send(np.frombuffer(pre.pack() + raw, np.uint8))
    if sent.nbytes:
        await conn.send(sent)
    try:
        return await recv_reply(conn, version, 1, server.limits)
    finally:
        await conn.close()


def _storing():
    """A handler that keeps a copy of every record it is given, and the dict it keeps them in."""
    stored: dict[str, np.ndarray] = {}

    async def handler(records):
        for r in records:
            stored[r.request_id] = r.ids_TLK.copy()

    return stored, handler


def test_a_batch_without_a_sender_checksum_is_refused_not_stored_zero_filled():
    """Issue 19: a request without the sender's CRC-32C used to be hashed by the receiver,
    so a frame that arrived short was stored as zeros under a checksum the node made up."""
    stored, handler = _storing()

    async def main():
        server = _server(handler)
        await server.start()
        try:
            first = rec("first", 64, seed=1)
            meta = dataclasses.replace(RecordMeta.of(first, 0), request_id="second", crc32c=None)
            with pytest.raises(ProtocolError, match="crc32c"):
                await _raw_batch(server, meta, first.nbytes, np.full(first.nbytes // 2, 7, np.uint8))
        finally:
            await server.stop()

    run(main())
    assert stored == {}


@pytest.mark.parametrize("reused", [False, True])
def test_a_short_frame_is_refused_never_zero_filled(reused):
    """A frame shorter than announced (UCX does not report it) fails the sender's checksum,
    whether the buffer is fresh or held another batch's bytes; nothing is stored."""
    stored, handler = _storing()

    async def main():
        server = _server(handler)
        await server.start()
        try:
            first = rec("first", 64, seed=1)
            if reused:
                async with LoopbackClient(server, secret=SECRET) as c:
                    await c.push([first])  # its buffer goes back to the pool
            second = rec("second", 64, seed=2)
            payload = second.ids_TLK.reshape(-1)
            with pytest.raises(CorruptDataError, match="crc32c"):
                await _raw_batch(server, RecordMeta.of(second, 0), second.nbytes, payload[: second.nbytes // 2].copy())
            assert server.buffers.reused == int(reused)
        finally:
            await server.stop()

    run(main())
    assert "second" not in stored


def test_corrupt_request_in_a_pooled_buffer_is_refused_and_the_next_batch_is_clean():
    seen = []

    async def handler(records):
        seen.extend(r.request_id for r in records)

    async def main():
        server = _server(handler)
        await server.start()
        async with LoopbackClient(server, secret=SECRET) as c:
            good = rec("good", 50, seed=3)
            await c.push([good])
            bad = rec("bad", 50, seed=4)
            meta = RecordMeta.of(bad, 0)
            wrong = RecordMeta(*[(v ^ 1 if f == "crc32c" else v) for f, v in ((f, getattr(meta, f)) for f in RecordMeta.__slots__)])
            with pytest.raises(CorruptDataError, match="hash to"):
                await c.push_packed(PackedBatch((wrong,), bad.ids_TLK.reshape(-1).view(np.uint8)))
            await c.push([rec("after", 50, seed=5)])
        await server.stop()

    run(main())
    assert seen == ["good", "after"]


def test_receive_buffers_pool_bounds():
    mib = 1 << 20
    pool = ReceiveBuffers(max_cached_bytes=10 * mib, max_buffers=2)
    taken = [pool.take(4 * mib) for _ in range(3)]
    while taken:
        buf = taken.pop()
        pool.give_back(buf)  # as the server does: its one variable holds the buffer
        del buf
    assert pool.cached_bytes <= 10 * mib and len(pool._free) <= 2
    again = pool.take(3 * mib)
    assert again.nbytes == 4 * mib and pool.reused == 1
    assert pool.take(100_000).nbytes == 100_000  # a 4 MiB buffer is too big to pin for 100 kB
    view = again[:10]
    pool.give_back(again)
    assert all(x is not again for x in pool._free)  # still viewed: not pooled
    del view
    pool.give_back(again)
    assert any(x is again for x in pool._free)  # no view left: pooled
    huge = pool.take(20 * mib)
    pool.give_back(huge)
    assert all(x is not huge for x in pool._free)  # larger than the cache bound
