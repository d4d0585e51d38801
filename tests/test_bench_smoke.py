"""Benches run end to end at tiny sizes (numbers are meaningless here; the programs must work)."""

import json

import pytest

from r3rdma.bench.all_bench import run_all
from r3rdma.bench.codec_bench import CODECS, measure, yardsticks
from r3rdma.bench.scaling_bench import run_scaling_bench
from r3rdma.bench.synthetic import synthetic_records


def test_codec_measure_and_yardsticks():
    records = synthetic_records(2, num_layers=4, top_k=2, num_experts=16, min_rows=50, max_rows=60)
    ys = yardsticks(records)
    assert ys["int32_raw"] == 4 * ys["uint8_raw"] == 4 * 8
    assert abs(ys["base64_int32"] / ys["int32_raw"] - 4 / 3) < 0.05
    by = {c.name: measure(records, c) for c in CODECS if c.name in ("none", "zstd-3", "blosc-zstd5-bitshuffle+sorted")}
    assert by["none"]["bytes_per_token"] >= ys["uint8_raw"]
    assert by["zstd-3"]["bytes_per_token"] < by["none"]["bytes_per_token"]


def test_bench_all_quick_writes_tables_and_pngs(tmp_path):
    summary = run_all(out=tmp_path, quick=True, skip=("transport", "read", "scaling"), capture=False, progress=False)
    assert summary["errors"] == {}
    assert set(summary["pngs"]) == {"batch_overhead", "codecs"}
    for path in summary["pngs"].values():
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    tables = (tmp_path / "tables.md").read_text()
    assert "## Bytes per token by codec" in tables and "Machine:" in tables
    results = json.loads((tmp_path / "results.json").read_text())
    assert {"tiny-qwen3-moe", "synthetic-skewed"} <= set(results["codecs"]["sources"])
    assert results["store"]["ratio"] > 0


def test_scaling_bench_one_node(tmp_path):
    result = run_scaling_bench(nodes=(1,), mb_per_client=0.5, batch_mb=0.25, root=str(tmp_path), progress=False)
    assert result["by_nodes"][0]["ratio"] == 1.0 and result["single_node_gbps"] > 0


def test_transport_bench_tiny():
    from r3rdma.bench.transport_bench import run_transport_bench

    result = run_transport_bench(sizes_mb=(0.25, 0.5), rounds=2, iterations=1, mb_per_round=1, progress=False)
    rows = result["by_size"]
    assert [r["pushes_per_round"] for r in rows] == [4, 2]  # each round moves >= mb_per_round
    for r in rows:
        assert r["push_gbps"] > 0 and r["raw_ucxx_gbps"] > 0
        assert r["ratio_range"][0] <= r["ratio"] <= r["ratio_range"][1]
    assert result["ratio"] == rows[-1]["ratio"]


@pytest.mark.parametrize("mode", ["warm", "fresh"])
def test_read_bench_tiny(tmp_path, mode):
    from r3rdma.bench.read_bench import run_read_bench

    for level in (0, 3):
        result = run_read_bench(requests=4, rounds=2, root=str(tmp_path / f"l{level}"), zstd_level=level, mode=mode, progress=False)
        assert result["mode"] == mode and result["zstd_level"] == level and result["files"] >= 3
        assert result["reader_gbps"] > 0 and result["ratio_range"][0] <= result["ratio"] <= result["ratio_range"][1]


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
