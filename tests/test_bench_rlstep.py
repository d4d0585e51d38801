"""`r3rdma bench rlstep` end to end at a tiny size: the JSON's fields exist and are sane, and
every trainer rank collected every request of its share with the bytes that were pushed (no
timed assertions: the numbers mean nothing at this size)."""

import json
import math

import numpy as np
import pytest

from r3rdma.bench.rlstep_bench import ROLLOUT_ID, contiguous_runs, plan_rollout, run_rlstep_bench
from r3rdma.bench.synthetic import TiledRollout, routing_pool

FIELDS = (
    "cpu_count", "rollout_seconds", "stall_seconds", "stall_vs_rollout", "stall_per_rank", "bytes_raw", "bytes_stored",
    "bytes_stored_nodes", "bytes_stored_per_replica", "ingest_gbps_per_node", "ingest_gbps_nodes",
    "offered_gbps_per_node", "index_open_ms", "index_open_ms_first", "rank_read_gbps", "scattered_read_gbps",
    "contiguous_read_gbps", "scattered_vs_contiguous", "disk_write_gbps", "zstd_gbps_all_cores", "ingest_vs_yardstick",
    "goals", "requests", "nodes", "replicas", "engines", "trainers", "rollout_seconds_planned", "phase_seconds",
    "commits", "commit_ms_first", "commit_ms_last", "commit_growth", "commit_growth_median",
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


def test_plan_rollout_is_long_tailed_and_long_requests_finish_late():
    rows, finish = plan_rollout(5000, min_rows=16, max_rows=2000, median_rows=120, sigma=1.0, rollout_seconds=20.0, seed=0)
    assert rows.min() >= 16 and rows.max() <= 2000 and 100 <= np.median(rows) <= 140
    assert rows.mean() > 1.3 * np.median(rows)  # many short, some long
    assert finish.min() >= 0 and math.isclose(finish.max(), 20.0)
    assert np.corrcoef(rows, finish)[0, 1] > 0.8
    _, at_once = plan_rollout(10, min_rows=1, max_rows=5, median_rows=2, sigma=1.0, rollout_seconds=0.0, seed=0)
    assert (at_once == 0).all()


def test_tiled_rollout_takes_explicit_lengths():
    lengths = np.array([3, 1, 7, 2])
    rollout = TiledRollout(4, min_rows=1, max_rows=7, num_layers=2, top_k=2, num_experts=8, lengths=lengths)
    assert [rollout.ids(i).shape[0] for i in range(4)] == [3, 1, 7, 2] and rollout.total_bytes == 13 * 2 * 2
    with pytest.raises(ValueError, match="lengths"):
        TiledRollout(4, min_rows=2, max_rows=7, num_layers=2, top_k=2, num_experts=8, lengths=lengths)


def test_contiguous_runs_follow_the_order_with_each_share_s_bytes():
    order = [f"r{i}" for i in range(10)]
    size = {rid: 10 for rid in order}
    runs = contiguous_runs(order, size, [30, 50, 20])
    assert [x for run in runs for x in run] == order and [len(run) for run in runs] == [3, 5, 2]


@pytest.mark.timeout(120)
def test_rlstep_bench_tiny(tmp_path):
    """What the bench reports against what the test finds itself: the nodes' roots on disk, every
    request read back from them, the clocks of the schedule it ran."""
    from r3rdma.read.reader import RoutingReader

    requests, trainers, replicas, nodes, rollout_s = 300, 3, 2, 3, 2.0
    kw = dict(min_rows=4, max_rows=64, median_rows=16, sigma=1.0, seed=0)
    result = run_rlstep_bench(requests=requests, **kw, nodes=nodes, replicas=replicas, engines=2, trainers=trainers,
                              rollout_seconds=rollout_s, batch_mb=0.2, micro_batch=8, rounds=1, root=str(tmp_path),
                              verify=True, progress=False, timeout=100)
    json.loads(json.dumps(result, allow_nan=False))  # the JSON line
    for name in FIELDS:
        assert name in result, name
    lengths, finish = plan_rollout(requests, rollout_seconds=rollout_s, **kw)
    rollout = TiledRollout(requests, min_rows=4, max_rows=64, rollout_id=ROLLOUT_ID, seed=0, lengths=lengths)
    assert result["bytes_raw"] == rollout.total_bytes and result["tokens"] == int(lengths.sum())

    # Stored bytes: the files of the rollout under each node's root, as found here.
    on_disk = [sum(f.stat().st_size for f in (tmp_path / f"node{i}" / ROLLOUT_ID).rglob("*") if f.is_file())
               for i in range(nodes)]
    assert result["bytes_stored_nodes"] == on_disk and result["bytes_stored"] == sum(on_disk) > 0
    # Each request on `replicas` nodes: the nodes' own counters saw that many copies.
    assert sum(result["node_bytes_ingested"]) == replicas * rollout.total_bytes

    # Every request pushed reads back from the roots, bit for bit; every rank got its share
    # (i % D == r) in the order named, hashed in the rank and checked against what was pushed.
    with RoutingReader([tmp_path / f"node{i}" for i in range(nodes)], progress=False) as reader:
        got = reader.get_numpy(ROLLOUT_ID, [rollout.request_id(i) for i in range(requests)])
    for i in range(requests):
        np.testing.assert_array_equal(got[rollout.request_id(i)], rollout.ids(i))
    assert result["shares_complete"] is True
    assert result["verified_requests"] == requests and result["verify_mismatches"] == 0
    assert sum(result["contiguous_bytes_per_rank"]) == rollout.total_bytes

    # The clocks: the rollout spans at least the schedule from its first finish to its last, and
    # lies within the step's wall time, as does every rank's stall after the last ack.
    step_s = result["phase_seconds"]["step"]
    assert rollout_s - finish.min() - 0.05 <= result["rollout_seconds"] <= step_s + 0.05
    assert len(result["stall_per_rank"]) == trainers and max(result["stall_per_rank"]) == result["stall_seconds"]
    assert all(-result["rollout_seconds"] <= s <= step_s - result["rollout_seconds"] + 0.05
               for s in result["stall_per_rank"])
    assert all(g > 0 for g in result["rank_read_gbps"]) and len(result["rank_read_gbps"]) == trainers
    for name in ("ingest_gbps_per_node", "scattered_read_gbps", "contiguous_read_gbps", "disk_write_gbps",
                 "zstd_gbps_all_cores", "index_open_ms", "store_commit_gbps", "commit_ms_first", "commit_ms_last",
                 "commit_growth", "commit_growth_median"):
        assert 0 < result[name] < math.inf, name
    # The commit-growth pass committed the whole rollout again, in batches of 0.2 MiB up to one request more.
    batch, largest = int(0.2 * 2**20), max(rollout.nbytes(i) for i in range(requests))
    assert rollout.total_bytes // (batch + largest) <= result["commits"] <= rollout.total_bytes // batch + 1
    assert "commit_growth" in result["goals"]


def test_cli_registers_rlstep():
    from r3rdma.cli import build_parser

    argv = ["bench", "rlstep", "--quick", "--engines", "3"]
    args = build_parser(argv).parse_args(argv)
    assert args._module == "r3rdma.bench.rlstep_bench" and args.quick and args.engines == 3
