"""The hand-assembled shard of a batch array is byte for byte what zarr writes."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from zarr.storage import LocalStore

from r3rdma.store.shard_writer import SHARD_KEY, write_batch_array, zarr_codecs


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
