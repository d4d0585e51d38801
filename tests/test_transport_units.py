"""Unit tests of r3rdma.transport pieces: secrets, env, framing, header validation, server
lifecycle on the loopback, and the raw-ucxx baseline."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3rdma import errors
from r3rdma.errors import ConfigError, ProtocolError, R3TimeoutError, TransportError
from r3rdma.records import RequestRecord
from r3rdma.transport import LoopbackClient, LoopbackServer, RecordMeta, TransportLimits, load_secret
from r3rdma.transport.batch import batch_header, check_batch_header, encode_records, is_probe
from r3rdma.transport.frames import Kind, Preamble, error_from_header, error_header, unpack_header

pytestmark = pytest.mark.timeout(60)
SECRET = b"unit-secret-0123456789abcdefghij"


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def record(request_id: str = "r0", rows: int = 4, num_experts: int = 128) -> RequestRecord:
    dtype = np.uint8 if num_experts <= 256 else np.uint16
    ids = np.arange(rows * 3 * 2, dtype=np.int64).reshape(rows, 3, 2) % num_experts
    return RequestRecord("roll", request_id, ids.astype(dtype), (0, 1, 2), num_experts)


# -- secrets and environment --------------------------------------------------------------


def test_load_secret_argument_then_env(tmp_path, monkeypatch):
    f = tmp_path / "token"
    f.write_bytes(b"from-the-file-0123456789\n")
    monkeypatch.setenv("R3_STORE_TOKEN", "from-the-environment-0123")
    assert load_secret(f) == b"from-the-file-0123456789"
    assert load_secret() == b"from-the-environment-0123"
    monkeypatch.delenv("R3_STORE_TOKEN")
    with pytest.raises(ConfigError, match="R3_STORE_TOKEN"):
        load_secret()
    with pytest.raises(ConfigError, match="cannot read"):
        load_secret(tmp_path / "missing")
    f.write_bytes(b"short")
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(f)


def _python(code: str, env_extra: dict[str, str] | None = None) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "UCXPY_"))}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_loads_no_ucxx_and_sets_no_env():
    got = _python(
        "import os, sys, json; before = dict(os.environ); import r3rdma.transport; "
        "print(json.dumps({'ucxx': 'ucxx' in sys.modules, 'env_same': dict(os.environ) == before}))"
    )
    assert got == {"ucxx": False, "env_same": True}


def test_configure_ucx_env_keeps_user_values():
    got = _python(
        "import os, json; from r3rdma.transport import configure_ucx_env; "
        "applied = configure_ucx_env(); from r3rdma.transport.ucx_env import import_ucxx; import_ucxx(); "
        "print(json.dumps({'applied': applied, 'mode': os.environ['UCXPY_PROGRESS_MODE']}))",
        {"UCXPY_PROGRESS_MODE": "polling"},
    )
    assert got["mode"] == "polling"
    assert got["applied"]["UCX_WARN_UNUSED_ENV_VARS"] == "n"


# -- framing ------------------------------------------------------------------------------


def test_preamble_roundtrip_and_refusals():
    pre = Preamble(1, Kind.BATCH, 123, 1 << 40)
    raw = pre.pack()
    assert len(raw) == 16 and Preamble.unpack(raw) == pre
    with pytest.raises(ProtocolError, match="magic"):
        Preamble.unpack(b"XX" + raw[2:])
    with pytest.raises(ProtocolError, match="kind"):
        Preamble.unpack(raw[:3] + b"\x63" + raw[4:])
    with pytest.raises(ProtocolError, match="16 bytes"):
        Preamble.unpack(raw[:10])


def test_header_must_be_one_msgpack_map():
    with pytest.raises(ProtocolError, match="map"):
        unpack_header(msgpack.packb([1, 2]), "BATCH")
    with pytest.raises(ProtocolError, match="msgpack"):
        unpack_header(msgpack.packb({"a": 1}) + b"\x00\x00", "BATCH")  # zero-filled short message


def test_error_frames_map_to_r3_classes():
    for name in errors.__all__:
        cls = getattr(errors, name)
        exc = error_from_header(error_header(cls("boom"), seq=1, fatal=False))
        assert type(exc) is cls and "boom" in str(exc)
    assert type(error_from_header({"error": "ValueError", "message": "x"})) is TransportError
    assert type(error_from_header({"error": "NoSuchError", "message": "x"})) is TransportError
    assert error_header(KeyError("secret internals"), seq=None, fatal=False)["error"] == "TransportError"
    assert len(error_header(ProtocolError("x" * 10**5), seq=None, fatal=True)["message"]) <= 4000


def test_limits_validated():
    with pytest.raises(ConfigError, match="max_payload_bytes"):
        TransportLimits(max_payload_bytes=0)
    with pytest.raises(ConfigError, match="timeout_s"):
        TransportLimits(timeout_s=-1)
    with pytest.raises(TypeError):
        TransportLimits(1)  # keyword-only


# -- batch header validation --------------------------------------------------------------

LIMITS = TransportLimits()


def _valid() -> tuple[dict, int]:
    recs = [record("a", 4), record("b", 2, num_experts=1000)]
    table, frames = encode_records(recs, max_frames=8)
    return {"seq": 1, "frames": [f.nbytes for f in frames], "records": table}, sum(f.nbytes for f in frames)


def test_valid_header_accepted():
    header, n = _valid()
    metas = check_batch_header(header, n, LIMITS)
    assert [m.request_id for m in metas] == ["a", "b"] and isinstance(metas[0], RecordMeta)
    assert not is_probe(header)


def test_probe_is_an_optional_header_key():
    header, n = _valid()
    # Written only on probes, so every other batch keeps the keys older receivers know.
    assert batch_header(1, header["records"], header["frames"]) == header
    probe = batch_header(1, header["records"], header["frames"], probe=True)
    assert probe == {**header, "probe": True}
    assert [m.request_id for m in check_batch_header(probe, n, LIMITS)] == ["a", "b"] and is_probe(probe)
    plain = {**header, "probe": False}  # accepted, and means a normal batch
    assert len(check_batch_header(plain, n, LIMITS)) == 2 and not is_probe(plain)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda h: h["records"][0].update(request_id="../etc"), "request_id"),
        (lambda h: h["records"][0].update(rollout_id=7), "rollout_id"),
        (lambda h: h["records"][0].update(rows=-1), "rows"),
        (lambda h: h["records"][0].update(rows=True), "rows"),
        (lambda h: h["records"][0].update(dtype="int32"), "dtype"),
        (lambda h: h["records"][1].update(offset=0), "offset"),
        (lambda h: h["records"][0].update(layer_map=[0, 1]), "layer_map"),
        (lambda h: h["records"][0].update(crc32c=1 << 33), "crc32c"),
        (lambda h: h["records"][0].update(extra=1), "keys"),
        (lambda h: h["records"][1].update(rows=1000), "past the"),
        (lambda h: h.update(frames=[1]), "frames add up"),
        (lambda h: h.update(records=[]), r"records must be a list of 1\.\."),
        (lambda h: h.update(frames={}), "frames must be a list"),
        (lambda h: h.pop("seq"), "keys"),
        (lambda h: h.update(probe=1), "probe must be a bool"),
        (lambda h: h.update(probe="yes"), "probe must be a bool"),
        (lambda h: h.update(stored=False), "keys"),
        (lambda h: h["records"][0].update(final=1), "final"),
        (lambda h: h["records"][0].update(final=False, total_rows=4), "total_rows"),
    ],
)
def test_invalid_header_refused(mutate, match):
    header, n = _valid()
    mutate(header)
    with pytest.raises(ProtocolError, match=match):
        check_batch_header(header, n, LIMITS)


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(header=st.dictionaries(st.sampled_from(["seq", "frames", "records", "probe", "x"]), _values), n=st.integers(0, 1 << 20))
def test_garbage_headers_only_raise_protocol_error(header, n):
    try:
        check_batch_header(header, n, LIMITS)
    except ProtocolError:
        pass


@settings(max_examples=100, deadline=None)
@given(idx=st.integers(0, 10**6), value=_values)
def test_mutated_valid_header_only_raises_protocol_error(idx, value):
    header, n = _valid()
    entry = header["records"][idx % 2]
    entry[sorted(entry)[idx % len(entry)]] = value
    try:
        check_batch_header(header, n, LIMITS)
    except ProtocolError:
        pass


# -- server lifecycle (loopback) ----------------------------------------------------------


def test_handler_deadline_is_a_typed_error_and_connection_survives():
    async def main():
        gate = asyncio.Event()
        calls = []

        async def handler(records):
            calls.append(records[0].request_id)
            if records[0].request_id == "slow":
                await gate.wait()

        server = LoopbackServer(handler, secret=SECRET, limits=TransportLimits(handler_timeout_s=0.2))
        await server.start()
        async with LoopbackClient(server, secret=SECRET) as c:
            with pytest.raises(R3TimeoutError, match="handler"):
                await c.push([record("slow")])
            assert c.connected
            assert (await c.push([record("fast")])).requests == 1
        await server.stop()
        assert calls == ["slow", "fast"]

    run(main())


def test_stop_drains_in_flight_batch():
    async def main():
        entered, gate = asyncio.Event(), asyncio.Event()
        durable = []

        async def handler(records):
            entered.set()
            await gate.wait()
            durable.extend(records)

        server = LoopbackServer(handler, secret=SECRET)
        await server.start()
        idle = LoopbackClient(server, secret=SECRET)
        await idle.connect()
        c = LoopbackClient(server, secret=SECRET)
        push = asyncio.ensure_future(c.push([record("inflight")]))
        await entered.wait()
        stop = asyncio.ensure_future(server.stop(drain=True))
        assert not stop.done()
        gate.set()
        ack = await push
        await stop
        assert ack.requests == 1 and [r.request_id for r in durable] == ["inflight"]
        with pytest.raises(TransportError):
            await idle.push([record("late")])  # server gone: reconnect is refused
        await c.close()
        await idle.close()

    run(main())


def test_push_validates_before_sending():
    async def main():
        server = LoopbackServer(lambda records: asyncio.sleep(0), secret=SECRET)
        await server.start()
        async with LoopbackClient(server, secret=SECRET) as c:
            with pytest.raises(ProtocolError, match="empty"):
                await c.push([])
        await server.stop()

    run(main())


# -- raw ucxx baseline --------------------------------------------------------------------


def test_raw_baseline_roundtrip():
    async def main():
        from r3rdma.transport.raw_baseline import RawSinkServer, raw_push

        sink = RawSinkServer()
        port = await sink.start()
        payload = np.arange(1 << 20, dtype=np.uint8)
        result = await raw_push("127.0.0.1", port, payload, 5, warmup=1)
        assert result.iterations == 5 and result.nbytes == 1 << 20 and result.gbps > 0
        assert sink.received == 6
        await sink.stop()

    run(main())
