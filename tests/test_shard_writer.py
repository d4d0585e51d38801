"""The hand-assembled shard of a batch array is byte for byte what zarr writes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr
from zarr.storage import LocalStore

from r3rdma.store import shard_writer
from r3rdma.store.shard_writer import SHARD_KEY, encode_batch_array, write_batch_array, write_encoded, zarr_codecs


def _pieces(seed, spans, rows):
    """Records' rows ``(offset, random [n, 6, 4] uint8)`` for ``spans`` of ``(offset, n)``, and
    the dense ``[rows, 6, 4]`` array they make with the fill value 0 elsewhere."""
    rng = np.random.default_rng(seed)
    dense = np.zeros((rows, 6, 4), dtype=np.uint8)
    arrays = []
    for offset, n in spans:
        arrays.append((offset, rng.integers(1, 64, size=(n, 6, 4), dtype=np.uint8)))
        dense[offset : offset + n] = arrays[-1][1]
    return arrays, dense

# (37, 128, 3): a batch smaller than its chunk rows after larger ones of the same geometry
# (one zarr.json template for both, its chunk rows filled in per batch).
@pytest.mark.parametrize("rows,chunk_rows,level", [(1000, 128, 3), (1024, 128, 3), (37, 128, 3), (5, 128, 1), (300, 64, 0), (1, 1, 3)])
def test_same_bytes_as_zarr(tmp_path, rows, chunk_rows, level):
    rng = np.random.default_rng(rows)
    data = rng.integers(0, 64, size=(rows, 6, 4), dtype=np.uint8)
    places = write_batch_array(tmp_path / "mine", data, chunk_rows=chunk_rows, zstd_level=level)
    chunk = min(chunk_rows, rows)
    count = -(-rows // chunk)
    zarr.create_array(LocalStore(tmp_path / "zarr"), data=data, chunks=(chunk, 6, 4),
                      shards={"shape": (count * chunk, 6, 4), "index_location": "start"},
                      compressors=zarr_codecs(level), dimension_names=("token", "layer", "k"), fill_value=0,
                      config={"write_empty_chunks": True})
    mine = (tmp_path / "mine").joinpath(*SHARD_KEY).read_bytes()
    theirs = (tmp_path / "zarr").joinpath(*SHARD_KEY).read_bytes()
    assert mine == theirs
    assert (tmp_path / "mine" / "zarr.json").read_bytes() == (tmp_path / "zarr" / "zarr.json").read_bytes()
    assert places == np.frombuffer(theirs[: 16 * count], dtype="<u8").astype(np.int64).tolist()
    np.testing.assert_array_equal(zarr.open_array(LocalStore(tmp_path / "mine"), mode="r")[:], data)


@pytest.mark.parametrize("level", [3, 0])
def test_pieces_with_fill_rows_encode_as_the_dense_array(tmp_path, level):
    """A batch is encoded from its records' own arrays: chunks inside one record, chunks shared
    by several, the fill rows between them and the last chunk's tail give the bytes zarr writes
    for the dense array."""
    rows = 501
    arrays, dense = _pieces(7, [(0, 30), (100, 150), (250, 50), (300, 60), (360, 20), (400, 100), (500, 1)], rows)
    encoded = encode_batch_array(arrays, rows, chunk_rows=100, zstd_level=level)
    write_encoded(tmp_path / "mine", encoded)
    places = write_batch_array(tmp_path / "dense", dense, chunk_rows=100, zstd_level=level)
    for key in (SHARD_KEY, ("zarr.json",)):
        assert (tmp_path / "mine").joinpath(*key).read_bytes() == (tmp_path / "dense").joinpath(*key).read_bytes()
    assert encoded.places == places and (encoded.rows, encoded.chunk_rows) == (rows, 100)
    np.testing.assert_array_equal(zarr.open_array(LocalStore(tmp_path / "mine"), mode="r")[:], dense)


@pytest.mark.parametrize("group_major", [False, True])
@pytest.mark.parametrize("per", [1, 2, 4, 6])
def test_layer_groups_same_chunks_as_zarr(tmp_path, per, group_major):
    """Format 3's layer groups (4 of 6 layers: the last group padded with the fill value) from
    pieces with fill rows between them: every inner chunk is zarr's, byte for byte, and so is
    ``zarr.json``. Only the chunks' order differs where there are several groups (zarr lays
    them out in Morton order, this writer in the index's C order or layer group major (format
    4); the index says where each is)."""
    rows, chunk = 201, 64
    arrays, dense = _pieces(per, [(0, 40), (64, 100), (170, 20), (200, 1)], rows)
    encoded = encode_batch_array(arrays, rows, chunk_rows=chunk, zstd_level=3, layers_per_chunk=per, group_major=group_major)
    write_encoded(tmp_path / "mine", encoded)
    assert encoded.group_major == (group_major and per < 6)
    count, groups = -(-rows // chunk), -(-6 // per)
    zarr.create_array(LocalStore(tmp_path / "zarr"), data=dense, chunks=(chunk, per, 4),
                      shards={"shape": (count * chunk, groups * per, 4), "index_location": "start"},
                      compressors=zarr_codecs(3), dimension_names=("token", "layer", "k"), fill_value=0,
                      config={"write_empty_chunks": True})

    def chunks(root):
        shard = root.joinpath(*SHARD_KEY).read_bytes()
        index = np.frombuffer(shard[: 16 * count * groups], dtype="<u8").reshape(count * groups, 2)
        return len(shard), [shard[int(o) : int(o + n)] for o, n in index]

    assert chunks(tmp_path / "mine") == chunks(tmp_path / "zarr")
    assert (tmp_path / "mine" / "zarr.json").read_bytes() == (tmp_path / "zarr" / "zarr.json").read_bytes()
    np.testing.assert_array_equal(zarr.open_array(LocalStore(tmp_path / "mine"), mode="r")[:], dense)


def test_short_writes_resume_where_they_stopped(tmp_path, monkeypatch):
    """A ``writev`` that writes less than it was given (the kernel may, e.g. on a signal) is
    resumed from the byte where it stopped, inside a piece or between two."""
    data = np.random.default_rng(3).integers(0, 64, size=(300, 6, 4), dtype=np.uint8)
    encoded = encode_batch_array([(0, data)], 300, chunk_rows=64, zstd_level=3, layers_per_chunk=2)
    write_encoded(tmp_path / "whole", encoded)
    calls = []

    def short_writev(fd, buffers):
        calls.append(len(buffers))
        return os.write(fd, b"".join(bytes(b) for b in buffers)[:777])  # at most 777 bytes a call

    monkeypatch.setattr(shard_writer.os, "writev", short_writev)
    write_encoded(tmp_path / "short", encoded)
    whole = (tmp_path / "whole").joinpath(*SHARD_KEY).read_bytes()
    assert (tmp_path / "short").joinpath(*SHARD_KEY).read_bytes() == whole
    assert len(calls) == -(-len(whole) // 777)


@pytest.mark.parametrize("per,group_major", [(None, False), (4, False), (4, True), (3, True)])
def test_fill_rows_and_padded_layers_are_zero_whatever_the_buffer_held(monkeypatch, per, group_major):
    """The raw chunks go to an uninitialised (or reused) buffer, not zeroed first: rows no
    piece covers (gaps, the last chunk's tail) and layers past L in the last group must still
    read as the fill value, whatever the memory held before."""
    rows, chunk = 210, 64
    arrays, dense = _pieces(11, [(3, 40), (64, 100), (170, 20), (200, 1)], rows)

    def encode(parts, level):
        return encode_batch_array(parts, rows, chunk_rows=chunk, zstd_level=level, layers_per_chunk=per, group_major=group_major)

    for level in (3, 0):
        clean = b"".join(map(bytes, encode([(0, dense)], level).shard))
        with monkeypatch.context() as m:
            m.setattr(shard_writer, "_empty", lambda shape, dtype: np.full(shape, 0xA5, dtype=dtype))
            m.setattr(shard_writer, "_raw_buffers", shard_writer._RawBuffers())
            assert b"".join(map(bytes, encode(arrays, level).shard)) == clean
            assert b"".join(map(bytes, encode(arrays, level).shard)) == clean  # a reused buffer, holding the first's bytes
