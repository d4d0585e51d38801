"""Format 3: inner chunks of a group of layers; reads of some layers fetch only their chunks;
format 4: arrays of long requests lie layer group major in their shard; stores of format 2
(every layer in one chunk, ``chunks`` lists in the index) and 3 (every shard in the index's
order) still read."""

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
from r3rdma.store.batch_array import batch_chunk_rows, layers_per_chunk, spans_row_chunks
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
    # Laid out layer group major (long requests): 16 KiB chunks, at most 8 groups.
    assert layers_per_chunk(256, 48, 8, 1, True) == 12  # 96 KiB per row chunk: up to 6 groups: 4 of 12
    assert layers_per_chunk(128, 48, 8, 1, True) == 24  # 48 KiB: up to 3: 2 of 24
    assert layers_per_chunk(1024, 48, 8, 1, True) == 6  # up to 24 groups, at most 8: 8 of 6
    assert layers_per_chunk(128, 94, 8, 1, True) == 47  # up to 5; power-of-two divisors of 94: 1, 2


def _records_of(lengths, layers=48, top_k=8):
    return [RequestRecord("roll", f"r{i}", np.zeros((n, layers, top_k), np.uint8), tuple(range(layers)), 128)
            for i, n in enumerate(lengths)]


def test_rule_sizes_row_chunks_for_context_parallel_pieces():
    """Short requests: a chunk about one request (the power of two at or above the median).
    Long ones (a median of four chunks or more): a sixteenth of the median, not below 256 rows
    of 48 layers x top-8 uint8 (four 16 KiB layer groups), so CP pieces waste little at their edges."""
    def rows(*lengths, **geometry):
        return batch_chunk_rows(_records_of(lengths, **geometry), 64, 1024, slice_layout=True)

    assert rows(30, 50, 40) == 64 and rows(100, 120, 90) == 128 and rows(300, 250, 310) == 512
    assert rows(800, 900, 700) == 1024  # 256-row chunks would not give a request four of them
    assert rows(1100, 1000, 1200) == 256 and rows(4300, 3000, 8000) == 256
    assert rows(9000, 8200, 9900) == 512 and rows(40000, 33000, 50000) == 1024  # capped at chunk_rows
    assert rows(3000, 3000, 3000, layers=94) == 128  # 752-byte rows: 128 rows make four 16 KiB groups
    assert spans_row_chunks(256, 1024) and not spans_row_chunks(256, 1023)


def test_whole_request_layout_keeps_a_chunk_about_one_request():
    """Without the store's ``slice_layout`` (``--no-slice-layout``) long requests keep chunks
    about one request long (whole-request reads: one GET, few zstd frames)."""
    for lengths, want in (((30, 50, 40), 64), ((1100, 1000, 1200), 1024), ((4300, 3000, 8000), 1024)):
        assert batch_chunk_rows(_records_of(lengths), 64, 1024, slice_layout=False) == want


@pytest.mark.parametrize("group_major", [False, True])
def test_writer_layout_reads_with_zarr(tmp_path, group_major):
    """A third-party reader (zarr-python) reads the grouped layout, in the index's order and
    layer group major: padded last group included."""
    data = np.random.default_rng(0).integers(0, 200, size=(100, 7, 4)).astype(np.uint8)
    for per in (1, 3, 7):
        write_batch_array(
            tmp_path / f"a{per}", data, chunk_rows=32, zstd_level=3, layers_per_chunk=per, group_major=group_major
        )
        array = zarr.open_array(LocalStore(tmp_path / f"a{per}"), mode="r")
        assert array.chunks == (32, per, 4) and array.shards == (128, -(-7 // per) * per, 4)
        np.testing.assert_array_equal(array[:], data)
        np.testing.assert_array_equal(array[10:50, 2:5], data[10:50, 2:5])


def test_group_major_shard_lies_group_by_group():
    """Layer group major: each group's row chunks back to back in row order, groups one after
    another; the shard index (C order over the chunk grid) says where each chunk is."""
    data = np.random.default_rng(2).integers(0, 200, size=(100, 6, 4)).astype(np.uint8)
    encoded = encode_batch_array([(0, data)], 100, chunk_rows=32, zstd_level=3, layers_per_chunk=2, group_major=True)
    index = np.asarray(encoded.places).reshape(4, 3, 2)  # [row chunk, group, (offset, nbytes)]
    by_group = index.transpose(1, 0, 2).reshape(-1, 2)  # the order written
    assert by_group[0, 0] == 16 * 12 + 4 and (by_group[1:, 0] == by_group[:-1].sum(axis=1)).all()
    assert encoded.group_major and encoded.sizes.tolist() == by_group[:, 1].tolist()
    assert encode_batch_array([(0, data)], 100, chunk_rows=32, zstd_level=3, group_major=True).group_major is False  # one group


def test_every_layer_in_one_chunk_is_the_format_2_shard():
    """layers_per_chunk = L writes the bytes format 2 wrote (the old layout, byte for byte)."""
    data = np.random.default_rng(1).integers(0, 200, size=(100, 7, 4)).astype(np.uint8)
    old = encode_batch_array([(0, data)], 100, chunk_rows=32, zstd_level=3)
    same = encode_batch_array([(0, data)], 100, chunk_rows=32, zstd_level=3, layers_per_chunk=7)
    assert b"".join(old.shard) == b"".join(same.shard) and old.metadata == same.metadata and len(old.sizes) == 4


def test_index_part_carries_chunk_sizes(grouped):
    root, _ = grouped
    shard = _part(root, 1)["shards"]["b00000001"]
    assert shard["layers_per_chunk"] == 3 and "chunks" not in shard and isinstance(shard["chunk_sizes"], str)
    assert "chunk_sizes_group_major" not in shard  # short requests: the index's order
    entry = json.loads((root / "roll" / "zarr.json").read_bytes())["attributes"]["r3rdma"]
    assert entry["format_version"] == 4


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


def _to_format_3(root):
    """Rewrite a store's entry point as format 3 wrote it (its shards in the index's order)."""
    path = root / "roll" / "zarr.json"
    entry = json.loads(path.read_bytes())
    entry["attributes"]["r3rdma"]["format_version"] = 3
    path.write_text(json.dumps(entry))


def test_format_3_store_still_reads(grouped):
    """A store as format 3 wrote it (entry point version 3, ``chunk_sizes`` in the index's order)
    reads whole, by layer and by rows."""
    root, data = grouped
    for seq in (1, 2):
        assert all("chunk_sizes" in shard for shard in _part(root, seq)["shards"].values())
    _to_format_3(root)
    reader = RoutingReader(root)
    got = reader.get_numpy("roll", list(data))
    for rid, ids in data.items():
        np.testing.assert_array_equal(got[rid], ids)
    got = reader.get_numpy("roll", ["r2", "r0"], layers=[5, 9], rows={"r2": [(3, 40), (60, 70)]})
    np.testing.assert_array_equal(got["r2"], np.concatenate([data["r2"][3:40], data["r2"][60:70]])[:, [3, 6]])
    np.testing.assert_array_equal(got["r0"], data["r0"][:, [3, 6]])


@pytest.fixture
def long_requests(tmp_path, monkeypatch):
    """A store of requests spanning several row chunks: 16-row chunks of 3 layers (groups of
    3, 3 and 1 padded), laid out layer group major; and one batch of short requests (the index's
    order) in the same rollout."""
    monkeypatch.setattr(batch_array, "layers_per_chunk", lambda *_: 3)
    lengths = [70, 90, 64, 100, 81, 5, 9, 12]
    recs = [_record(f"r{i}", rows, 20 + i) for i, rows in enumerate(lengths)]
    with LocalRoutingStore(tmp_path, chunk_rows=16, min_chunk_rows=16, slice_layout=True) as store:
        store.commit(recs[:5])
        store.commit(recs[5:])
    return tmp_path, {r.request_id: r.ids_TLK for r in recs}


def test_group_major_index_part_and_version(long_requests):
    """The part names the order by its key: a reader of format 3 (which knows ``chunk_sizes``
    and format 2's ``chunks`` only) finds neither and refuses the part, never reading the sizes
    in the index's order; and the entry point's version 4 is refused by it first."""
    root, _ = long_requests
    long_shard = _part(root, 1)["shards"]["b00000001"]
    assert set(long_shard) == {"rows", "chunk_rows", "layers_per_chunk", "zstd", "chunk_sizes_group_major"}
    assert long_shard["chunk_rows"] == 16 and long_shard["layers_per_chunk"] == 3
    assert "chunk_sizes" in _part(root, 2)["shards"]["b00000002"]  # short requests: the index's order
    entry = json.loads((root / "roll" / "zarr.json").read_bytes())["attributes"]["r3rdma"]
    assert entry["format_version"] == 4
    shard = (root / "roll" / "b00000001" / "c" / "0" / "0" / "0").read_bytes()
    count = -(-long_shard["rows"] // 16)
    index = np.frombuffer(shard[: 16 * count * 3], dtype="<u8").reshape(count, 3, 2)
    assert index[1, 0, 0] == index[0, 0].sum() and index[0, 1, 0] == index[-1, 0].sum()  # group 0's chunks, then group 1's


def test_group_major_reads(long_requests):
    """Whole, by layer, by rows and both: the same ids as written; zarr-python reads the array."""
    root, data = long_requests
    reader = RoutingReader(root)
    got = reader.get_numpy("roll", list(data))
    for rid, ids in data.items():
        np.testing.assert_array_equal(got[rid], ids)
    for layers in ([4, 5], [9], [1, 9, 7]):
        positions = [LAYER_MAP.index(x) for x in layers]
        rows = {"r1": [(3, 20), (40, 88)], "r4": [(70, 81)]}
        got = reader.get_numpy("roll", ["r1", "r4", "r3", "r6"], layers=layers, rows=rows)
        np.testing.assert_array_equal(got["r1"], np.concatenate([data["r1"][3:20], data["r1"][40:88]])[:, positions])
        np.testing.assert_array_equal(got["r4"], data["r4"][70:81, positions])
        np.testing.assert_array_equal(got["r3"], data["r3"][:, positions])
        np.testing.assert_array_equal(got["r6"], data["r6"][:, positions])
    array = zarr.open_array(LocalStore(root / "roll" / "b00000001"), mode="r")
    assert array.chunks == (16, 3, 4)
    for rid, entry in _part(root, 1)["requests"].items():
        (seg,) = entry["segments"]
        np.testing.assert_array_equal(array[seg["offset"] : seg["offset"] + seg["rows"]], data[rid])
        np.testing.assert_array_equal(array[seg["offset"] + 5 : seg["offset"] + 50, 3:6], data[rid][5:50, 3:6])


def test_group_major_stage_read_is_one_get_per_request(long_requests, monkeypatch):
    """A stage's chunks over a request's rows touch in the file: a read of one layer group of
    a request spanning several row chunks is one GET (its bytes only); a whole read is one GET
    per layer group, not the bytes between them."""
    root, data = long_requests
    reader = RoutingReader(root)
    reader.get_numpy("roll", ["r0"])  # shard indexes and metadata, before counting
    fetched = count_shard_fetches(monkeypatch)
    got = reader.get_numpy("roll", ["r3"], layers=[1, 2, 4])  # group 0 of r3's 100 rows: 7 row chunks
    np.testing.assert_array_equal(got["r3"], data["r3"][:, :3])
    assert len(fetched) == 1
    one_group = fetched.pop()
    reader.get_numpy("roll", ["r3"])
    assert len(fetched) == 3 and sum(fetched) < 3.5 * one_group


@pytest.mark.parametrize("zstd_level", [0, 3])
def test_group_major_runs_decode_and_detect_a_bad_chunk(tmp_path, monkeypatch, zstd_level):
    """A run of one group's chunks is decoded into one block: compressed or not, the rows come
    back; a chunk damaged in the middle of a run fails its CRC-32C, naming it."""
    from r3rdma.errors import CorruptDataError

    monkeypatch.setattr(batch_array, "layers_per_chunk", lambda *_: 3)
    recs = [_record(f"z{i}", rows, 40 + i) for i, rows in enumerate([100, 96, 120])]
    with LocalRoutingStore(tmp_path, chunk_rows=16, min_chunk_rows=16, zstd_level=zstd_level, slice_layout=True) as store:
        store.commit(recs)
    assert "chunk_sizes_group_major" in _part(tmp_path, 1)["shards"]["b00000001"]
    got = RoutingReader(tmp_path).get_numpy("roll", ["z1", "z2"], layers=[4, 5], rows={"z1": [(1, 95)], "z2": [(0, 30), (50, 51)]})
    np.testing.assert_array_equal(got["z1"], recs[1].ids_TLK[1:95, 2:4])
    np.testing.assert_array_equal(got["z2"], np.concatenate([recs[2].ids_TLK[0:30], recs[2].ids_TLK[50:51]])[:, 2:4])
    shard_path = tmp_path / "roll" / "b00000001" / "c" / "0" / "0" / "0"
    shard = bytearray(shard_path.read_bytes())
    count = -(-_part(tmp_path, 1)["shards"]["b00000001"]["rows"] // 16)
    index = np.frombuffer(bytes(shard[: 16 * count * 3]), dtype="<u8").reshape(count, 3, 2)
    offset, _ = index[3, 0]  # row chunk 3 of group 0: inside request z0's run
    shard[int(offset) + 2] ^= 0xFF
    shard_path.write_bytes(bytes(shard))
    with pytest.raises(CorruptDataError, match="chunk 9 fails its crc32c"):
        RoutingReader(tmp_path).get_numpy("roll", ["z0"], layers=[1, 2])


def test_group_major_uint16_ids(tmp_path, monkeypatch):
    """Ids of more than 256 experts (uint16) in a layer-group-major array: runs decoded into one
    block keep their dtype."""
    monkeypatch.setattr(batch_array, "layers_per_chunk", lambda *_: 2)
    rng = np.random.default_rng(9)
    recs = [
        RequestRecord("roll", f"w{i}", rng.integers(0, 1000, size=(rows, len(LAYER_MAP), 4)).astype(np.uint16), LAYER_MAP, 1000)
        for i, rows in enumerate([80, 70, 90])
    ]
    with LocalRoutingStore(tmp_path, chunk_rows=16, min_chunk_rows=16, slice_layout=True) as store:
        store.commit(recs)
    assert "chunk_sizes_group_major" in _part(tmp_path, 1)["shards"]["b00000001"]
    with RoutingReader(tmp_path) as reader:
        got = reader.get_numpy("roll", ["w0", "w2"])
        part = reader.get_numpy("roll", ["w1"], layers=[4, 5, 7], rows={"w1": [(5, 69)]})
    for r in (recs[0], recs[2]):
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)
    np.testing.assert_array_equal(part["w1"], recs[1].ids_TLK[5:69, 2:5])


def test_group_major_entry_gives_the_shard_index():
    """An index part's group-major sizes give the shard index the writer wrote (offsets in the
    index's order); an entry with both size keys, or sizes not whole row chunks, is malformed."""
    from r3rdma.read.shard_ranges import shard_index_of
    from r3rdma.store.index_entries import shard_entry, shard_entry_ok

    data = np.random.default_rng(4).integers(0, 200, size=(100, 6, 4)).astype(np.uint8)
    for group_major in (False, True):
        encoded = encode_batch_array([(0, data)], 100, chunk_rows=16, zstd_level=3, layers_per_chunk=2, group_major=group_major)
        entry = shard_entry(encoded.rows, encoded.chunk_rows, 2, True, encoded.sizes, encoded.group_major)
        assert shard_entry_ok(entry) and ("chunk_sizes_group_major" in entry) == group_major
        assert shard_index_of(entry).astype(np.int64).reshape(-1).tolist() == encoded.places
    both = {**entry, "chunk_sizes": entry["chunk_sizes_group_major"]}
    assert not shard_entry_ok(both)
    short = {**entry, "chunk_sizes_group_major": entry["chunk_sizes_group_major"][:-8]}
    assert not shard_entry_ok(short)


def test_slice_layout_is_the_default(tmp_path):
    """A new store gets the slice layout unless told otherwise (``LocalRoutingStore``,
    ``R3Config``, ``r3rdma-store``: ``--slice-layout`` still accepted, ``--no-slice-layout`` the
    whole-request layout), so a batch of long requests lies layer group major; without it the
    same batch lies in the index's order. The reader reads both."""
    from r3rdma.config import R3Config
    from r3rdma.store.cli import build_parser

    def parsed(*flags):
        return build_parser().parse_args(["--root", str(tmp_path / "node"), *flags]).slice_layout

    assert parsed() is True and parsed("--slice-layout") is True and parsed("--no-slice-layout") is False
    assert R3Config().slice_layout is True
    recs = [_record(f"r{i}", rows, 40 + i) for i, rows in enumerate([300, 280, 320])]
    for name, options, key in (("slice", {}, "chunk_sizes_group_major"), ("whole", {"slice_layout": False}, "chunk_sizes")):
        with LocalRoutingStore(tmp_path / name, chunk_rows=16, min_chunk_rows=16, layers_per_chunk=3, **options) as store:
            assert store.slice_layout is (name == "slice")
            store.commit(recs)
        assert key in _part(tmp_path / name, 1)["shards"]["b00000001"]
        with RoutingReader(tmp_path / name) as reader:
            got = reader.get_numpy("roll", [r.request_id for r in recs])
        for r in recs:
            np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)
