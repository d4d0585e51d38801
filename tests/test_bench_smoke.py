"""Benches run end to end at tiny sizes (numbers are meaningless here; the programs must work)."""

import json

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
