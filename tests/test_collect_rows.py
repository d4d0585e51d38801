"""RoutingReader.collect(rows=..., layers=...) (issue #34): a context-parallel / pipeline rank
names its slice of each request up front; the collection fetches only the chunks holding it
and returns what get_numpy(rows=..., layers=...) returns; bad slices end it with the same
errors, raised by result()."""

import threading
import time

import numpy as np
import pytest

from r3rdma import LocalRoutingStore, RoutingReader
from r3rdma.errors import ConfigError, ShapeMismatchError
from r3rdma.read.rows import cp_row_spans
from r3rdma.records import RequestRecord
from r3rdma.store import batch_array

from .shard_fetches import count_shard_fetches

LAYER_MAP = (1, 2, 4, 5, 7, 8)  # 6 MoE layers among 9 decoder layers
LENGTHS = [300, 129, 64, 7, 200, 45]


def _record(rid, rows, seed):
    ids = np.random.default_rng(seed).integers(0, 64, size=(rows, len(LAYER_MAP), 4)).astype(np.uint8)
    return RequestRecord("roll", rid, ids, LAYER_MAP, 64)


def _records():
    return [_record(f"r{i}", rows, i) for i, rows in enumerate(LENGTHS)]


def _commit(root, records, per_commit=2, pause_s=0.0):
    with LocalRoutingStore(root, chunk_rows=32, min_chunk_rows=32) as store:
        for start in range(0, len(records), per_commit):
            store.commit(records[start : start + per_commit])
            time.sleep(pause_s)


@pytest.fixture
def grouped(monkeypatch):
    """Inner chunks of 32 rows x 3 layers: a slice of rows and of layers each skips chunks."""
    monkeypatch.setattr(batch_array, "layers_per_chunk", lambda *_: 3)


def _cp_rows(cp_size, cp_rank, names):
    """A context-parallel rank's rows of each request, padded to a multiple of 2 * cp_size."""
    out = {}
    for rid in names:
        stored = LENGTHS[int(rid[1:])]
        padded = -(-stored // (2 * cp_size)) * 2 * cp_size
        out[rid] = cp_row_spans(stored, padded, cp_size, cp_rank)
    return out


def _sliced(ids, spans, positions=None):
    rows = np.concatenate([ids[lo:hi] for lo, hi in spans]) if spans else ids[:0]
    return rows if positions is None else rows[:, positions]


def test_collect_rows_while_commits_run(tmp_path, grouped):
    records = _records()
    data = {r.request_id: r.ids_TLK for r in records}
    share = ["r4", "r0", "r3", "r1"]  # the trainer's order; r5, r2 are other ranks'
    rows = {**_cp_rows(2, 1, ["r4", "r0"]), "r3": [], "r1": [(0, 10), (120, 129)]}
    with RoutingReader(tmp_path) as reader:
        collector = reader.collect("roll", share, poll_s=0.01, rows=rows, layers=[8, 2])
        writer = threading.Thread(target=_commit, args=(tmp_path, records), kwargs={"pause_s": 0.05})
        writer.start()
        got = collector.result(timeout=30)
        packed = collector.packed()
        writer.join()
        assert list(got) == share and collector.ready == 4
        for rid in share:
            np.testing.assert_array_equal(got[rid], _sliced(data[rid], rows[rid], [5, 1]))
        assert got["r3"].shape == (0, 2, 4)
        # exactly what the reads by slice return, collected or not
        direct = reader.get_numpy("roll", share, rows=rows, layers=[8, 2])
        want = reader.get_packed("roll", share, rows=rows, layers=[8, 2])
    for rid in share:
        np.testing.assert_array_equal(got[rid], direct[rid])
    assert packed.layer_map == want.layer_map == (8, 2)
    assert packed.cu_seqlens.tolist() == want.cu_seqlens.tolist() == [0, 100, 250, 250, 269]
    assert packed.start_rows == want.start_rows
    np.testing.assert_array_equal(packed.ids_TLK.numpy(), want.ids_TLK.numpy())


def test_collect_rows_fetches_only_their_chunks(tmp_path, grouped, monkeypatch):
    _commit(tmp_path, _records(), per_commit=6)
    fetched = count_shard_fetches(monkeypatch)
    share = ["r0", "r4"]
    with RoutingReader(tmp_path) as reader, reader.collect("roll", share, poll_s=0.01) as whole:
        whole.result(timeout=30)
    whole_bytes = sum(fetched)
    fetched.clear()
    # A rank of 4 context-parallel ranks: 2 of 8 row chunks of each request (about 1/4).
    with RoutingReader(tmp_path) as reader, reader.collect("roll", share, poll_s=0.01, rows=_cp_rows(4, 0, share)) as part:
        part.result(timeout=30)
    rows_bytes = sum(fetched)
    fetched.clear()
    # ... and one pipeline stage's layers (one of 2 layer groups) of those rows.
    with RoutingReader(tmp_path) as reader:
        with reader.collect("roll", share, poll_s=0.01, rows=_cp_rows(4, 0, share), layers=[1, 2, 4]) as part:
            part.result(timeout=30)
    both_bytes = sum(fetched)
    assert 0 < rows_bytes < 0.45 * whole_bytes
    assert 0 < both_bytes < 0.65 * rows_bytes


def test_bad_slices_end_the_collection(tmp_path, grouped):
    _commit(tmp_path, _records())
    with RoutingReader(tmp_path) as reader:
        # Shape and naming: refused before anything is polled, as get_numpy refuses them.
        with pytest.raises(ConfigError, match="0 <= lo < hi"):
            reader.collect("roll", ["r0"], rows={"r0": [(5, 5)]})
        with pytest.raises(ConfigError, match="pair"):
            reader.collect("roll", ["r0"], rows={"r0": [3]})
        with pytest.raises(ConfigError, match="not read"):
            reader.collect("roll", ["r0"], rows={"r1": [(0, 5)]})
        with pytest.raises(ConfigError, match="repeat"):
            reader.collect("roll", ["r0"], layers=[1, 1])
        # Past a request's end, a layer the rollout lacks: known once the index shows them,
        # raised by result() with get_numpy's error and message.
        with pytest.raises(ShapeMismatchError) as direct:
            reader.get_numpy("roll", ["r0", "r1"], rows={"r1": [(100, 130)]})
        with reader.collect("roll", ["r0", "r1"], poll_s=0.01, rows={"r1": [(100, 130)]}) as collector:
            with pytest.raises(ShapeMismatchError, match=r"'r1' stores 129 rows \(0..128\); rows asked past its end: 100..129"):
                collector.result(timeout=30)
            assert collector.done() and collector.ready == 0
        assert "100..129" in str(direct.value)
        with reader.collect("roll", ["r0"], poll_s=0.01, layers=[1, 3], rows={"r0": [(0, 5)]}) as collector:
            with pytest.raises(ShapeMismatchError, match="no MoE layer 3"):
                collector.result(timeout=30)


def test_collect_rows_over_http(tmp_path, grouped):
    from r3rdma.store.process import new_token, spawn_node

    records = _records()
    data = {r.request_id: r.ids_TLK for r in records}
    _commit(tmp_path, records)  # the node owns its root: commit first
    node = spawn_node(tmp_path, new_token())
    try:
        share = ["r5", "r1", "r0"]
        rows = _cp_rows(2, 0, share)
        with RoutingReader(node.http_url, token=node.read_token) as reader:
            with reader.collect("roll", share, poll_s=0.01, rows=rows, layers=[4, 5, 7]) as collector:
                got = collector.result(timeout=60)
            for rid in share:
                np.testing.assert_array_equal(got[rid], _sliced(data[rid], rows[rid], [2, 3, 4]))
    finally:
        node.stop()
