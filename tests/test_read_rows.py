"""Reads by row (issue #34): some rows of each request, e.g. a context-parallel rank's chunks,
fetch only the row chunks holding them; a local store and a store node over HTTP."""

import numpy as np
import pytest
from zarr.storage import LocalStore

from r3rdma import LocalRoutingStore, RoutingReader
from r3rdma.errors import ConfigError, ShapeMismatchError
from r3rdma.read.rows import cp_row_spans
from r3rdma.records import RequestRecord

LAYER_MAP = (0, 1, 2, 3)


def _record(rid, rows, seed):
    ids = np.random.default_rng(seed).integers(0, 64, size=(rows, len(LAYER_MAP), 4)).astype(np.uint8)
    return RequestRecord("roll", rid, ids, LAYER_MAP, 64)


@pytest.fixture
def stored(tmp_path):
    """Long requests in 32-row chunks (two of them in two segments, one commit each)."""
    recs = [_record(f"r{i}", rows, i) for i, rows in enumerate([300, 129, 64, 7])]
    with LocalRoutingStore(tmp_path, chunk_rows=32, min_chunk_rows=32) as store:
        store.commit(recs[:2])
        store.commit(recs[2:])
    return tmp_path, {r.request_id: r.ids_TLK for r in recs}


def _expect(data, spans):
    return {rid: np.concatenate([data[rid][lo:hi] for lo, hi in spans[rid]]) if spans.get(rid) is not None else data[rid]
            for rid in data}


def _check_reads(reader, data):
    spans = {"r0": [(0, 40), (260, 300)], "r1": range(100, 129), "r2": [(10, 11)]}  # r3 whole
    got = reader.get_numpy("roll", list(data), rows=spans)
    want = _expect(data, {**spans, "r1": [(100, 129)]})
    for rid in data:
        np.testing.assert_array_equal(got[rid], want[rid])
    # with layers too, and packed
    packed = reader.get_packed("roll", ["r0", "r1"], rows={"r0": [(5, 70)]}, layers=[1, 3])
    np.testing.assert_array_equal(packed.ids_TLK[:65].numpy(), data["r0"][5:70][:, [1, 3]])
    np.testing.assert_array_equal(packed.ids_TLK[65:].numpy(), data["r1"][:, [1, 3]])
    assert packed.cu_seqlens.tolist() == [0, 65, 65 + 129]
    # a request mapped to no span: no row of it
    assert reader.get_numpy("roll", ["r3"], rows={"r3": []})["r3"].shape == (0, 4, 4)


def test_rows_local(stored):
    root, data = stored
    _check_reads(RoutingReader(root), data)


def test_rows_over_http(stored):
    from r3rdma.store.process import new_token, spawn_node

    root, data = stored
    node = spawn_node(root, new_token())
    try:
        with RoutingReader(node.http_url, token=node.read_token) as reader:
            _check_reads(reader, data)
            with reader.prefetch("roll", [["r0", "r3"], ["r1"]], rows={"r0": [(0, 10)], "r1": [(128, 129)]}) as stream:
                first, second = list(stream)
            np.testing.assert_array_equal(first.ids_TLK.numpy(), np.concatenate([data["r0"][:10], data["r3"]]))
            np.testing.assert_array_equal(second.ids_TLK.numpy(), data["r1"][128:])
    finally:
        node.stop()


def test_rows_fetch_only_their_chunks(stored, monkeypatch):
    root, data = stored
    fetched = []
    real_get = LocalStore.get

    async def counting_get(self, key, prototype=None, byte_range=None):
        buffer = await real_get(self, key, prototype, byte_range)
        if "/c/" in key and buffer is not None:
            fetched.append(len(buffer))
        return buffer

    monkeypatch.setattr(LocalStore, "get", counting_get)
    RoutingReader(root).get_numpy("roll", ["r0"])
    whole = sum(fetched)
    fetched.clear()
    RoutingReader(root).get_numpy("roll", ["r0"], rows={"r0": [(0, 32), (288, 300)]})  # 2 of 10 row chunks
    assert 0 < sum(fetched) < 0.35 * whole


def test_bad_row_selections(stored):
    root, data = stored
    reader = RoutingReader(root)
    with pytest.raises(ShapeMismatchError, match=r"'r1' stores 129 rows \(0..128\); rows asked past its end: 100..129"):
        reader.get_numpy("roll", ["r1"], rows={"r1": [(100, 130)]})
    with pytest.raises(ShapeMismatchError, match="past its end"):
        reader.prefetch("roll", [["r0"], ["r3"]], rows={"r3": [(0, 8)]})
    with pytest.raises(ConfigError, match="0 <= lo < hi"):
        reader.get_numpy("roll", ["r0"], rows={"r0": [(5, 5)]})
    with pytest.raises(ConfigError, match="not read"):
        reader.get_numpy("roll", ["r0"], rows={"r1": [(0, 5)]})
    with pytest.raises(ConfigError, match="pair"):
        reader.get_numpy("roll", ["r0"], rows={"r0": [3]})


def test_cp_row_spans_match_megatron_split():
    torch = pytest.importorskip("torch")
    megatron = pytest.importorskip("r3rdma.integrations.megatron")
    for stored_rows, padded, cp in [(299, 304, 2), (7, 8, 2), (1, 8, 4), (100, 104, 1), (30, 32, 4)]:
        for rank in range(cp):
            positions = megatron._cp_positions(padded, cp, rank)
            want = positions[positions < stored_rows].tolist()
            got = [r for lo, hi in cp_row_spans(stored_rows, padded, cp, rank) for r in range(lo, hi)]
            assert got == want, (stored_rows, padded, cp, rank)
    batch = megatron.MicroBatch.thd(["a", "b"], [300, 8], pad_to_multiple_of=4)
    layout = megatron.ParallelLayout(cp_size=2, cp_rank=1)
    assert megatron.cp_rows([batch], layout) == {"a": [(75, 150), (150, 225)], "b": [(2, 4), (4, 6)]}
    with pytest.raises(ShapeMismatchError):
        cp_row_spans(10, 10, 2, 0)
    del torch
