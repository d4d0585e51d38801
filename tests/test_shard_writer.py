"""The hand-assembled shard of a batch array is byte for byte what zarr writes."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from zarr.storage import LocalStore

from r3rdma.store.shard_writer import SHARD_KEY, encode_batch_array, write_batch_array, write_encoded, zarr_codecs


@pytest.mark.parametrize("rows,chunk_rows,level", [(1000, 128, 3), (1024, 128, 3), (5, 128, 1), (300, 64, 0), (1, 1, 3)])
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
    """A batch is encoded from its records' own arrays (no whole-batch copy): chunks inside one
    record, chunks shared by several, the fill rows between them and the last chunk's tail give
    the bytes zarr writes for the dense array."""
    rng = np.random.default_rng(7)
    pieces = [(0, 30), (100, 150), (250, 50), (300, 60), (360, 20), (400, 100), (500, 1)]
    rows = 501
    dense = np.zeros((rows, 6, 4), dtype=np.uint8)
    arrays = []
    for offset, n in pieces:
        arrays.append((offset, rng.integers(1, 64, size=(n, 6, 4), dtype=np.uint8)))
        dense[offset : offset + n] = arrays[-1][1]
    encoded = encode_batch_array(arrays, rows, chunk_rows=100, zstd_level=level)
    write_encoded(tmp_path / "mine", encoded)
    places = write_batch_array(tmp_path / "dense", dense, chunk_rows=100, zstd_level=level)
    for key in (SHARD_KEY, ("zarr.json",)):
        assert (tmp_path / "mine").joinpath(*key).read_bytes() == (tmp_path / "dense").joinpath(*key).read_bytes()
    assert encoded.places == places and (encoded.rows, encoded.chunk_rows) == (rows, 100)
    np.testing.assert_array_equal(zarr.open_array(LocalStore(tmp_path / "mine"), mode="r")[:], dense)
