"""`r3rdma bench trainer-layout` at a tiny size: its JSON line, and what it counts adds up."""

import json

from r3rdma.bench.trainer_layout_bench import cp_spans, run_trainer_layout_bench


def test_layout_helpers():
    # 10 stored rows + the unrecorded tail = 11 tokens, padded to 12, chunks of 3
    assert cp_spans(10, 2, 0) == [(0, 3), (9, 10)] and cp_spans(10, 2, 1) == [(3, 6), (6, 9)]
    assert cp_spans(10, 1, 0) == [(0, 10)]


def test_bench_small_run():
    # 64-row chunks of 4 layers (--chunk-rows, --layers-per-chunk), the store's default slice
    # layout: requests of 300-400 rows span several row chunks, so every array lies layer group
    # major (format 4).
    result = run_trainer_layout_bench(
        requests=8,
        min_rows=300,
        max_rows=400,
        batch_mb=0.2,
        processes=2,
        dp=2,
        tp=2,
        pp=2,
        cp=2,
        layers=8,
        micro_batch=2,
        progress=False,
        chunk_rows=64,
        layers_per_chunk=4,
    )
    assert result["chunk_rows"] == [64] and result["layers_per_chunk"] == [4] and result["slice_layout"] is True
    assert result["group_major_arrays"] == result["arrays"] > 0
    json.dumps(result)
    assert result["bench"] == "trainer-layout" and result["layout"] == {"dp": 2, "tp": 2, "pp": 2, "cp": 2}
    for name, readers in (("whole", 16), ("per_rank", 16), ("tp_broadcast", 8), ("sequence_parallel", 16)):
        phase = result[name]
        assert phase["reading_ranks"] == len(phase["fetched_vs_replayed"]) == readers
        assert phase["fetched_bytes"] == phase["node_http_bytes"] > 0  # the ranks' counts are what the node served
        assert phase["wall_seconds"] > 0 and phase["reader_cpu_s_per_gb"] > 0
    # a slice returns exactly what the rank replays; whole reads return every layer and row
    assert result["per_rank"]["returned_bytes"] == result["per_rank"]["replayed_bytes"]
    # under sequence parallel too, and the ranks' shares (stage x TP x CP) of a DP share tile it:
    # over the whole trainer every stored row of every layer comes back exactly once
    sp = result["sequence_parallel"]
    assert sp["returned_bytes"] == sp["replayed_bytes"] == result["decoded_bytes"]
    assert sp["fetched_bytes"] < result["per_rank"]["fetched_bytes"]
    assert result["whole"]["returned_bytes"] == result["decoded_bytes"] // 2 * 16
    yard = result["yardstick"]  # the same reads by r3rdma's reader and by tensorstore return the same bytes
    assert yard["r3rdma"]["whole_bytes"] == yard["tensorstore"]["whole_bytes"] > 0  # DP rank 0's share
    assert yard["r3rdma"]["slice_bytes"] == yard["tensorstore"]["slice_bytes"] > 0
    assert yard["r3rdma"]["whole_bytes"] > 2 * yard["r3rdma"]["slice_bytes"]  # half the layers (PP=2), about half the rows (CP=2)
    assert all(yard[r][f"{k}_cpu_s_per_gb"] > 0 for r in ("r3rdma", "tensorstore") for k in ("whole", "slice"))
    assert result["whole"]["fetched_bytes"] > result["per_rank"]["fetched_bytes"] > result["tp_broadcast"]["fetched_bytes"]
    assert set(result["goals"]) == {
        "per_rank_fetch_le_1_25x_replayed",
        "tp_broadcast_fetch_le_1_25x_replayed",
        "per_rank_total_le_1_25x_stored_x_tp",
        "tp_broadcast_total_le_1_25x_stored",
        "reader_cpu_le_1_5_core_s_per_gb",
        "sequence_parallel_fetch_le_1_25x_replayed",
        "sequence_parallel_total_le_1_25x_stored",
    }


def test_cli_layout_options():
    """The bench stores the step in the store's default layout, the slice layout; ``--no-slice-layout``
    in the whole-request layout (``--slice-layout`` still accepted)."""
    from r3rdma.cli import build_parser

    def parsed(*flags):
        argv = ["bench", "trainer-layout", "--quick", *flags]
        return build_parser(argv).parse_args(argv)

    assert parsed().slice_layout is True and parsed("--slice-layout").slice_layout is True
    args = parsed("--no-slice-layout", "--zstd-level", "0", "--dp", "4")
    assert args.slice_layout is False and args.zstd_level == 0 and args.dp == 4 and args.quick
