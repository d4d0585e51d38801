"""Format 3: inner chunks of a group of layers; reads of some layers fetch only their chunks;
stores of format 2 (every layer in one chunk, ``chunks`` lists in the index) still read."""

import base64
import json

import numpy as np
import pytest
import zarr
from zarr.storage import LocalStore

from r3rdma import LocalRoutingStore, RoutingReader
from r3rdma.errors import ConfigError, ShapeMismatchError
from r3rdma.records import RequestRecord
from r3rdma.store import batch_array
from r3rdma.store.batch_array import layers_per_chunk
from r3rdma.store.shard_writer import encode_batch_array, write_batch_array

from .shard_fetches import count_shard_fetches

LAYER_MAP = (1, 2, 4, 5, 7, 8, 9)  # 7 MoE layers among 10 decoder layers (dense ones skipped)


def _record(rid, rows, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 64, size=(rows, len(LAYER_MAP), 4)).astype(np.uint8)
    return RequestRecord("roll", rid, ids, LAYER_MAP, 64)


@pytest.fixture
def grouped(tmp_path, monkeypatch):
    """A store whose inner chunks hold 3 layers (7 layers: groups of 3, 3 and 1 padded: the
    writer's rule makes equal groups, the format and readers allow a padded last one)."""
    # 32-row chunks x 4 x uint8 = 128 bytes per layer: 3 groups of 3 layers (the last padded).
    monkeypatch.setattr(batch_array, "layers_per_chunk", lambda *_: 3)
    recs = [_record(f"r{i}", rows, i) for i, rows in enumerate([40, 33, 70, 5, 64, 31])]
    with LocalRoutingStore(tmp_path, chunk_rows=32, min_chunk_rows=32) as store:
        store.commit(recs[:3])
        store.commit(recs[3:])
    return tmp_path, {r.request_id: r.ids_TLK for r in recs}


def _part(root, seq):
    return json.loads((root / "roll" / f"i{seq:08d}" / "zarr.json").read_bytes())["attributes"]["r3rdma"]


def test_rule_groups_layers_by_chunk_bytes():
    # 1024-row chunks of top-8 uint8 ids: 8 KiB per layer, at least 8 layers per 64 KiB chunk,
    # in a power-of-two count of equal groups (pipeline stages are equal splits).
    assert layers_per_chunk(1024, 94, 8, 1) == 47  # up to 11 groups; power-of-two divisors of 94: 1, 2
    assert layers_per_chunk(1024, 48, 8, 1) == 12  # up to 6 groups: 4 of 12 (PP=2 and PP=4 stages)
    assert layers_per_chunk(2048, 48, 8, 1) == 6  # up to 12 groups: 8 of 6
    assert layers_per_chunk(1024, 60, 8, 1) == 15  # up to 7 groups: 4 (6 divides 60 but is no power of two)
    assert layers_per_chunk(1024, 58, 8, 2) == 29  # uint16 ids, 16 KiB per layer: up to 14 groups; 2
    assert layers_per_chunk(64, 48, 8, 1) == 48  # short requests: one chunk of every layer
    assert layers_per_chunk(1024, 3, 2, 1) == 3


def test_writer_layout_reads_with_zarr(tmp_path):
    """A third-party reader (zarr-python) reads the grouped layout: padded last group included."""
    data = np.random.default_rng(0).integers(0, 200, size=(100, 7, 4)).astype(np.uint8)
    for per in (1, 3, 7):
        write_batch_array(tmp_path / f"a{per}", data, chunk_rows=32, zstd_level=3, layers_per_chunk=per)
        array = zarr.open_array(LocalStore(tmp_path / f"a{per}"), mode="r")
        assert array.chunks == (32, per, 4) and array.shards == (128, -(-7 // per) * per, 4)
        np.testing.assert_array_equal(array[:], data)
        np.testing.assert_array_equal(array[10:50, 2:5], data[10:50, 2:5])


def test_every_layer_in_one_chunk_is_the_format_2_shard():
    """layers_per_chunk = L writes the bytes format 2 wrote (the old layout, byte for byte)."""
    data = np.random.default_rng(1).integers(0, 200, size=(100, 7, 4)).astype(np.uint8)
    old = encode_batch_array([(0, data)], 100, chunk_rows=32, zstd_level=3)
    same = encode_batch_array([(0, data)], 100, chunk_rows=32, zstd_level=3, layers_per_chunk=7)
    assert old.shard == same.shard and old.metadata == same.metadata and len(old.sizes) == 4


def test_index_part_carries_chunk_sizes(grouped):
    root, _ = grouped
    shard = _part(root, 1)["shards"]["b00000001"]
    assert shard["layers_per_chunk"] == 3 and "chunks" not in shard and isinstance(shard["chunk_sizes"], str)
    entry = json.loads((root / "roll" / "zarr.json").read_bytes())["attributes"]["r3rdma"]
    assert entry["format_version"] == 3


def test_whole_and_layer_reads(grouped):
    root, data = grouped
    reader = RoutingReader(root)
    got = reader.get_numpy("roll", list(data))
    for rid, ids in data.items():
        np.testing.assert_array_equal(got[rid], ids)
    for layers in ([4, 5], range(7, 10), [9, 1], [2]):
        positions = [LAYER_MAP.index(x) for x in layers]
        got = reader.get_numpy("roll", ["r2", "r3", "r0"], layers=layers)
        for rid in ("r2", "r3", "r0"):
            np.testing.assert_array_equal(got[rid], data[rid][:, positions])
        packed = reader.get_packed("roll", ["r4", "r1"], layers=layers)
        assert packed.layer_map == tuple(layers) and packed.ids_TLK.shape[1] == len(positions)
        np.testing.assert_array_equal(packed.ids_TLK.numpy(), np.concatenate([data["r4"], data["r1"]])[:, positions])


def test_layer_read_fetches_only_its_chunks(grouped, monkeypatch):
    root, data = grouped
    fetched = count_shard_fetches(monkeypatch)
    ids = list(data)
    RoutingReader(root).get_numpy("roll", ids)
    whole = sum(fetched)
    fetched.clear()
    RoutingReader(root).get_numpy("roll", ids, layers=[1, 2, 4])  # group 0 of 3
    assert 0 < sum(fetched) < 0.5 * whole


def test_bad_layer_selections(grouped):
    root, _ = grouped
    reader = RoutingReader(root)
    with pytest.raises(ShapeMismatchError, match=r"no MoE layer 3, 10 .*asked for decoder layers \[1, 3, 10\].*stores \[1, 2, 4"):
        reader.get_numpy("roll", ["r0"], layers=[1, 3, 10])
    with pytest.raises(ShapeMismatchError, match="no MoE layer 0"):
        reader.prefetch("roll", [["r0"]], layers=range(0, 3))
    with pytest.raises(ConfigError, match="repeat"):
        reader.get_numpy("roll", ["r0"], layers=[1, 1])
    with pytest.raises(ConfigError, match="no layer"):
        reader.get_numpy("roll", ["r0"], layers=[])
    with pytest.raises(ConfigError, match="ints"):
        reader.get_numpy("roll", ["r0"], layers=["1"])


def test_prefetch_and_collect_by_layer(grouped):
    root, data = grouped
    reader = RoutingReader(root)
    with reader.prefetch("roll", [["r0", "r1"], ["r5"]], layers=[7, 8]) as batches:
        first, second = list(batches)
    np.testing.assert_array_equal(second.ids_TLK.numpy(), data["r5"][:, 4:6])
    assert first.layer_map == (7, 8)
    with reader.collect("roll", ["r2", "r4"], layers=[8, 9]) as share:
        got = share.result(timeout=30)
        packed = share.packed()
    np.testing.assert_array_equal(got["r2"], data["r2"][:, 5:7])
    assert packed.layer_map == (8, 9)


def _to_format_2(root):
    """Rewrite a store's index as format 2 wrote it: entry point version 2, ``chunks`` lists."""
    rollout = root / "roll"
    entry_path = rollout / "zarr.json"
    entry = json.loads(entry_path.read_bytes())
    entry["attributes"]["r3rdma"]["format_version"] = 2
    entry_path.write_text(json.dumps(entry))
    for part_path in rollout.glob("i*/zarr.json"):
        doc = json.loads(part_path.read_bytes())
        for name, shard in doc["attributes"]["r3rdma"].get("shards", {}).items():
            raw = (rollout / name / "c" / "0" / "0" / "0").read_bytes()
            sizes = np.frombuffer(base64.b64decode(shard.pop("chunk_sizes")), dtype="<u4")
            count = len(sizes)
            index = np.frombuffer(raw[: 16 * count], dtype="<u8").reshape(count, 2)
            shard.pop("layers_per_chunk")
            shard["chunks"] = index.astype(np.int64).reshape(-1).tolist()
        part_path.write_text(json.dumps(doc))


def test_format_2_store_still_reads(tmp_path, monkeypatch):
    """A store as format 2 wrote it (every layer in one chunk, the index's ``chunks`` lists, entry
    point version 2) reads whole and by layer."""
    monkeypatch.setattr(batch_array, "MIN_LAYER_CHUNK_BYTES", 1 << 30)  # one group: format 2's shards
    recs = [_record(f"r{i}", rows, i) for i, rows in enumerate([40, 33, 70])]
    with LocalRoutingStore(tmp_path, chunk_rows=32, min_chunk_rows=32) as store:
        store.commit(recs)
    meta = json.loads((tmp_path / "roll" / "b00000001" / "zarr.json").read_bytes())
    assert meta["codecs"][0]["configuration"]["chunk_shape"] == [32, 7, 4]
    _to_format_2(tmp_path)
    reader = RoutingReader(tmp_path)
    got = reader.get_numpy("roll", ["r0", "r1", "r2"])
    for r in recs:
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)
    np.testing.assert_array_equal(reader.get_numpy("roll", ["r2"], layers=[5, 9])["r2"], recs[2].ids_TLK[:, [3, 6]])


def test_the_store_setting_sets_the_layer_groups(tmp_path):
    """``LocalRoutingStore(layers_per_chunk=)`` (a trainer's pipeline stage size) overrides the
    rule: every batch array of the rollout is written in groups of that many layers, and a read
    of one stage's layers returns exactly their ids."""
    recs = [_record(f"s{i}", rows, 10 + i) for i, rows in enumerate([40, 33, 70])]
    with LocalRoutingStore(tmp_path, chunk_rows=32, min_chunk_rows=32, layers_per_chunk=2) as store:
        store.commit(recs)
    shards = _part(tmp_path, 1)["shards"]
    assert {entry["layers_per_chunk"] for entry in shards.values()} == {2}
    array = zarr.open_array(LocalStore(tmp_path / "roll" / next(iter(shards))), mode="r")
    assert array.chunks == (32, 2, 4)
    stage = [4, 5]  # decoder layers 4 and 5: MoE positions 2 and 3, one group
    with RoutingReader(tmp_path) as reader:
        got = reader.get_numpy("roll", ["s0", "s2"], layers=stage)
    for rid in ("s0", "s2"):
        want = next(r for r in recs if r.request_id == rid).ids_TLK[:, 2:4]
        np.testing.assert_array_equal(got[rid], want)
    with pytest.raises(ConfigError, match="layers_per_chunk must be an int >= 1"):
        LocalRoutingStore(tmp_path / "other", layers_per_chunk=0)
