"""The reader example of docs/FORMAT.md, run as written, against stores r3rdma wrote.

Each case compares what the example reads with ``RoutingReader.get_numpy`` bit for bit, and
checks that an unknown request raises KeyError: several commits with an index snapshot (parts
it covers removed, so only the snapshot can answer), both layouts (default and slice layout),
padded layer groups and no zstd, shared prefixes, two store node roots holding replicas cut
into different segments, and a format-1 index.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from r3rdma import LocalRoutingStore, RoutingReader
from r3rdma.records import RequestRecord, SharedPrefix
from r3rdma.store.rollout_index import load_index, read_file
from r3rdma.write.writer import RoutingWriter

DOC = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"
MARKER = "# FORMAT.md reader example"
ROLLOUT = "roll-0"


def example_source() -> str:
    """The fenced python block of docs/FORMAT.md that starts with the marker comment."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if b.startswith(MARKER)]
    assert len(blocks) == 1, f"docs/FORMAT.md must hold one python block starting with {MARKER!r}"
    return blocks[0]


def load_example() -> dict:
    """The example executed in a namespace of its own (its imports checked: no r3rdma)."""
    source = example_source()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"numpy", "zarr", "json", "base64", "struct", "collections", "itertools"}, imported
    namespace: dict = {"__name__": "format_doc_example"}
    exec(compile(source, str(DOC), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def example() -> dict:
    """The example's namespace (RolloutReader, read_request)."""
    return load_example()


def _record(request_id, ids, *, start_row=0, layers=None, shared_prefix=None, rollout_id=ROLLOUT):
    layer_map = tuple(range(ids.shape[1])) if layers is None else layers
    return RequestRecord(rollout_id, request_id, ids, layer_map, 16, start_row=start_row, shared_prefix=shared_prefix)


def _ids(rng, rows, layers=3, k=2):
    return rng.integers(0, 16, size=(rows, layers, k)).astype(np.uint8)


def _check(example, roots, request_ids, rollout_id=ROLLOUT):
    """The example reads every request as RoutingReader does, bit for bit; unknown ids raise KeyError."""
    reader = example["RolloutReader"]([str(r) for r in roots], rollout_id)
    with RoutingReader([str(r) for r in roots]) as ours:
        want = ours.get_numpy(rollout_id, request_ids)
    for rid in request_ids:
        got = reader.read(rid)
        assert got.dtype == want[rid].dtype and got.shape == want[rid].shape, rid
        assert got.tobytes() == want[rid].tobytes(), rid
    with pytest.raises(KeyError, match="not committed"):
        reader.read("no-such-request")
    return reader


def _entry(root: Path, rollout_id=ROLLOUT) -> dict:
    return json.loads((root / rollout_id / "zarr.json").read_text())["attributes"]["r3rdma"]


def _shards(root: Path, rollout_id=ROLLOUT) -> dict:
    out = {}
    for part in sorted((root / rollout_id).glob("i*")):
        out.update(json.loads((part / "zarr.json").read_text())["attributes"]["r3rdma"].get("shards", {}))
    return out


def test_snapshot_parts_turns_and_replaced_entries(tmp_path, example):
    """Snapshot, then parts after it (a later turn replaces an entry the snapshot holds)."""
    rng = np.random.default_rng(1)
    root = tmp_path / "root"
    ids = {f"r{i}": _ids(rng, 5 + 3 * i) for i in range(12)}
    turn2 = _ids(rng, 7)
    with LocalRoutingStore(root, snapshot_parts=8, snapshot_idle_s=60) as store:
        for i in range(10):
            store.commit([_record(f"r{i}", ids[f"r{i}"])])
        deadline = time.monotonic() + 20
        while not _entry(root).get("snapshot") and time.monotonic() < deadline:
            time.sleep(0.02)
        snapshot = _entry(root).get("snapshot")
        assert snapshot, "no snapshot was taken"
        # After the snapshot: a later turn (a second segment) of a request the snapshot holds.
        store.commit([_record("r0", turn2, start_row=5), _record("r10", ids["r10"])])
        store.commit([_record("r11", ids["r11"])])
    entry = _entry(root)
    assert entry["snapshot"] >= snapshot and entry["parts"] > entry["snapshot"]
    # Only the snapshot can answer for the parts it covers.
    for n in range(1, entry["snapshot"] + 1):
        shutil.rmtree(root / ROLLOUT / f"i{n:08d}")
    reader = _check(example, [root], sorted(ids))
    np.testing.assert_array_equal(reader.read("r0"), np.concatenate([ids["r0"], turn2]))
    with pytest.raises(KeyError, match="none of the"):
        example["RolloutReader"]([str(root)], "no-such-rollout")


@pytest.mark.parametrize("slice_layout", [False, True])
def test_both_layouts_padded_layer_groups_and_no_zstd(tmp_path, example, slice_layout):
    """Default and slice layout (layer group major), a padded last layer group, zstd off."""
    rng = np.random.default_rng(2)
    root = tmp_path / "root"
    # 7 layers in groups of 3: the last group padded (the shard spans 9 layers).
    long = {f"l{i}": _ids(rng, 300 + 17 * i, layers=7) for i in range(5)}
    short = {f"s{i}": _ids(rng, 3 + i, layers=7) for i in range(6)}
    with LocalRoutingStore(root, chunk_rows=64, min_chunk_rows=8, layers_per_chunk=3, slice_layout=slice_layout) as store:
        store.commit([_record(r, a) for r, a in long.items()])
        store.commit([_record(r, a) for r, a in short.items()])
    with LocalRoutingStore(tmp_path / "raw", zstd_level=0, layers_per_chunk=3, slice_layout=slice_layout) as store:
        store.commit([_record(r, a) for r, a in {**long, **short}.items()])
    shards = _shards(root)
    assert all(s["layers_per_chunk"] == 3 for s in shards.values())
    assert ("chunk_sizes_group_major" in shards["b00000001"]) is slice_layout
    assert "chunk_sizes" in shards["b00000002"]  # short requests: the index's order either way
    assert not any(s["zstd"] for s in _shards(tmp_path / "raw").values())
    for r in (root, tmp_path / "raw"):
        reader = _check(example, [r], sorted({**long, **short}))
        for rid, a in {**long, **short}.items():
            np.testing.assert_array_equal(reader.read(rid), a)


def _sample(request_id, whole, prefix_rows, source="src"):
    return _record(
        request_id,
        whole[prefix_rows:],
        start_row=prefix_rows,
        shared_prefix=SharedPrefix(source, prefix_rows, whole[:prefix_rows].copy()),
    )


def test_shared_prefixes(tmp_path, example):
    """Samples whose first rows are segments of their source's (itself a sample: a chain)."""
    rng = np.random.default_rng(3)
    root = tmp_path / "root"
    src = _ids(rng, 40)
    s1 = np.concatenate([src[:25], _ids(rng, 9)])
    s2 = np.concatenate([s1[:30], _ids(rng, 4)])  # shares rows of a sample that shares rows itself
    with LocalRoutingStore(root) as store:
        store.commit([_record("src", src[:20])])
        store.commit([_record("src", src[20:], start_row=20)])  # the prompt in two segments
        store.commit([_sample("s1", s1, 25), _sample("s2", s2, 30, source="s1")])
    part = json.loads((root / ROLLOUT / "i00000003" / "zarr.json").read_text())["attributes"]["r3rdma"]
    segments = part["requests"]["s1"]["segments"]
    assert [s["array"] for s in segments[:2]] == ["b00000001", "b00000002"]  # the source's rows, by reference
    reader = _check(example, [root], ["src", "s1", "s2"])
    np.testing.assert_array_equal(reader.read("s1"), s1)
    np.testing.assert_array_equal(reader.read("s2"), s2)


def test_two_node_roots_with_replicas_cut_differently(tmp_path, example):
    """Node roots holding a share each, replicas (one stored by reference on one node, inline
    on the other), and a root without the rollout; either root order."""
    rng = np.random.default_rng(4)
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    src = _ids(rng, 30)
    whole = np.concatenate([src[:12], _ids(rng, 6)])
    only_a, only_b, both = _ids(rng, 9), _ids(rng, 11), _ids(rng, 13)
    with LocalRoutingStore(node_a) as store:  # s by reference to src
        store.commit([_record("src", src), _record("a", only_a)])
        store.commit([_sample("s", whole, 12), _record("both", both)])
    with LocalRoutingStore(node_b) as store:  # no src here: the writer stores s inline
        store.commit([_record("b", only_b), _record("both", both)])
        with RoutingWriter(store, flush_bytes=1 << 20) as writer:
            writer.submit(_sample("s", whole, 12))
            writer.flush(timeout=60)
            assert writer.failed_requests() == []
    (empty := tmp_path / "node-c").mkdir()  # a node holding none of the rollout
    with LocalRoutingStore(empty) as store:
        store.commit([_record("x", only_a, rollout_id="other")])
    ids = ["src", "a", "b", "both", "s"]
    for roots in ([node_a, node_b, empty], [node_b, node_a]):
        reader = _check(example, roots, ids)
        np.testing.assert_array_equal(reader.read("s"), whole)
        np.testing.assert_array_equal(reader.read("b"), only_b)


def test_format_1_index(tmp_path, example):
    """The whole index in the entry point (format 1), no parts."""
    rng = np.random.default_rng(5)
    root = tmp_path / "root"
    ids = {f"r{i}": _ids(rng, 4 + i) for i in range(3)}
    with LocalRoutingStore(root) as store:
        for rid, a in ids.items():
            store.commit([_record(rid, a)])
    # The same rollout as format 1 wrote it: the whole index in the entry point, no parts.
    index = load_index(ROLLOUT, read_file(root / ROLLOUT), "test")
    doc = {**index.as_format_1(), "format_version": 1}
    path = root / ROLLOUT / "zarr.json"
    group = json.loads(path.read_text())
    group["attributes"]["r3rdma"] = doc
    path.write_text(json.dumps(group))
    for part in (root / ROLLOUT).glob("[is]0*"):
        shutil.rmtree(part)
    reader = _check(example, [root], sorted(ids))
    for rid, a in ids.items():
        np.testing.assert_array_equal(reader.read(rid), a)
