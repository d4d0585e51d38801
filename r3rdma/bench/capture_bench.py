"""`r3rdma bench capture`: what routing capture costs a MoE decode loop.

A Hugging Face Qwen3-MoE model (random weights, bf16, grouped_mm experts, static KV cache)
decodes a batch of requests, one token each per step, with capture off and on, interleaved in
one run (rounds alternate off / on, so clock and thermal drift hit both alike). With capture
on, every step is announced to a :class:`RoutingCapturer` (``begin_step`` with the KV slots of
its tokens), the routers' hooks record their top-k ids, and ``end_step`` writes the rows into
the slot table on the GPU.

With ``--cuda-graphs`` (default ``auto``: where the model and capturer allow it) the decode
step is captured once per setting into a CUDA graph and replayed; capture then costs only
its kernels inside the graph plus ``begin_step`` / ``end_step`` around the replay. Without,
the step runs eagerly and the hooks run in Python each step.

``--record-path op`` measures the path the vLLM plug-in installs instead of the Python hook:
each router's hook calls :func:`r3rdma.kernels.record_op.record_hook` (one custom op writing
a fixed step buffer the capturer was built with, ``step_buffer=``), so in a graph the op's one
copy kernel per layer is captured, and every step begins ``graphed=True``.

``--engine-step`` (with ``--record-path op`` and CUDA graphs) adds what an engine's step does
around the forward and times the capturer's host path on the step's critical path: every step
first finishes one request (``finish_request``, its rows gathered and committed by a real
writer into a local store) and starts another in its batch row, and ends by reading the sampled
tokens to the host (the synchronisation every engine step makes). Three settings interleave:
capture off, the capturer called inline on the GPU (as the vLLM plug-in did until it got its
capture thread), and a capturer on the host handed over to a
:class:`~r3rdma.capture.capture_thread.CaptureThread` (as it does now). ``engine_step`` in the JSON: ms per step of each and the host time each adds.

Host synchronisations are counted with ``torch.cuda.set_sync_debug_mode("warn")`` over a
separate pass of steps (each with capture on and off; the difference is the capturer's).

The last line is JSON: ``step_ms_off``, ``step_ms_on``, ``overhead_pct``, ``overhead_us``,
``host_syncs_per_step`` and the configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

from r3rdma.bench.common import emit

__all__ = ["run_capture_bench", "add_arguments", "main"]


def _build(args, device):
    import torch

    from r3rdma.integrations.hf_models import build_model, tiny_qwen3_moe

    config = tiny_qwen3_moe(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        experts_implementation=args.experts_impl,
    )
    with torch.device(device):  # made on the device: the default model is tens of GB
        model = build_model(config, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    return model, config


class _Loop:
    """A fixed-batch decode loop over a static KV cache; one instance, two settings."""

    def __init__(self, model, config, args, device) -> None:
        import torch
        from transformers import StaticCache

        self.model, self.device, self.args = model, device, args
        B, P = args.batch, args.prompt_len
        self.max_len = P + args.steps + 8
        self.cache = StaticCache(config=config, max_cache_len=self.max_len)
        gen = torch.Generator(device="cpu").manual_seed(1)
        prompt = torch.randint(0, config.vocab_size, (B, P), generator=gen).to(device)
        with torch.no_grad():
            out = model(
                input_ids=prompt, cache_position=torch.arange(P, device=device), past_key_values=self.cache, use_cache=True
            )
        self.ids = out.logits[:, -1:].argmax(-1).clone()  # [B, 1] static input
        self.first_ids = self.ids.clone()
        self.pos = torch.full((B, 1), P, dtype=torch.long, device=device)
        self.cpos = torch.full((1,), P, dtype=torch.long, device=device)
        self.request_ids = [f"bench-{b}" for b in range(B)]
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}  # by capture on / off

    def reset(self) -> None:
        import torch

        P = self.args.prompt_len
        self.ids.copy_(self.first_ids)
        self.pos.fill_(P)
        self.cpos.fill_(P)
        # transformers >= 5.2x static layers count their own length (a device tensor); older ones
        # use cache_position. Rewind both, so every round decodes the same positions.
        for layer in getattr(self.cache, "layers", ()):
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor):
                length.fill_(P)
            elif isinstance(length, int):
                layer.cumulative_length = P

    def forward(self) -> None:
        out = self.model(
            input_ids=self.ids, position_ids=self.pos, cache_position=self.cpos, past_key_values=self.cache, use_cache=True
        )
        self.ids.copy_(out.logits[:, -1:].argmax(-1))
        self.pos.add_(1)
        self.cpos.add_(1)

    def slots(self, step: int):
        import numpy as np

        return np.arange(self.args.batch, dtype=np.int64) * self.max_len + self.args.prompt_len + step

    def run_steps(self, n: int, capturer, graphed: bool, model_writes: bool = False) -> None:
        B = self.args.batch
        for s in range(n):
            if capturer is not None:  # graphed=True: the forward writes the step buffer itself
                capturer.begin_step(
                    self.request_ids, [self.args.prompt_len + s] * B, [1] * B, self.slots(s), graphed=graphed or model_writes
                )
            if graphed:
                self.graphs[capturer is not None].replay()
            else:
                self.forward()
            if capturer is not None:
                capturer.end_step()


def _attach_record_op(routers, step_buf):
    """The vLLM plug-in's record path on Hugging Face routers: one op per layer into ``step_buf``."""
    from r3rdma.kernels.record_op import record_hook

    def hook_for(moe: int):
        record = record_hook(step_buf, moe)
        return lambda _module, _args, output: record(output[2])  # indices [T, K]

    handles = [r.module.register_forward_hook(hook_for(i)) for i, r in enumerate(routers)]

    def detach() -> None:
        for handle in handles:
            handle.remove()

    return detach


def _try_graph(loop, capturer, on: bool) -> str | None:
    """Capture one decode step (with the capturer's hooks live when ``on``); None if it worked."""
    import torch

    loop.reset()

    def hooks():  # the capturer's hooks live while a step is captured
        return capturer.graph_capture(loop.args.batch) if on else contextlib.nullcontext()

    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(3):  # warm-up on a side stream, as torch.cuda.graphs asks
                with hooks():
                    loop.forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), hooks(), torch.cuda.graph(graph):
            loop.forward()
        loop.graphs[on] = graph
        return None
    except Exception as e:  # the model or the capturer does not allow graphs: say why
        torch.cuda.synchronize()
        return f"{type(e).__name__}: {str(e)[:300]}"


class _EngineSteps:
    """``--engine-step``: a request finishes and another starts each step, the sampled tokens are
    read to the host; the capturer called inline or handed over to its thread (see the module doc)."""

    def __init__(self, loop, step_buf, args, device, root) -> None:
        import torch

        from r3rdma.capture.capture_thread import CaptureThread
        from r3rdma.capture.capturer import RoutingCapturer
        from r3rdma.config import R3Config
        from r3rdma.integrations.builders import build_writer

        self.loop, self.step_buf, self.args = loop, step_buf, args
        self.capturers = {}
        for mode in ("inline", "thread"):
            # Handed over, the capturer is on the host, as the vLLM plug-in builds it: each
            # step's rows leave the device in one copy, its own copy.
            table = device if mode == "inline" else torch.device("cpu")
            self.capturers[mode] = RoutingCapturer(
                layer_map=list(range(step_buf.shape[1])),
                top_k=args.top_k,
                num_experts=args.experts,
                num_slots=args.batch * loop.max_len,
                device=table,
                sink=build_writer(R3Config(local_store_dir=f"{root}/{mode}")),
                owns_sink=True,
                step_buffer=step_buf if mode == "inline" else torch.zeros(step_buf.shape, dtype=step_buf.dtype),
            )
        self.thread = CaptureThread(self.capturers["thread"])
        self.serial = 0

    def run(self, mode: str | None) -> None:
        """One round of ``args.steps`` steps: capture off (None), ``inline`` or ``thread``."""
        import numpy as np

        loop, B = self.loop, self.args.batch
        cap = self.capturers.get(mode) if mode else None
        # Each row's request counts its own positions from 0 (the model decodes the loop's
        # static positions; the capturer only needs each request's own), in its row's KV slots.
        first = np.zeros(B, dtype=np.int64)  # the step each row's request started at
        base = np.arange(B, dtype=np.int64) * loop.max_len
        names = [self._name() for _ in range(B)]
        for s in range(self.args.steps):
            row = s % B
            if cap is not None and s > first[row]:
                done = (names[row], int(s - first[row]))  # its positions 0 .. s - first - 1
                if mode == "thread":
                    self.thread.submit(_finish, cap, *done)
                else:
                    _finish(cap, *done)
            names[row], first[row] = self._name(), s
            starts = s - first
            slots = base + starts
            if mode == "inline":
                assert cap is not None
                cap.begin_step(names, starts, 1, slots, graphed=True)
            loop.graphs[cap is not None].replay()
            if mode == "inline":
                assert cap is not None
                cap.end_step()
            elif mode == "thread":
                self.thread.step(list(names), starts, 1, slots, self.step_buf[:B])
            loop.ids.cpu()  # the engine reads the sampled tokens: the step's host synchronisation
        if cap is not None:  # the round's requests leave: nothing carried into the next round
            for rid in names:
                self.thread.submit(cap.abort_request, rid) if mode == "thread" else cap.abort_request(rid)

    def _name(self) -> str:
        self.serial += 1
        return f"q{self.serial}"

    def close(self) -> None:
        self.thread.close()
        for cap in self.capturers.values():
            cap.close()


def _finish(cap, rid: str, positions: int) -> None:
    cap.finish_request(rid, prompt_len=1, generated_len=positions, rollout_id="bench")  # rows 0 .. positions - 1


def _engine_step_rounds(loop, step_buf, args, device, log) -> dict:
    import tempfile

    import torch

    times: dict[str, list[float]] = {"off": [], "inline": [], "thread": []}
    with tempfile.TemporaryDirectory(prefix="r3-capture-bench-") as root:
        steps = _EngineSteps(loop, step_buf, args, device, root)
        try:
            for r in range(args.rounds + 1):  # the first round warms up
                order = ("off", "inline", "thread") if r % 2 == 0 else ("thread", "inline", "off")
                for mode in order:
                    loop.reset()
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    with torch.no_grad():
                        steps.run(None if mode == "off" else mode)
                    torch.cuda.synchronize()
                    if r:
                        times[mode].append((time.perf_counter() - start) * 1e3 / args.steps)
                log(f"engine step round {r}: " + ", ".join(f"{m} {v[-1]:.3f}" for m, v in times.items() if v and r))
            steps.capturers["inline"].flush()
            steps.thread.call(steps.capturers["thread"].flush)  # the thread's capturer is the thread's to call
        finally:
            steps.close()
    ms = {m: statistics.median(v) for m, v in times.items()}
    return {
        "step_ms": {m: round(v, 4) for m, v in ms.items()},
        "host_us_inline": round((ms["inline"] - ms["off"]) * 1e3, 1),
        "host_us_thread": round((ms["thread"] - ms["off"]) * 1e3, 1),
        "pct_inline": round((ms["inline"] - ms["off"]) / ms["off"] * 100, 3),
        "pct_thread": round((ms["thread"] - ms["off"]) / ms["off"] * 100, 3),
        # Wall time the thread spent in its calls, waits included (on CUDA its calls wait while the
        # engine thread sits in the step's synchronous copy of the sampled tokens).
        "thread_call_us_per_step": round(steps.thread.busy_seconds * 1e6 / (len(times["thread"]) + 1) / args.steps, 1),
        "step_ms_all": {m: [round(x, 4) for x in v] for m, v in times.items()},
    }


def _count_syncs(fn) -> int:
    import torch

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.set_warn_always(True)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            torch.set_warn_always(False)
    return sum(1 for w in caught if "synchronizing" in str(w.message).lower())


def run_capture_bench(args: argparse.Namespace) -> dict:
    """Build the model and capturer from ``args`` (``add_arguments``' options), time decode steps with
    capture off and on in alternating rounds; return the result (ms per step, overhead in us and %)."""
    import torch

    from r3rdma.capture.capturer import RoutingCapturer
    from r3rdma.integrations.hf_capture import attach_capturer
    from r3rdma.integrations.hf_routers import find_moe_routers

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda") if cuda else torch.device("cpu")
    t0 = time.perf_counter()
    model, config = _build(args, device)
    loop = _Loop(model, config, args, device)
    routers = find_moe_routers(model)
    op_path = args.record_path == "op"
    step_buf = None
    if op_path:
        from r3rdma.kernels.record_op import new_step_buffer

        step_buf = new_step_buffer(
            max_tokens=args.batch, num_layers=len(routers), top_k=args.top_k, num_experts=args.experts, device=device
        )
    capturer = RoutingCapturer(
        layer_map=[r.layer_idx for r in routers],
        top_k=args.top_k,
        num_experts=args.experts,
        num_slots=args.batch * loop.max_len,
        device=device,
        step_buffer=step_buf,
    )
    build_s = time.perf_counter() - t0
    log = (lambda *a: print(*a, flush=True)) if args.verbose else (lambda *a: None)
    log(
        f"model built in {build_s:.1f} s on {device}: {args.layers} layers, {args.experts} experts, top-{args.top_k}, batch {args.batch}"
    )

    detach = None

    def set_capture(on: bool) -> None:
        nonlocal detach
        if on and detach is None:
            detach = _attach_record_op(routers, step_buf) if op_path else attach_capturer(model, capturer)
        elif not on and detach is not None:
            detach()
            detach = None

    graphed = False
    graph_error = None
    if cuda and args.cuda_graphs != "off":
        set_capture(False)
        graph_error = _try_graph(loop, capturer, False)
        if graph_error is None:
            set_capture(True)
            graph_error = _try_graph(loop, capturer, True)
            set_capture(False)
        graphed = graph_error is None
        if args.cuda_graphs == "on" and not graphed:
            raise SystemExit(f"--cuda-graphs on: capture failed: {graph_error}")
        log(f"cuda graphs: {graphed}" + (f" ({graph_error})" if graph_error else ""))

    def decode(on: bool, steps: int, timed: bool) -> float:
        """``steps`` decode steps from the start, capture ``on``; ms per step (``timed``: between synchronisations)."""
        set_capture(on and not graphed)  # graphed: the hooks ran at capture time only
        loop.reset()
        if cuda and timed:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            loop.run_steps(steps, capturer if on else None, graphed, model_writes=op_path)
        if cuda and timed:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / steps

    def timed_round(on: bool) -> float:
        return decode(on, args.steps, timed=True)

    for on in (False, True, False, True):  # warm-up both settings
        timed_round(on)
    off_ms: list[float] = []
    on_ms: list[float] = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for on in order:
            (on_ms if on else off_ms).append(timed_round(on))
        log(f"round {r}: off {off_ms[-1]:.3f} ms/step, on {on_ms[-1]:.3f} ms/step")

    syncs_on = syncs_off = None
    if cuda:
        n = min(args.steps, 8)
        syncs_off = _count_syncs(lambda: decode(False, n, timed=False)) / n
        syncs_on = _count_syncs(lambda: decode(True, n, timed=False)) / n
        torch.cuda.synchronize()
    engine_step = None
    if args.engine_step:
        if not (op_path and graphed):
            raise SystemExit("--engine-step needs --record-path op and CUDA graphs")
        set_capture(False)
        engine_step = _engine_step_rounds(loop, step_buf, args, device, log)
    set_capture(False)

    step_off = statistics.median(off_ms)
    step_on = statistics.median(on_ms)
    pairs = [b - a for a, b in zip(off_ms, on_ms)]
    result = {
        "bench": "capture",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model": f"Qwen3-MoE random bf16: {args.layers} layers, {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, "
        f"moe_intermediate {args.moe_intermediate}, experts {args.experts_impl}",
        "batch": args.batch,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "record_path": args.record_path,
        "cuda_graphs": graphed,
        "cuda_graphs_error": graph_error,
        "step_ms_off": round(step_off, 4),
        "step_ms_on": round(step_on, 4),
        "overhead_us": round((step_on - step_off) * 1e3, 2),
        "overhead_us_paired_median": round(statistics.median(pairs) * 1e3, 2),
        "overhead_pct": round((step_on - step_off) / step_off * 100, 3),
        "host_syncs_per_step": syncs_on,  # every sync in steps with capture on (model included)
        "host_syncs_per_step_capture_off": syncs_off,
        "step_ms_off_all": [round(x, 4) for x in off_ms],
        "step_ms_on_all": [round(x, 4) for x in on_ms],
        "rows_captured": capturer.rows_captured,
        "engine_step": engine_step,
    }
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``r3rdma bench capture``: the model's shape, the batch, steps and rounds, the record path."""
    parser.add_argument("--layers", type=int, default=24, help="MoE decoder layers (BENCHMARKS.md measures 24)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (Qwen3-30B-A3B: 2048)")
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--experts-impl", default="grouped_mm", help="transformers experts implementation")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed round")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per setting (interleaved)")
    parser.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto")
    parser.add_argument(
        "--record-path",
        choices=["hook", "op"],
        default="hook",
        help="hook: capturer.record from a Python hook; op: the vLLM plug-in's record op into a fixed "
        "step buffer (r3rdma.kernels.record_op)",
    )
    parser.add_argument(
        "--engine-step",
        action="store_true",
        help="also time an engine-like step (a request finishing per step, the sampled tokens read to the host) "
        "with the capturer inline vs on its capture thread (needs --record-path op and CUDA graphs)",
    )
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test only; no timing meaning)")
    parser.add_argument("--quiet", dest="verbose", action="store_false")


def main(args: argparse.Namespace) -> int:
    """``r3rdma bench capture``: run, print the result as the last JSON line."""
    return emit(run_capture_bench(args))
