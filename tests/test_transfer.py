"""transfer_mode: staged vs GPU-direct pushes of device rows, and the start-up probe."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import subprocess
import sys

import numpy as np
import pytest
import torch

from r3rdma.errors import ConfigError, ShapeMismatchError
from r3rdma.records import checksum
from r3rdma.capture.transfer import DeviceRows, stage_to_host
from r3rdma.write.device_push import pack_device_rows, probe_transfer_mode, push_device_rows
from r3rdma.transport import LoopbackClient, LoopbackServer, TransportLimits
from r3rdma.transport.testing import LoopbackHarness, UcxxProcessHarness

SECRET = b"transfer-test-secret"
LIMITS = TransportLimits(max_payload_bytes=256 << 20, timeout_s=30.0, ack_timeout_s=60.0)


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _rows(device, seed, rows=37, layers=5, k=3, num_experts=200):
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.uint8 if num_experts <= 256 else torch.int16
    return torch.randint(0, num_experts, (rows, layers, k), generator=gen).to(dtype).to(device)


def _items(device, rollout):
    a = DeviceRows(rollout, "a", _rows(device, 1), (1, 3, 5, 7, 9), 200)
    b = DeviceRows(rollout, "b", _rows(device, 2, rows=1000, num_experts=300), (1, 3, 5, 7, 9), 300, start_row=4)
    c = DeviceRows(rollout, "c", _rows(device, 3, rows=1), (1, 3, 5, 7, 9), 200)  # a 0-row record is refused
    return [a, b, c]


def _check(items, got):
    assert [g.request_id for g in got] == [i.request_id for i in items]
    for item, g in zip(items, got):
        want = item.ids_TLK.cpu().numpy()
        if want.dtype == np.int16:
            want = want.view(np.uint16)
        assert g.ids_TLK.dtype == want.dtype and g.ids_TLK.shape == want.shape
        assert g.ids_TLK.tobytes() == want.tobytes()
        assert g.crc32c == checksum(want)
        assert (g.start_row, g.layer_map, g.num_experts) == (item.start_row, item.layer_map, item.num_experts)


# -- CPU ------------------------------------------------------------------------------------


def test_probe_arguments_are_validated():
    for bad in ({"probe_rounds": 0}, {"probe_bytes": 0}, {"min_gain": 0.0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            run(probe_transfer_mode(None, device="cpu", **bad))


def test_probe_pushes_reach_no_handler():
    """The probe's pushes are probe batches: acked, never handed to the server's handler, so a
    normal batch under the probe's own ids is the only one the handler sees."""
    handled = []

    async def handler(records):
        handled.append([(r.rollout_id, r.request_id) for r in records])

    async def main():
        server = LoopbackServer(handler, secret=SECRET, limits=LIMITS)
        await server.start()
        client = LoopbackClient(server, secret=SECRET, limits=LIMITS)
        try:
            result = await probe_transfer_mode(client, device="cpu", probe_bytes=1 << 16, probe_rounds=2, min_gain=1e9)
            await push_device_rows(client, [DeviceRows("transfer-probe", "probe", _rows("cpu", 6), (1, 3, 5, 7, 9), 200)],
                                   "staged")
        finally:
            await client.close()
            await server.stop()
        return result

    result = run(main())
    assert handled == [[("transfer-probe", "probe")]]
    rows = (1 << 16) // (48 * 8)
    assert (result.nbytes, result.rounds) == (rows * 48 * 8, 2)
    assert result.mode == "staged"  # gpu_direct would need to be 1e9 times faster
    assert result.staged_gbps > 0 and result.gpu_direct_gbps > 0


def test_pack_checks_dtype_and_offsets():
    items = _items("cpu", "roll")
    metas, payload = pack_device_rows(items)
    assert [m.offset for m in metas] == [0, items[0].nbytes, items[0].nbytes + items[1].nbytes]
    assert payload.numel() == sum(i.nbytes for i in items)
    assert metas[1].dtype == "uint16" and metas[0].dtype == "uint8"
    # Host rows are hashed while packing: every payload carries the sender's CRC-32C.
    assert [m.crc32c for m in metas] == [checksum(i.ids_TLK.numpy()) for i in items]
    bad = DeviceRows("roll", "x", _rows("cpu", 4).to(torch.int32), (1, 3, 5, 7, 9), 200)
    with pytest.raises(ShapeMismatchError):
        pack_device_rows([bad])


def test_stage_to_host_on_cpu_is_identity():
    rows = _rows("cpu", 5)
    staged = stage_to_host(rows)
    assert staged.ready() and staged.wait() is not None
    np.testing.assert_array_equal(staged.wait(), rows.numpy())


@pytest.mark.parametrize("mode", ["staged", "gpu_direct"])
def test_push_host_rows_over_loopback(mode):
    harness = LoopbackHarness(SECRET, LIMITS)

    async def main():
        await harness.start()
        client = harness.client(SECRET, LIMITS)
        try:
            items = _items("cpu", f"roll-{mode}")
            ack = await push_device_rows(client, items, mode)
            assert ack.requests == 3
            event = await harness.next_event(f"roll-{mode}")
            _check(items, event[2])
        finally:
            await client.close()
            await harness.stop()

    run(main())


@pytest.mark.parametrize("mode", ["staged", "gpu_direct"])
def test_pushed_device_rows_carry_sender_checksums(mode):
    """Issue 19: device batches were pushed with crc32c null, the node hashing what arrived."""
    sent = []

    class Recording:
        async def push_packed(self, batch):
            sent.append(batch)
            return "ack"

    items = _items("cpu", "roll-crc")
    assert run(push_device_rows(Recording(), items, mode)) == "ack"
    (batch,) = sent
    assert [m.crc32c for m in batch.metas] == [checksum(i.ids_TLK.numpy()) for i in items]


def test_checksum_packed_covers_each_request_and_checks_the_size():
    from r3rdma.write.device_push import checksum_packed

    items = _items("cpu", "roll")
    metas, payload = pack_device_rows(items)
    blank = tuple(dataclasses.replace(m, crc32c=None) for m in metas)
    assert checksum_packed(blank, payload.numpy()) == metas
    with pytest.raises(ShapeMismatchError):
        checksum_packed(blank, payload.numpy()[:-1])


def test_push_needs_resolved_mode():
    with pytest.raises(ConfigError):
        run(push_device_rows(None, _items("cpu", "r"), "auto"))


# -- GPU ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ucxx_server():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    h = UcxxProcessHarness(SECRET, LIMITS)
    h.spawn()
    yield h
    h.kill()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["staged", "gpu_direct"])
def test_gpu_push_device_rows_over_ucxx(ucxx_server, mode):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    async def main():
        await ucxx_server.start()
        client = ucxx_server.client(SECRET, LIMITS)
        try:
            rollout = f"gpu-{mode}"
            items = _items("cuda", rollout)
            # Rows produced by a kernel still running when the push starts: the push must wait.
            for item in items:
                item.ids_TLK.copy_(item.ids_TLK.flip(0))
            ready = torch.cuda.Event()
            ready.record()
            items = [DeviceRows(i.rollout_id, i.request_id, i.ids_TLK, i.layer_map, i.num_experts, ready, i.start_row)
                     for i in items]
            ack = await push_device_rows(client, items, mode)
            assert ack.requests == 3
            _check(items, (await ucxx_server.next_event(rollout, timeout=30))[2])
        finally:
            await client.close()

    run(main())


@pytest.mark.gpu
def test_gpu_stage_to_host_event():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rows = _rows("cuda", 9, rows=4096, layers=48, k=8)
    staged = stage_to_host(rows)
    assert staged.host.is_pinned()
    np.testing.assert_array_equal(staged.wait(), rows.cpu().numpy())
    assert staged.ready()


@pytest.mark.gpu
def test_gpu_probe_against_sink_process():
    """The start-up probe against a discarding UcxxServer in another process; prints its numbers."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    secret = secrets.token_hex(16)
    server = subprocess.Popen([sys.executable, "-m", "r3rdma.bench.transport_bench", "--serve", secret],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ports = json.loads(server.stdout.readline())
        from r3rdma.transport import UcxxClient

        async def main():
            limits = TransportLimits(max_payload_bytes=1 << 30, timeout_s=60)
            async with UcxxClient("127.0.0.1", ports["push_port"], secret=secret, limits=limits) as client:
                return await probe_transfer_mode(client, probe_bytes=16 << 20, probe_rounds=3)

        result = run(main(), timeout=240)
        print("transfer probe:", json.dumps(result.to_json()))
        assert result.mode in ("gpu_direct", "staged")
        assert result.staged_gbps > 0 and result.gpu_direct_gbps > 0
    finally:
        server.stdin.close()
        server.wait(30)
