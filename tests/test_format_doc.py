"""The zarr-python snippet in docs/FORMAT.md reads a request without r3rdma."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from r3rdma import LocalRoutingStore

DOC = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"


def snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, "docs/FORMAT.md must hold exactly one python snippet"
    return blocks[0]


def test_snippet_is_one_reader_a_stranger_can_read():
    """One reader of the whole index (snapshots, uid, parts, nodes: issue 50), not a fragment that
    fetched every part per request; still short enough to read in one sitting."""
    lines = snippet().strip().splitlines()
    assert len(lines) <= 120, len(lines)
    assert "def read_request(" in snippet() and "class RolloutReader" in snippet()


def test_snippet_reads_request_without_r3rdma(tmp_path, make_record):
    recs = [make_record(f"q{i}", rows=5 + 40 * i) for i in range(4)]
    recs.append(make_record("q1", rows=9, seed=5, start_row=45))  # a second segment
    # 8-row chunks of one layer each: the first two batches' requests span several row chunks,
    # so their arrays lie layer group major (format 4); the last one's in the index's order.
    with LocalRoutingStore(tmp_path, chunk_rows=8, min_chunk_rows=8, layers_per_chunk=1, slice_layout=True) as store:
        store.commit(recs[:2])
        store.commit(recs[2:4])
        store.commit(recs[4:])
    import json

    orders = [next(iter(json.loads((tmp_path / "roll-0" / f"i{n:08d}" / "zarr.json").read_text())["attributes"]["r3rdma"][
        "shards"].values())) for n in (1, 2, 3)]
    assert ["chunk_sizes_group_major" in shard for shard in orders] == [True, True, False]
    out = tmp_path / "q1.npy"
    program = (
        "import sys\n"
        "sys.modules['r3rdma'] = None  # prove the snippet does not need r3rdma\n"
        + snippet()
        + f"\nnp.save({str(out)!r}, read_request({str(tmp_path)!r}, 'roll-0', 'q1'))\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True)
    np.testing.assert_array_equal(np.load(out), np.concatenate([recs[1].ids_TLK, recs[4].ids_TLK]))


def _spec(name: str) -> dict:
    """The JSON block of docs/FORMAT.md whose text starts with ``{"driver": "zarr3"`` etc."""

    for block in re.findall(r"```json\n(.*?)```", DOC.read_text(), re.S):
        if f'"driver": "{name}"' in block:
            return block
    raise AssertionError(f"docs/FORMAT.md has no {name} spec")


def test_tensorstore_spec_reads_a_request_over_http_with_the_read_token(tmp_path, make_record):
    """The tensorstore specs of docs/FORMAT.md, filled in, read an index part (json driver) and
    a request's rows (zarr3 driver) from a store node over HTTP with the bearer read token."""
    import json

    import tensorstore as ts

    from r3rdma.store.process import new_token, spawn_node

    recs = [make_record(f"q{i}", rows=70 + 7 * i) for i in range(5)]
    root = tmp_path / "root"
    # 16-row chunks of one layer, slice layout: requests span several row chunks, the arrays lie layer group major.
    with LocalRoutingStore(root, chunk_rows=16, layers_per_chunk=1, slice_layout=True) as store:
        store.commit(recs[:2])
        store.commit(recs[2:])
    assert "chunk_sizes_group_major" in json.loads((root / "roll-0" / "i00000002" / "zarr.json").read_text())[
        "attributes"]["r3rdma"]["shards"]["b00000002"]
    node = spawn_node(root, new_token())
    try:
        base = f"{node.http_url}/zarr/"
        kvstore = {"driver": "http", "base_url": base, "headers": [f"Authorization: Bearer {node.read_token}"]}
        part = ts.open({"driver": "json", "kvstore": {**kvstore, "path": "roll-0/i00000002/zarr.json"},
                        "json_pointer": "/attributes/r3rdma"}).result().read().result()
        seg = part.item()["requests"]["q3"]["segments"][0]
        spec = _spec("zarr3")
        for name, value in {"http://host:port/zarr/": base, "<rollout_id>/<array>/": f"roll-0/{seg['array']}/",
                            "<read token>": node.read_token, "<offset>": str(seg["offset"]),
                            "<offset + rows>": str(seg["offset"] + seg["rows"]), "<num_layers>": "3", "<top_k>": "2"}.items():
            spec = spec.replace(name, value)
        rows = ts.open(json.loads(spec)).result().read().result()
        np.testing.assert_array_equal(np.asarray(rows), recs[3].ids_TLK)
        # Without the token the node refuses the read: the header is what makes it work.
        no_token = json.loads(spec)
        del no_token["kvstore"]["headers"]
        with __import__("pytest").raises(Exception, match="403|401|PERMISSION|denied|Forbidden"):
            ts.open(no_token).result().read().result()
    finally:
        node.stop()


def _format_1_root(root: Path, make_record) -> list:
    """A root as r3rdma wrote it before format 2: one index document per rollout."""
    import json

    import zarr

    recs = [make_record(f"q{i}", rows=10 + i) for i in range(3)]
    data = np.concatenate([r.ids_TLK for r in recs])
    zarr.create_array(zarr.storage.LocalStore(root / "roll-0" / "b00000001"), data=data, chunks=(8, 3, 2))
    requests, offset = {}, 0
    for r in recs:
        requests[r.request_id] = {"rows": r.num_rows, "start_row": 0, "segments": [
            {"array": "b00000001", "offset": offset, "rows": r.num_rows, "start_row": 0, "crc32c": r.crc32c}]}
        offset += r.num_rows
    index = {"format_version": 1, "num_layers": 3, "top_k": 2, "num_experts": recs[0].num_experts,
             "dtype": data.dtype.name, "layer_map": list(recs[0].layer_map), "arrays": ["b00000001"],
             "requests": requests}
    group = {"zarr_format": 3, "node_type": "group"}
    (root / "zarr.json").write_text(json.dumps({**group, "attributes": {"r3rdma": {"format": "r3rdma-routing", "format_version": 1}}}))
    (root / "roll-0" / "zarr.json").write_text(json.dumps({**group, "attributes": {"r3rdma": index}}))
    return recs


def test_format_1_root_is_read_and_refused_for_writing_naming_its_version(tmp_path, make_record):
    import pytest

    from r3rdma import RoutingReader
    from r3rdma.errors import StoreError

    recs = _format_1_root(tmp_path, make_record)
    with RoutingReader(tmp_path) as reader:
        assert reader.info("roll-0").request_ids == ("q0", "q1", "q2")
        got = reader.get_numpy("roll-0", ["q2", "q0"])
    np.testing.assert_array_equal(got["q2"], recs[2].ids_TLK)
    np.testing.assert_array_equal(got["q0"], recs[0].ids_TLK)
    with pytest.raises(StoreError, match="format version 1"):
        LocalRoutingStore(tmp_path)


def test_unknown_index_version_is_refused_naming_it(tmp_path, make_record):
    import json

    import pytest

    from r3rdma import CorruptDataError, RoutingReader

    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("a")])
    path = tmp_path / "roll-0" / "zarr.json"
    doc = json.loads(path.read_text())
    doc["attributes"]["r3rdma"]["format_version"] = 7
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptDataError, match="format version 7"):
        RoutingReader(tmp_path).info("roll-0")
