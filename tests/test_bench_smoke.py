"""Benches run end to end at tiny sizes (numbers are meaningless here; the programs must work).

What can go wrong in a bench program, and is checked: a figure missing from its JSON, a figure
that is zero, negative, NaN or infinite (a division by an empty timing, nothing moved), the
yardstick not run (its figure absent or zero), a result that is not JSON. The figures' values
are not compared with each other where that holds by construction."""

import json
import math

from r3rdma.bench.all_bench import run_all


def _figures(result: dict, keys) -> None:
    """Each of ``keys`` is in ``result`` and a positive finite number; ``result`` is JSON."""
    json.loads(json.dumps(result, allow_nan=False))
    missing = [k for k in keys if k not in result]
    assert not missing, f"missing from the bench's JSON: {missing}"
    bad = {k: result[k] for k in keys
           if isinstance(result[k], bool) or not isinstance(result[k], (int, float)) or not math.isfinite(result[k])
           or result[k] <= 0}
    assert not bad, f"not positive finite: {bad}"


def test_bench_all_quick_writes_tables_and_pngs(tmp_path):
    summary = run_all(out=tmp_path, quick=True, skip=("transport",), capture=False, progress=False)
    assert summary["errors"] == {}
    assert set(summary["pngs"]) == {"batch_overhead"}
    for path in summary["pngs"].values():
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    tables = (tmp_path / "tables.md").read_text()
    assert "## Store ingest overhead vs writer batch size" in tables and "Machine:" in tables
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["store_batch"]) == 2  # one row per writer batch size
    _figures(results["store"], ["bytes", "ingest_gbps", "raw_zarr_gbps", "ratio"])  # raw_zarr: the yardstick ran


def test_transport_bench_tiny():
    from r3rdma.bench.transport_bench import run_transport_bench

    result = run_transport_bench(sizes_mb=(0.25, 0.5), rounds=2, iterations=1, mb_per_round=1, progress=False)
    _figures(result, ["push_gbps", "raw_ucxx_gbps", "ratio", "message_bytes"])  # raw_ucxx: the yardstick ran
    rows = result["by_size"]
    assert [r["pushes_per_round"] for r in rows] == [4, 2]  # each round moves >= mb_per_round
    assert [r["bytes"] >= mb * 1e6 for r, mb in zip(rows, (0.25, 0.5))] == [True, True]
    for r in rows:
        _figures(r, ["bytes", "requests", "push_gbps", "raw_ucxx_gbps", "ratio"])
        assert len(r["ratio_range"]) == 2 and all(x > 0 and math.isfinite(x) for x in r["ratio_range"])


def test_reliability_bench_tiny(tmp_path, capsys):
    """`r3rdma bench reliability --quick` with every older part shrunk: one JSON line with the
    older figures and the issue-19 ones, whose invariants hold."""
    import argparse

    from r3rdma.bench import reliability_bench as rb

    parser = argparse.ArgumentParser()
    rb.add_arguments(parser)
    args = parser.parse_args(["--quick", "--kill-cycles", "1", "--crash-clients", "2", "--frames", "60",
                              "--http-requests", "60", "--clients", "2", "--duration-s", "2", "--inflight-mb", "32",
                              "--workdir", str(tmp_path)])
    assert rb.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "reliability" and result["kill_cycles"] == 1
    assert result["acknowledged_lost"] == 0 and result["partial_or_corrupt_visible"] == 0 and result["crashes"] == 0
    assert result["node_lost_acked"] == 60 and result["node_lost_acked_lost"] == 0
    assert result["bad_records_tried"] > 0 and result["bad_records_refused"] == result["bad_records_tried"]
    assert result["bad_records_good_stored"] == result["bad_records_good_total"]
    assert result["tp_multiturn_turns_stored"] == result["tp_multiturn_turns"] == 2 * 3 * 3
    assert result["restart_same_port_ok"] and 0 < result["restart_same_port_s"] < 60
    assert result["stalled_typed_timeouts"] == 3 and result["stalled_announce_peak_rss_mb"] < 0.5 * result["stalled_announce_mb"]
    assert result["replicas1_ingest_mb_s"] > 0 and result["replicas2_ingest_mb_s"] > 0
    assert result["replicas2_ingest_ratio"] > 0


def test_group_bench_tiny():
    """GRPO groups through two store nodes (replicas 2): the shared layout writes exactly the rows
    that exist (prompt once per group), the whole layout the prompt once per sample; the bench
    itself refuses to report when a group reads back differently between the layouts."""
    from r3rdma.bench.group_bench import plan_groups, run_group_bench

    result = run_group_bench(groups=4, n=4, median_prompt=48, median_answer=12, layers=4, progress=False)
    plan = plan_groups(4, n=4, median_prompt=48, median_answer=12, seed=0)
    assert result["ideal_rows"] == sum(p + sum(own) for p, own in plan)
    assert result["shared"]["rows_stored_per_replica"] == result["ideal_rows"]  # counted in the nodes' arrays
    assert result["whole"]["rows_stored_per_replica"] == sum(len(own) * p + sum(own) for p, own in plan)
    assert result["shared"]["failed"] == result["whole"]["failed"] == 0
    assert result["shared"]["disk_bytes_per_replica"] < result["whole"]["disk_bytes_per_replica"]
    _figures(result, ["stored_vs_ideal", "disk_whole_vs_shared", "ingest_whole_vs_shared", "read_per_row_shared_vs_whole"])
