"""The parallel shard decoder of remote reads must return exactly what zarr-python returns
for every layout r3rdma writes, refuse damage with CorruptDataError, and decline anything else."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import zarr
from numcodecs import Zstd
from zarr.codecs import BloscCodec
from zarr.storage import LocalStore

from r3rdma.errors import CorruptDataError
from r3rdma.store.local_store import zarr_codecs
from r3rdma.records import buffer_checksum
from r3rdma.store.shard_codec import ShardDecoder, zstd_content_size


def write(tmp_path, data, *, chunk, shard, level, compressors=None, index_location="start"):
    zarr.create_array(
        LocalStore(tmp_path), name="a", data=data, chunks=(chunk, *data.shape[1:]),
        shards={"shape": (shard, *data.shape[1:]), "index_location": index_location},
        compressors=zarr_codecs(level) if compressors is None else compressors,
        dimension_names=("token", "layer", "k"), fill_value=0,
    )
    meta = json.loads((tmp_path / "a" / "zarr.json").read_text())
    return meta, zarr.open_array(LocalStore(tmp_path), path="a", mode="r")[:]


def decode_all(tmp_path, meta):
    decoder = ShardDecoder.of(meta)
    assert decoder is not None
    out = np.full(decoder.shape, 255, dtype=decoder.dtype)
    for s in range(decoder.num_shards):
        path = tmp_path / "a" / "c" / str(s) / "0" / "0"
        decoder.decode_into(out, s, path.read_bytes() if path.exists() else None, "test")
    return out


@pytest.mark.parametrize("index_location", ["start", "end"])  # end: what r3rdma wrote before 2026-11-21
@pytest.mark.parametrize("level", [0, 3])
@pytest.mark.parametrize("dtype,experts", [(np.uint8, 128), (np.uint16, 1000), (np.int32, 70000)])
@pytest.mark.parametrize("rows,chunk,shard_chunks", [(1, 1, 1), (37, 8, 5), (100, 7, 3), (64, 16, 4)])
def test_same_bytes_as_zarr(tmp_path, level, dtype, experts, rows, chunk, shard_chunks, index_location):
    rng = np.random.default_rng(rows * 31 + chunk)
    data = rng.integers(0, experts, (rows, 5, 4)).astype(dtype)
    data[: min(rows, chunk)] = 0  # an all-fill inner chunk: zarr leaves it out of the shard
    meta, want = write(tmp_path, data, chunk=chunk, shard=chunk * shard_chunks, level=level, index_location=index_location)
    got = decode_all(tmp_path, meta)
    assert got.dtype == want.dtype and np.array_equal(got, want) and np.array_equal(got, data)


def _one_shard(tmp_path, level=3, index_location="start"):
    data = np.random.default_rng(0).integers(0, 128, (50, 4, 2)).astype(np.uint8)
    meta, _ = write(tmp_path, data, chunk=10, shard=50, level=level, index_location=index_location)
    return meta, tmp_path / "a" / "c" / "0" / "0" / "0"


@pytest.mark.parametrize("index_location", ["start", "end"])
@pytest.mark.parametrize("level", [0, 3])
@pytest.mark.parametrize("where", ["chunk", "index", "truncated"])
def test_damage_is_corrupt_data(tmp_path, where, level, index_location):
    meta, path = _one_shard(tmp_path, level, index_location)
    blob = bytearray(path.read_bytes())
    index_bytes = ShardDecoder.of(meta).index_bytes
    chunk_byte, index_byte = (index_bytes + 5, 10) if index_location == "start" else (5, len(blob) - 10)
    if where == "chunk":
        blob[chunk_byte] ^= 0xFF
    elif where == "index":
        blob[index_byte] ^= 0x01
    else:
        blob = blob[:40]
    decoder = ShardDecoder.of(meta)
    out = np.empty(decoder.shape, decoder.dtype)
    with pytest.raises(CorruptDataError, match="test-array"):
        decoder.decode_into(out, 0, bytes(blob), "test-array")


def test_other_layouts_are_left_to_zarr(tmp_path):
    meta, _ = _one_shard(tmp_path)
    assert ShardDecoder.of(meta) is not None
    other = json.loads(json.dumps(meta))
    other["codecs"][0]["configuration"]["codecs"][1] = {"name": "blosc", "configuration": {}}
    assert ShardDecoder.of(other) is None
    other = json.loads(json.dumps(meta))
    other["chunk_key_encoding"] = {"name": "v2", "configuration": {"separator": "."}}
    assert ShardDecoder.of(other) is None
    other = json.loads(json.dumps(meta))
    other["codecs"][0]["configuration"]["index_location"] = "middle"
    assert ShardDecoder.of(other) is None
    assert ShardDecoder.of({"not": "zarr"}) is None
    meta_blosc, _ = write(tmp_path / "b", np.zeros((8, 2, 2), np.uint8), chunk=4, shard=8, level=0, compressors=[BloscCodec()])
    assert ShardDecoder.of(meta_blosc) is None


@pytest.mark.parametrize("size", [0, 1, 255, 256, 257, 65791, 65792, 393216, 5 << 20])
@pytest.mark.parametrize("level", [1, 3, 19])
def test_zstd_content_size_reads_the_frame_header(size, level):
    frame = Zstd(level).encode(np.random.default_rng(size).integers(0, 128, size).astype(np.uint8))
    assert zstd_content_size(frame) == size


def test_zstd_content_size_of_other_bytes_is_none():
    assert zstd_content_size(b"") is None
    assert zstd_content_size(b"\x28\xb5\x2f") is None
    assert zstd_content_size(b"not a zstd frame at all") is None
    # A frame header that declares no content size (descriptor 0: not single-segment, no size).
    assert zstd_content_size(b"\x28\xb5\x2f\xfd\x00\x58") is None


def test_a_frame_of_the_wrong_size_is_refused(tmp_path):
    """A chunk whose CRC holds but whose frame holds the wrong number of bytes (a writer bug)
    is refused, not decoded into the caller's rows."""
    meta, _ = _one_shard(tmp_path, level=3)
    decoder = ShardDecoder.of(meta)
    full = decoder.chunk_rows * decoder.row_bytes
    out = np.zeros(decoder.shape, decoder.dtype)
    flat = out.reshape(-1).view(np.uint8)
    for size in (full - 1, full + 1):
        body = Zstd(3).encode(np.ones(size, np.uint8))
        encoded = memoryview(body + struct.pack("<I", buffer_checksum(body)))
        with pytest.raises(CorruptDataError, match=f"decodes to {size} bytes, expected {full}"):
            decoder.decode_chunk(encoded, flat[:full], "test-chunk")


def test_contiguous_layout_only_for_contiguous_uncompressed_chunks(tmp_path):
    for level, index_location, expected in [(0, "start", True), (3, "start", False), (0, "end", False)]:
        meta, path = _one_shard(tmp_path / f"{level}{index_location}", level, index_location)
        decoder = ShardDecoder.of(meta)
        blob = path.read_bytes()
        out = np.empty(decoder.shape, decoder.dtype)
        plan = decoder.plan(out, 0, decoder.index_of(memoryview(blob)), len(blob), "test")
        assert decoder.contiguous_layout(plan, len(blob)) is expected
        if expected:
            assert not decoder.contiguous_layout(plan, len(blob) + 1)  # bytes after the last chunk
            assert not decoder.contiguous_layout(plan[1:], len(blob))  # a gap where a chunk was


@pytest.mark.parametrize("rows", [64, 57])  # whole chunks; an edge chunk the array ends inside
@pytest.mark.parametrize("run", [1, 2, 3, 8])
def test_runs_place_what_zarr_reads(tmp_path, rows, run):
    """Placing a contiguous shard run by run (what a streaming reader does) gives zarr's array,
    and a damaged chunk is refused when, and only when, its check is asked for."""
    data = np.random.default_rng(rows).integers(0, 128, (rows, 4, 2)).astype(np.uint8)
    meta, _ = write(tmp_path, data, chunk=8, shard=64, level=0)
    blob = bytearray((tmp_path / "a" / "c" / "0" / "0" / "0").read_bytes())
    decoder = ShardDecoder.of(meta)
    out = np.zeros(decoder.shape, decoder.dtype)
    plan = decoder.plan(out, 0, decoder.index_of(memoryview(blob)), len(blob), "test")
    assert decoder.contiguous_layout(plan, len(blob))
    flat = out.reshape(-1).view(np.uint8)
    for i in range(0, len(plan), run):
        decoder.place_run(memoryview(blob), plan[i : i + run], flat, [True] * len(plan[i : i + run]))
    np.testing.assert_array_equal(out, data)

    blob[plan[-1].offset + 3] ^= 0x10  # in the last chunk's rows
    out[:] = 0
    with pytest.raises(CorruptDataError, match="test: shard 0 chunk 7 fails its crc32c"):
        decoder.place_run(memoryview(blob), plan, flat, [True] * len(plan))
    decoder.place_run(memoryview(blob), plan, flat, [False] * len(plan))  # the caller's CRCs must catch it
    assert (out != data).sum() == 1


def test_rows_out_of_file_order_are_not_contiguous(tmp_path):
    meta, path = _one_shard(tmp_path, level=0)
    decoder = ShardDecoder.of(meta)
    blob = path.read_bytes()
    out = np.empty(decoder.shape, decoder.dtype)
    plan = decoder.plan(out, 0, decoder.index_of(memoryview(blob)), len(blob), "test")
    swapped = [plan[0]._replace(first_row=plan[1].first_row, end_row=plan[1].end_row), plan[1]._replace(first_row=0, end_row=10), *plan[2:]]
    assert decoder.contiguous_layout(plan, len(blob))
    assert not decoder.contiguous_layout(swapped, len(blob))
