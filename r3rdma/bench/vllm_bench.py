"""`r3rdma bench vllm`: the same vLLM workload with r3rdma's plug-in off and on, one run.

Two engines on one checkpoint (random-weight Qwen3-MoE written locally), one with routing
replay on (recording into a local store, flushed durable at the end of each round), one
without, in each mode measured: ``compiled`` (vLLM's default compilation, as RL teams run it:
torch.compile traces the model and the plug-in's record op) and ``eager`` (``enforce_eager``).
One mode's pair runs at a time, then shuts down; ``--pairs N`` runs N fresh pairs one after the
other and pools their rounds (a pair's two engines may differ by a few percent whatever the
plug-in does: :func:`_pooled`). Rounds alternate off / on so drift of the machine hits both
alike; each round is the same prompts (a long-tailed mix of prompt and output lengths),
``ignore_eos`` so both engines generate exactly the same number of tokens. Reported
per mode: output tokens/s of each side (median over rounds), their ratio (``compiled_ratio``,
``eager_ratio``; on a CPU host a smoke test: two identical engines read 0.964-1.004 there, so
its goal is the GPU bench's, :func:`run_vllm_settings_bench`), the host time the plug-in added per engine step (its
own clock around every hook on the engine's thread: snapshot of the step, the capturer's work
or its hand-over, lifecycle; ``host_us_per_step``), also as a share of the step, the capture
thread's own time per step (``capture_thread_us_per_step``: the capturer's bookkeeping,
gathers and records, beside the engine's step; 0 inline), and how long each round waited after
``generate`` for the routing to be durable (``flush_routing``, counted in the "on" time).
Between rounds the bench waits ``_SETTLE_S`` (not timed): vLLM's processes busy-poll their
shared-memory queues for a second after their last message (``SpinCondition``'s
``busy_loop_s``), and on a CPU host both engines' workers are bound to the same cores, so the
engine that just finished would otherwise spin beside the next round's forward, a contention no
deployment of one engine has (it made the rounds' spread as large as the plug-in's cost).
``--capture-thread``: the plug-in's ``capture_thread`` (``auto``: inline on this CPU engine, on
a thread of its own on a GPU; ``on`` measures the thread here). ``--null``: an A/A run, both
engines without the plug-in, the same pairs and rounds: its ratios are what the bench reads
on this machine when the plug-in costs nothing, the floor a measured ratio is judged against. The writer compresses and
writes on its own threads, on the same cores as the engine: on a small CPU machine that
competes with the engine's processes, on a GPU host it does not. One JSON line last.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from r3rdma.bench.common import emit, rounds_bar

if TYPE_CHECKING:  # vllm is imported where it runs: `--help` and the other benches stay light
    from vllm.inputs import TokensPrompt

__all__ = ["run_vllm_bench"]

# vLLM 0.32's shm_broadcast.SpinCondition: readers spin (sched_yield) for busy_loop_s = 1 s after
# their last read, then wait on a socket. Waiting a little longer between rounds lets the engine
# that is not measured go quiet before the other one starts.
_SETTLE_S = 1.25


def _workload(n: int, max_new: int, seed: int) -> tuple[list[TokensPrompt], list[int]]:
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(48), 0.8, n), 4, 400).astype(int)
    new_lens = np.clip(rng.lognormal(np.log(max_new / 2), 0.6, n), 4, max_new).astype(int)
    prompts: list[TokensPrompt] = [{"prompt_token_ids": rng.integers(3, 250, size=int(p)).tolist()} for p in prompt_lens]
    return prompts, [int(x) for x in new_lens]


def run_vllm_bench(
    *,
    requests: int = 64,
    max_new: int = 128,
    running: int = 32,
    rounds: int = 3,
    layers: int = 8,
    experts: int = 64,
    top_k: int = 8,
    hidden: int = 256,
    seed: int = 0,
    modes: tuple[str, ...] = ("compiled", "eager"),
    flush_interval_s: float | None = None,
    capture_thread: str = "auto",
    pairs: int = 1,
    null: bool = False,
) -> dict:
    """Both modes' measurements (:func:`_run_mode`, ``pairs`` engine pairs each, pooled by
    :func:`_pooled`) and the ratios side by side. ``null``: the "on" engine too runs without
    the plug-in (an A/A run: the ratios then measure the bench's own noise, nothing else)."""
    if pairs < 1 or rounds < 1:
        raise ValueError(f"need pairs >= 1 and rounds >= 1, got pairs={pairs} rounds={rounds}")
    import vllm

    from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint

    work = tempfile.mkdtemp(prefix="r3rdma-bench-vllm-")
    try:
        model = str(
            write_tiny_checkpoint(
                f"{work}/model",
                seed=seed,
                tokenizer=False,
                num_hidden_layers=layers,
                num_experts=experts,
                num_experts_per_tok=top_k,
                hidden_size=hidden,
                head_dim=64,
                num_attention_heads=max(hidden // 64, 1),
                num_key_value_heads=max(hidden // 128, 1),
                mlp_only_layers=[],
                moe_intermediate_size=hidden // 2,
                intermediate_size=2 * hidden,
            )
        )
        prompts, new_lens = _workload(requests, max_new, seed)
        engine = dict(model=model, seed=seed, max_num_seqs=running)  # max_num_seqs: requests the engine runs at once
        replay: dict[str, Any] = {"capture_thread": capture_thread}
        if flush_interval_s is not None:
            replay["flush_interval_s"] = flush_interval_s
        per_mode = {
            mode: _pooled(
                [
                    _run_mode(
                        mode,
                        engine,
                        f"{work}/store-{mode}-{p}",
                        prompts,
                        new_lens,
                        rounds,
                        None if null else replay,
                        f"pair {p + 1}/{pairs}" + (" (A/A)" if null else ""),
                    )
                    for p in range(pairs)
                ],
                sum(new_lens),
                rounds,
            )
            for mode in modes
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "bench": "vllm",
        "vllm": vllm.__version__,
        "geometry": {"layers": layers, "experts": experts, "top_k": top_k, "hidden": hidden},
        "requests": requests,
        "running": running,
        "output_tokens_per_round": sum(new_lens),
        "rounds": rounds,
        "pairs": pairs,
        "flush_interval_s": flush_interval_s,  # None: R3Config's default
        "capture_thread": capture_thread,  # auto: inline for this CPU engine, a thread on a GPU
        "null": null,  # True: both engines without the plug-in (the ratios are the bench's noise)
    }
    for mode, measured in per_mode.items():
        result[f"{mode}_ratio"] = measured["ratio"]
    result["modes"] = per_mode
    return result


def _run_mode(
    mode: str,
    engine: dict,
    store: str,
    prompts: list[TokensPrompt],
    new_lens: list[int],
    rounds: int,
    replay: dict[str, Any] | None,
    label: str,
) -> dict:
    """Plug-in off and on for one compilation mode: two engines (``engine``: their model, seed
    and ``max_num_seqs``), rounds interleaved; ``replay``: more ``routing_replay`` settings
    (None: the "on" engine runs without the plug-in, an A/A pair). What one pair measured,
    for :func:`_pooled`."""
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM, SamplingParams

    from r3rdma.integrations.vllm import flush_routing

    common: dict[str, Any] = dict(  # LLM's arguments, the same for both engines
        **engine,
        dtype="bfloat16",
        enforce_eager=mode == "eager",
        skip_tokenizer_init=True,
        max_model_len=512,
        gpu_memory_utilization=0.15,
    )
    plugin: dict[str, Any] = {} if replay is None else {"routing_replay": {"local_store_dir": store, **replay}}
    engines = {"off": LLM(**common), "on": LLM(**common, additional_config=plugin)}
    tok_s: dict[str, list[float]] = {"off": [], "on": []}
    host_s, thread_s, steps, commits = 0.0, 0.0, 0, 0
    flush_s: list[float] = []
    try:
        for rnd in rounds_bar(rounds + 1, f"vllm {mode}, {label}"):
            for side in ("off", "on") if rnd % 2 == 0 else ("on", "off"):
                params = [
                    SamplingParams(
                        max_tokens=m,
                        temperature=1.0,
                        ignore_eos=True,
                        detokenize=False,
                        # Only the recording engine names its routing: an engine without routing
                        # replay refuses r3_* arguments (nothing would be stored).
                        extra_args={"r3_rollout_id": f"bench-{rnd}", "r3_request_id": f"q{i}"}
                        if side == "on" and replay is not None
                        else None,
                    )
                    for i, m in enumerate(new_lens)
                ]
                time.sleep(_SETTLE_S)  # the other engine's busy-poll ends (above)
                t0 = time.perf_counter()
                outs = engines[side].generate(prompts, params, use_tqdm=False)
                t1 = time.perf_counter()
                if side == "on" and replay is not None:
                    counters = flush_routing(engines["on"])  # durable: part of the measured work
                elapsed = time.perf_counter() - t0
                if side == "on" and rnd and replay is not None:
                    flush_s.append(time.perf_counter() - t1)
                generated = sum(len(o.outputs[0].token_ids) for o in outs)
                if rnd == 0:
                    continue  # warm-up round on both engines
                tok_s[side].append(generated / elapsed)
                if side == "on" and replay is not None:
                    host_s, steps, commits = counters["host_seconds"], counters["steps"], counters["commits"]
                    thread_s = counters["capture_thread_seconds"]
    finally:
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()
    return {
        "enforce_eager": mode == "eager",
        "off": tok_s["off"],
        "on": tok_s["on"],
        "flush_s": flush_s,
        "steps": steps,  # the "on" engine's, warm-up round included
        "commits": commits,  # its writer's batches, warm-up round included
        "host_s": host_s,
        "thread_s": thread_s,
    }


def _pooled(pairs: list[dict], tokens_per_round: int, rounds: int) -> dict:
    """One mode's numbers over every pair's rounds: tokens/s of each side (median over all
    rounds), their ratio, each pair's own ratio beside it (``pair_ratios``), and the plug-in's
    time per step over all pairs' steps.

    Why several pairs: each engine is a process of its own, and on the CPU VM a pair's two
    engines differed by a few percent whatever the plug-in did, steadily over a run (two runs of
    the same tree: 0.914 and 0.965, each with its rounds within +-1.5% of their median), so
    rounds alone do not average it out; fresh pairs do."""
    off = statistics.median(x for p in pairs for x in p["off"])
    on = statistics.median(x for p in pairs for x in p["on"])
    steps = sum(p["steps"] for p in pairs)
    host_s = sum(p["host_s"] for p in pairs)
    thread_s = sum(p["thread_s"] for p in pairs)
    step_s = tokens_per_round / off / max(steps / (len(pairs) * (rounds + 1)), 1)  # mean step time with the plug-in off
    return {
        "enforce_eager": pairs[0]["enforce_eager"],
        "tokens_per_s_off": off,
        "tokens_per_s_on": on,
        "tokens_per_s_off_rounds": [x for p in pairs for x in p["off"]],
        "tokens_per_s_on_rounds": [x for p in pairs for x in p["on"]],
        "ratio": on / off,
        "pair_ratios": [statistics.median(p["on"]) / statistics.median(p["off"]) for p in pairs],
        "flush_seconds_rounds": [x for p in pairs for x in p["flush_s"]],  # the "on" side's wait, after generate, until durable
        "engine_steps": steps,
        # The writer's batches per round: each is a store commit with a fixed CPU cost (files,
        # fsyncs), on this VM taken from the engine's cores.
        "commits_per_round": sum(p["commits"] for p in pairs) / (len(pairs) * (rounds + 1)),
        "host_us_per_step": 1e6 * host_s / max(steps, 1),  # on the engine's step path
        "capture_thread_us_per_step": 1e6 * thread_s / max(steps, 1),  # the capturer's work, beside it
        "host_share_of_step": (host_s / max(steps, 1)) / step_s if step_s > 0 else None,
    }


# Qwen3-30B-A3B's shape (its config.json): vLLM builds it with load_format="dummy" (random
# weights, nothing read from disk); ~61 GB of bf16 weights fit one H200 with room for the KV cache.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(
        num_hidden_layers=48,
        num_experts=128,
        num_experts_per_tok=8,
        hidden_size=2048,
        head_dim=128,
        num_attention_heads=32,
        num_key_value_heads=4,
        moe_intermediate_size=768,
        intermediate_size=6144,
        vocab_size=151936,
        mlp_only_layers=[],
        max_position_embeddings=4096,
    ),
    # A smoke-test shape that runs on a CPU in seconds (tests/test_vllm_bench.py).
    "tiny": dict(
        num_hidden_layers=4,
        num_experts=16,
        num_experts_per_tok=4,
        hidden_size=128,
        head_dim=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_intermediate_size=64,
        intermediate_size=256,
        vocab_size=256,
        mlp_only_layers=[],
        max_position_embeddings=4096,
    ),
}

# What each setting adds to the engine's arguments: nothing, r3rdma's plug-in (recording into a
# local store, flushed durable after every round, inside the timed work), vLLM's own capture.
SETTINGS = ("off", "r3rdma", "native")


def run_vllm_settings_bench(
    *,
    shape: str = "qwen3-30b-a3b",
    settings: tuple[str, ...] = SETTINGS,
    running: tuple[int, ...] = (64, 256),
    prompt_len: int = 256,
    max_new: int = 128,
    rounds: int = 2,
    seed: int = 0,
    gpu_memory_utilization: float = 0.85,
    out: str | None = None,
) -> dict:
    """Decode-heavy RL requests at each ``running`` level (that many requests submitted at once,
    all running: ``max_num_seqs`` is the largest level) on one engine per setting, at vLLM's
    defaults (compiled, CUDA graphs, async scheduling). One GPU holds one engine of this size, so
    the settings run one after the other in this process (a fresh engine each; rounds of the
    levels alternate within an engine). Reported per setting and level: output tokens/s (median
    of rounds), engine steps' mean wall time, and for r3rdma its host time per step on the
    engine's thread and its capture thread's; the ratios to ``off`` last, twice: durable (each
    round timed until every request's routing is durable, ``flush_routing``) and generating only
    (``generate`` returned; the engine's own throughput). A setting given again runs another
    engine (``off`` before and after the others: their spread is the drift between engines). ``out``: a file each
    finished setting's numbers are appended to as a JSON line (a run cut short keeps them)."""
    import json

    import vllm

    from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint

    unknown = set(settings) - set(SETTINGS)
    if unknown or shape not in SHAPES:
        raise ValueError(f"settings must be among {SETTINGS} and shape among {sorted(SHAPES)}; got {settings}, {shape!r}")
    if "native" in settings and not _has_native_capture():
        raise ValueError(
            f"setting 'native' needs vLLM's own routed-experts capture on the V1 model runner (vLLM 0.26-0.30); "
            f"vLLM {vllm.__version__} has it on Model Runner V2 only"
        )
    work = tempfile.mkdtemp(prefix="r3rdma-bench-vllm-gpu-")
    try:
        model = str(write_tiny_checkpoint(f"{work}/model", tokenizer=False, weights=False, **SHAPES[shape]))
        rng = np.random.default_rng(seed)
        prompts = {
            n: [
                {"prompt_token_ids": rng.integers(3, SHAPES[shape]["vocab_size"] - 1, size=prompt_len).tolist()} for _ in range(n)
            ]
            for n in running
        }
        results: dict[str, dict] = {}
        for label, setting in _labels(settings):
            results[label] = _run_setting(
                setting, model, f"{work}/store-{label}", prompts, max_new, rounds, seed, gpu_memory_utilization
            )
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps({"setting": label, **results[label]}) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {
        "bench": "vllm",
        "vllm": vllm.__version__,
        "device": _device_name(),
        "shape": shape,
        "running": list(running),
        "prompt_len": prompt_len,
        "max_new": max_new,
        "rounds": rounds,
        "settings": results,
        "goal_r3rdma_ratio": 0.99,
    }
    result.update(_ratios(results, running))
    return result


def _ratios(results: dict[str, dict], running: tuple[int, ...]) -> dict[str, float]:
    """Each setting's tokens/s over the mean of every ``off`` engine of the run, durable and
    generating only (``<label>_ratio_<n>``, ``<label>_ratio_generate_<n>``); with two or more
    ``off`` engines (e.g. off,r3rdma,native,off) their spread over that mean too
    (``off_spread[_generate]_<n>``): the drift between engines, the floor a ratio is judged
    against."""
    out: dict[str, float] = {}
    offs = [m for label, m in results.items() if label.split("#")[0] == "off"]
    for n in running if offs else ():
        for key, suffix in (("tokens_per_s", ""), ("generate_tokens_per_s", "_generate")):
            base = statistics.fmean(m[str(n)][key] for m in offs)
            for label, m in results.items():
                if label.split("#")[0] != "off":
                    out[f"{label}_ratio{suffix}_{n}"] = m[str(n)][key] / base
            if len(offs) > 1:
                values = [m[str(n)][key] for m in offs]
                out[f"off_spread{suffix}_{n}"] = (max(values) - min(values)) / base
    return out


def _labels(settings: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(label, setting)`` per engine: a setting given again gets ``#2``, ``#3``, ... (an
    ``off`` before and after the others measures the drift between engines)."""
    seen: dict[str, int] = {}
    labels = []
    for setting in settings:
        seen[setting] = seen.get(setting, 0) + 1
        labels.append((setting if seen[setting] == 1 else f"{setting}#{seen[setting]}", setting))
    return labels


def _run_setting(
    setting: str, model: str, store: str, prompts: dict, max_new: int, rounds: int, seed: int, memory: float
) -> dict:
    """One engine at vLLM's defaults with ``setting``; warm-up, then ``rounds`` rounds of every level."""
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM, SamplingParams

    from r3rdma.integrations.vllm import flush_routing

    extra: dict[str, Any] = {}
    if setting == "r3rdma":
        extra["additional_config"] = {"routing_replay": {"local_store_dir": f"{store}-{setting}"}}
    elif setting == "native":
        extra["enable_return_routed_experts"] = True
    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        seed=seed,
        max_model_len=2048,
        max_num_seqs=max(prompts),
        gpu_memory_utilization=memory,
        **extra,
    )
    start_s = time.perf_counter() - t0
    levels: dict[str, dict[str, list[float]]] = {
        str(n): {
            "tokens_per_s_rounds": [],
            "generate_tokens_per_s_rounds": [],
            "flush_ms_rounds": [],
            "step_ms_rounds": [],
            "host_us_per_step_rounds": [],
            "thread_us_per_step_rounds": [],
            "thread_cpu_us_per_step_rounds": [],
        }
        for n in prompts
    }
    try:
        for rnd in rounds_bar(rounds + 1, f"vllm {setting}"):
            for n, batch in prompts.items():
                params = SamplingParams(
                    max_tokens=max_new,
                    temperature=1.0,
                    ignore_eos=True,
                    detokenize=False,
                    extra_args={"r3_rollout_id": f"bench-{n}-{rnd}"} if setting == "r3rdma" else None,
                )
                before = flush_routing(llm) if setting == "r3rdma" else None
                t = time.perf_counter()
                outs = llm.generate(batch, params, use_tqdm=False)
                generated = time.perf_counter()
                after = flush_routing(llm) if setting == "r3rdma" else None  # durable: inside the timed work
                elapsed = time.perf_counter() - t
                if rnd == 0:
                    continue  # warm-up
                m = levels[str(n)]
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                m["tokens_per_s_rounds"].append(tokens / elapsed)
                # The engine's own throughput, and apart from it the wait after the last token
                # until every request's routing is durable (what a trainer waits for on top).
                m["generate_tokens_per_s_rounds"].append(tokens / (generated - t))
                m["flush_ms_rounds"].append(1e3 * (elapsed - (generated - t)))
                # Every request runs from the first step to the last: prefill chunks, then one token a step.
                steps = max_new + -(
                    -n * len(batch[0]["prompt_token_ids"]) // llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
                )
                if before is not None and after is not None:
                    steps = after["steps"] - before["steps"]
                    m["host_us_per_step_rounds"].append(1e6 * (after["host_seconds"] - before["host_seconds"]) / max(steps, 1))
                    for key, counter in (
                        ("thread_us_per_step_rounds", "capture_thread_seconds"),
                        ("thread_cpu_us_per_step_rounds", "capture_thread_cpu_seconds"),
                    ):
                        m[key].append(1e6 * (after[counter] - before[counter]) / max(steps, 1))
                m["step_ms_rounds"].append(1e3 * elapsed / max(steps, 1))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        _wait_for_gpu_memory(memory)
    measured: dict[str, Any] = {"engine_start_s": start_s}
    for n, m in levels.items():
        measured[n] = {
            "tokens_per_s": statistics.median(m["tokens_per_s_rounds"]),
            "generate_tokens_per_s": statistics.median(m["generate_tokens_per_s_rounds"]),
            "flush_ms": statistics.median(m["flush_ms_rounds"]),
            "step_ms": statistics.median(m["step_ms_rounds"]),
            **(
                {
                    "host_us_per_step": statistics.median(m["host_us_per_step_rounds"]),
                    "capture_thread_us_per_step": statistics.median(m["thread_us_per_step_rounds"]),
                    "capture_thread_cpu_us_per_step": statistics.median(m["thread_cpu_us_per_step_rounds"]),
                }
                if m["host_us_per_step_rounds"]
                else {}
            ),
            **m,
        }
    return measured


def _wait_for_gpu_memory(share: float, timeout_s: float = 60.0) -> None:
    """Until the engine just shut down has given its GPU memory back (its processes exit
    asynchronously), so the next engine's memory check sees the GPU free."""
    import torch

    if not torch.cuda.is_available():
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if free >= share * total:
            return
        time.sleep(0.5)


def _has_native_capture() -> bool:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return hasattr(GPUModelRunner, "init_routed_experts_capturer")


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests and a smaller model (CPU, ~1-2 min)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--max-new", type=int, default=None)
    parser.add_argument("--running", type=int, default=None, help="requests the engine runs at once (max_num_seqs; default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine pair (after one warm-up round)")
    parser.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="fresh off/on engine pairs per mode, one after the other (their rounds pooled; each pair's ratio reported)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--flush-interval-s",
        type=float,
        default=None,
        help="the writer's flush_interval_s for the plug-in-on engine (default: R3Config's, 0.05)",
    )
    parser.add_argument(
        "--capture-thread",
        choices=["auto", "on", "off"],
        default="auto",
        help="the plug-in's capture_thread setting (auto: inline on the CPU, on its own thread on a GPU)",
    )
    parser.add_argument(
        "--null",
        action="store_true",
        help="an A/A run: the 'on' engine too without the plug-in, so the ratios show the bench's own noise on this machine",
    )
    parser.add_argument(
        "--settings",
        default=None,
        help="the GPU bench: comma-separated among off,r3rdma,native (vLLM's own capture), one engine each at vLLM's "
        "defaults on a full-size shape with dummy weights (--shape, --running levels, --prompt-len, --max-new), in "
        "this order; a setting may repeat (off,r3rdma,native,off: the two 'off' engines' spread is the drift between "
        "engines, and ratios are to their mean)",
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b", help="with --settings: the model shape")
    parser.add_argument("--levels", default="64,256", help="with --settings: running requests per level, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=256, help="with --settings: tokens per prompt")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="with --settings")
    parser.add_argument("--out", default=None, help="with --settings: append each setting's numbers to this file as it finishes")
    parser.add_argument(
        "--mode",
        choices=["both", "compiled", "eager"],
        default="both",
        help="compiled: vLLM's default compilation; eager: enforce_eager",
    )


def main(args) -> int:
    if args.settings:
        result = run_vllm_settings_bench(
            shape=args.shape,
            settings=tuple(x for x in args.settings.split(",") if x),
            running=tuple(int(x) for x in args.levels.split(",")),
            prompt_len=args.prompt_len,
            max_new=args.max_new or 128,
            rounds=args.rounds,
            seed=args.seed,
            gpu_memory_utilization=args.gpu_memory_utilization,
            out=args.out,
        )
        for setting, m in result["settings"].items():
            for n in result["running"]:
                level = m[str(n)]
                host = f", plug-in host {level['host_us_per_step']:.0f} us/step" if "host_us_per_step" in level else ""
                print(
                    f"vLLM {result['vllm']} {setting} @{n}: {level['tokens_per_s']:.0f} tok/s durable "
                    f"({level['generate_tokens_per_s']:.0f} generating, then {level['flush_ms']:.0f} ms to durable), "
                    f"step {level['step_ms']:.2f} ms{host}"
                )
        return emit(result)
    sizes = dict(requests=16, max_new=32, layers=4, experts=16, top_k=4, hidden=128) if args.quick else {}
    sizes.update({k: getattr(args, k) for k in ("requests", "max_new", "running") if getattr(args, k) is not None})
    modes = ("compiled", "eager") if args.mode == "both" else (args.mode,)
    result = run_vllm_bench(
        rounds=args.rounds,
        seed=args.seed,
        modes=modes,
        flush_interval_s=args.flush_interval_s,
        capture_thread=args.capture_thread,
        pairs=args.pairs,
        null=args.null,
        **sizes,
    )
    for mode, m in result["modes"].items():
        print(
            f"vLLM {result['vllm']} {mode}: {m['tokens_per_s_off']:.0f} tok/s off, {m['tokens_per_s_on']:.0f} tok/s on "
            f"(ratio {m['ratio']:.3f}); plug-in host time {m['host_us_per_step']:.0f} us per step"
        )
    return emit(result)
