"""`r3rdma bench scale` end to end at a tiny size: the JSON's fields exist and agree with what
was pushed (no timed assertions: the numbers mean nothing at this size)."""

import json

import numpy as np
import pytest

from r3rdma.bench.scale_bench import run_scale_bench
from r3rdma.bench.synthetic import TiledRollout, routing_pool

FIELDS = (
    "requests", "tokens", "bytes", "ingest_gbps", "commit_ms_first", "commit_ms_last", "commit_growth",
    "dp_read_gbps", "contiguous_read_gbps", "dp_ratio", "raw_get_gbps", "index_open_ms", "single_scattered_gbps",
    "single_contiguous_gbps", "stored_bytes", "push_ms_first", "push_ms_last", "commit_curve", "push_curve",
    "commit_growth_median", "push_growth_median", "phase_seconds",
)


def test_routing_pool_rows_are_distinct_and_in_range():
    pool = routing_pool(500, num_layers=6, top_k=4, num_experts=16, base_rows=64, seed=3)
    assert pool.shape == (500, 6, 4) and pool.dtype == np.uint8 and pool.max() < 16
    assert all(len(set(row)) == 4 for row in pool.reshape(-1, 4).tolist())


def test_tiled_rollout_requests_differ():
    rollout = TiledRollout(300, min_rows=2, max_rows=5, num_layers=4, top_k=2, num_experts=8, seed=1)
    records = [rollout.record(i) for i in range(len(rollout))]
    assert len({r.crc32c for r in records}) == len(records)
    assert rollout.total_bytes == sum(r.nbytes for r in records)


@pytest.mark.timeout(120)
def test_scale_bench_tiny(tmp_path):
    from r3rdma.read.reader import RoutingReader

    requests, readers = 200, 2
    result = run_scale_bench(requests=requests, min_rows=4, max_rows=16, readers=readers, nodes=2, batch_mb=0.1,
                             micro_batch=8, read_seconds=0, root=str(tmp_path), verify=True, progress=False, rounds=2)
    json.dumps(result)  # the JSON line
    for name in FIELDS:
        assert name in result, name
    rollout = TiledRollout(requests, min_rows=4, max_rows=16, rollout_id="scale-0", seed=result["seed"])
    assert result["requests"] == requests and result["tokens"] == int(rollout.lengths.sum())
    assert result["bytes"] == rollout.total_bytes == sum(rollout.nbytes(i) for i in range(requests))
    assert result["commits"] == len(result["push_curve"]) > 1 and result["commit_curve"][0][0] == 0
    # Every reader read exactly its share: scattered shares and contiguous slices each cover it all.
    for phase in ("dp", "contiguous"):
        per = result[f"{phase}_per_reader"]
        assert len(per) == readers and result[f"{phase}_fraction"] == 1.0
        assert sum(p["requests"] for p in per) == requests and sum(p["bytes"] for p in per) == result["bytes"]
    assert [p["requests"] for p in result["dp_per_reader"]] == [requests // readers] * readers
    assert result["single_scattered_fraction"] == result["single_contiguous_fraction"] == result["raw_get_fraction"] == 1.0
    # What the readers got is what was pushed, bit for bit (their CRCs of every request read).
    assert result["verify_mismatches"] == 0 and result["verified_requests"] >= 2 * 2 * requests  # 2 rounds of both
    assert result["read_rounds"] == 2 and len(result["dp_ratio_per_round"]) == 2
    assert result["dp_ratio"] > 0 and result["raw_get_gbps"] > 0 and result["stored_bytes"] > 0
    # The nodes' data, read again from their roots on disk: a sample equals the pushed rows.
    sample = [rollout.request_id(i) for i in range(0, requests, 37)]
    with RoutingReader([tmp_path / "node0", tmp_path / "node1"], progress=False) as reader:
        got = reader.get_numpy("scale-0", sample)
    for rid in sample:
        np.testing.assert_array_equal(got[rid], rollout.ids(int(rid[1:])))


def test_plot_scale(tmp_path):
    from r3rdma.bench.plots import plot_scale

    result = {"commit_curve": [[0, 5.0], [100, 5.5]], "push_curve": [[0, 9.0], [100, 9.5]], "commit_growth": 1.1,
              "push_growth": 1.05, "nodes": 2, "readers": 2, "batch_mb": 1, "requests": 200, "bytes": 10**6,
              "dp_read_gbps": 1.0, "contiguous_read_gbps": 1.1, "single_scattered_gbps": 0.5,
              "single_contiguous_gbps": 0.6, "raw_get_gbps": 2.0, "dp_ratio": 0.91, "single_ratio": 0.83}
    path = plot_scale(result, tmp_path / "scale.png", "test")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
