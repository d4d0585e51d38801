"""RoutingReader: per-request and packed reads, errors, corruption detection."""

import numpy as np
import zarr
import pytest
import torch

from r3rdma import CorruptDataError, LocalRoutingStore, RoutingReader, UnknownRequestError, UnknownRolloutError
from r3rdma.errors import ConfigError, StoreError


@pytest.fixture
def populated(tmp_path, make_record):
    recs = [make_record(f"r{i}", rows=3 + 11 * i) for i in range(6)]
    wide = [make_record(f"w{i}", rows=7, rollout_id="wide", num_experts=1000) for i in range(2)]
    with LocalRoutingStore(tmp_path, chunk_rows=16) as store:
        store.commit(recs[:3])
        store.commit(recs[3:])
        store.commit(wide)
    return tmp_path, recs, wide


def test_get_returns_tensors(populated):
    root, recs, wide = populated
    got = RoutingReader(root).get("roll-0", ["r4", "r1"])
    assert list(got) == ["r4", "r1"]
    assert got["r1"].dtype == torch.uint8 and got["r1"].shape == (14, 3, 2)
    np.testing.assert_array_equal(got["r4"].numpy(), recs[4].ids_TLK)
    w = RoutingReader(root).get("wide", ["w1"])["w1"]
    assert w.dtype == torch.int32  # uint16 widened: torch's uint16 lacks indexing ops
    np.testing.assert_array_equal(w.numpy(), wide[1].ids_TLK.astype(np.int32))


def test_packed_form(populated):
    root, recs, _ = populated
    order = ["r5", "r0", "r3"]
    packed = RoutingReader(root).get_packed("roll-0", order)
    assert packed.request_ids == tuple(order)
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 58, 61, 97]
    by_id = {r.request_id: r for r in recs}
    for i, rid in enumerate(order):
        lo, hi = packed.cu_seqlens[i].item(), packed.cu_seqlens[i + 1].item()
        np.testing.assert_array_equal(packed.ids_TLK[lo:hi].numpy(), by_id[rid].ids_TLK)
    assert packed.layer_map == (0, 1, 2) and packed.num_experts == 16 and packed.start_rows == (0, 0, 0)


def test_info(populated):
    root, recs, _ = populated
    info = RoutingReader(root).info("roll-0")
    assert info.request_ids == tuple(r.request_id for r in recs)
    assert (info.num_layers, info.top_k, info.dtype, info.total_rows) == (3, 2, "uint8", sum(r.num_rows for r in recs))


def test_unknown_rollout_and_request(populated):
    root, _, _ = populated
    reader = RoutingReader(root)
    with pytest.raises(UnknownRolloutError, match="'nope'") as info:
        reader.get("nope", ["r0"])
    assert isinstance(info.value, KeyError)
    with pytest.raises(UnknownRequestError, match=r"no committed request 'zz' \(1 of the 2 asked for are missing; 6 requests committed\)"):
        reader.get("roll-0", ["r0", "zz"])


def test_sees_requests_committed_after_first_read(tmp_path, make_record):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("a")])
        reader = RoutingReader(tmp_path)
        reader.get("roll-0", ["a"])
        store.commit([make_record("b")])
        assert "b" in reader.get("roll-0", ["b"])


def test_corrupted_chunk_detected(tmp_path, make_record):
    rec = make_record("a", rows=50)
    with LocalRoutingStore(tmp_path, zstd_level=0) as store:
        store.commit([rec])
    shard = tmp_path / "roll-0" / "b00000001" / "c" / "0" / "0" / "0"
    pristine = shard.read_bytes()
    data = bytearray(pristine)
    data[len(pristine) - 10] ^= 0xFF  # the shard index comes first, then the chunk (rows, then its crc32c)
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match="chunk 0 fails its crc32c"):
        RoutingReader(tmp_path).get("roll-0", ["a"])
    # A damaged shard index: the reader takes chunk places from the rollout index part (its
    # copy of the shard index), so the intact rows still read; zarr itself refuses the file.
    data = bytearray(pristine)
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    np.testing.assert_array_equal(RoutingReader(tmp_path).get_numpy("roll-0", ["a"])["a"], rec.ids_TLK)
    with pytest.raises(Exception, match="checksum"):
        zarr.open_array(tmp_path / "roll-0" / "b00000001", mode="r")[:]


@pytest.mark.parametrize("job_bytes", [1 << 19, 1], ids=["on-the-loop", "on-workers"])
def test_spans_decoded_on_the_loop_or_by_workers(tmp_path, make_record, monkeypatch, job_bytes):
    """A fetched span of one decode job's worth is checked and decoded on the reader's event
    loop, a longer one by the decode workers (job_bytes=1: every span of two or more chunks):
    the same rows either way, slices included, and a damaged chunk is named either way."""
    from r3rdma.read import shard_ranges

    monkeypatch.setattr(shard_ranges, "_JOB_BYTES", job_bytes)
    recs = [make_record(f"r{i}", rows=200 + 37 * i, layers=6, k=4, num_experts=64) for i in range(4)]
    with LocalRoutingStore(tmp_path, chunk_rows=16) as store:
        store.commit(recs)
    reader = RoutingReader(tmp_path)
    got = reader.get_numpy("roll-0", [r.request_id for r in recs])
    for rec in recs:
        np.testing.assert_array_equal(got[rec.request_id], rec.ids_TLK)
    part = reader.get_numpy("roll-0", ["r1", "r2"], layers=[1, 4], rows={"r1": [(3, 90)], "r2": [(17, 18), (100, 230)]})
    np.testing.assert_array_equal(part["r1"], recs[1].ids_TLK[3:90][:, [1, 4]])
    np.testing.assert_array_equal(part["r2"], np.concatenate([recs[2].ids_TLK[17:18], recs[2].ids_TLK[100:230]])[:, [1, 4]])
    shard = next((tmp_path / "roll-0").glob("b*/c/0/0/0"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside some chunk's bytes (the index comes first, then the chunks)
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match=r"chunk \d+ fails its crc32c"):
        RoutingReader(tmp_path).get_numpy("roll-0", [r.request_id for r in recs])


def test_index_checksum_catches_what_zarr_cannot(tmp_path, make_record, monkeypatch):
    rec = make_record("a")
    with LocalRoutingStore(tmp_path) as store:
        store.commit([rec])
    import json

    path = tmp_path / "roll-0" / "i00000001" / "zarr.json"  # the index part that lists "a"
    doc = json.loads(path.read_text())
    doc["attributes"]["r3rdma"]["requests"]["a"]["segments"][0]["crc32c"] ^= 1
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptDataError, match="index says"):
        RoutingReader(tmp_path).get("roll-0", ["a"])


def test_ids_may_be_any_iterable_read_once(populated):
    """A generator of ids is consumed once: get_packed used to iterate it twice and return an
    empty batch."""
    root, recs, _ = populated
    order = ["r5", "r0", "r3"]
    with RoutingReader(root) as reader:
        want = reader.get_packed("roll-0", order)
        packed = reader.get_packed("roll-0", (rid for rid in order))
        assert packed.request_ids == tuple(order)
        assert packed.cu_seqlens.tolist() == want.cu_seqlens.tolist() == [0, 58, 61, 97]
        assert torch.equal(packed.ids_TLK, want.ids_TLK) and packed.start_rows == want.start_rows
        got = reader.get("roll-0", iter(order))
        assert list(got) == order
        np.testing.assert_array_equal(got["r3"].numpy(), recs[3].ids_TLK)
        assert list(reader.get_numpy("roll-0", (rid for rid in order))) == order


def test_a_disk_error_on_a_local_root_is_a_store_error(populated, monkeypatch):
    """An I/O error reading a local root is the disk's failure (StoreError), not damaged data,
    on the index and on the arrays; a file that is simply gone still reads as absent."""
    import errno

    from zarr.storage import LocalStore

    root, recs, _ = populated
    real_get = LocalStore.get
    failing = {"suffix": "roll-0/zarr.json"}

    async def get(self, key, *args, **kwargs):
        if key.endswith(failing["suffix"]):
            raise OSError(errno.EIO, "Input/output error", key)
        return await real_get(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "get", get)
    with RoutingReader(root) as reader:
        with pytest.raises(StoreError, match=r"index of rollout 'roll-0' failed: OSError: .*Input/output error"):
            reader.info("roll-0")
        failing["suffix"] = "b00000001/c/0/0/0"
        with pytest.raises(StoreError, match=r"rollout 'roll-0' array b00000001 failed: OSError"):
            reader.get("roll-0", ["r0"])
        np.testing.assert_array_equal(reader.get("roll-0", ["r4"])["r4"].numpy(), recs[4].ids_TLK)
        with pytest.raises(UnknownRolloutError):
            reader.info("nope")


def test_timeout_must_be_positive(tmp_path):
    for bad in (0, -1, float("nan"), True, "5"):
        with pytest.raises(ConfigError, match="timeout_s"):
            RoutingReader(tmp_path, timeout_s=bad)


def test_zstd_chunks_decode_into_place_and_bad_frames_are_refused():
    """The reader's chunk decoder (python-zstandard, a decompressor per thread): a frame decodes
    into the caller's buffer or into new bytes; a frame longer than a chunk comes back longer
    (the caller's size check refuses it); bytes that are no zstd frame raise ``ZstdError``,
    which the reader reports as ``CorruptDataError``."""
    import zstandard

    from r3rdma.read.shard_ranges import _zstd_decode

    data = np.random.default_rng(5).integers(0, 128, size=4096, dtype=np.uint8)
    frame = zstandard.ZstdCompressor(level=3).compress(data.tobytes())
    out = np.zeros(4096, dtype=np.uint8)
    assert len(_zstd_decode(frame, out, 4096)) == 4096 and np.array_equal(out, data)
    assert bytes(_zstd_decode(frame, None, 4096)) == data.tobytes()
    assert len(_zstd_decode(frame, np.zeros(4000, dtype=np.uint8), 4000)) > 4000
    with pytest.raises(zstandard.ZstdError):
        _zstd_decode(b"\x00" * 64, np.zeros(4096, dtype=np.uint8), 4096)
    with pytest.raises(zstandard.ZstdError):
        _zstd_decode(b"\x00" * 64, None, 4096)
