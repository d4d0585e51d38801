"""`r3rdma bench capture-host`: the capturer's (and the vLLM plug-in's) host time per engine step.

No model runs: a scheduler simulation drives a CPU :class:`RoutingCapturer` the way an engine
plug-in does, and times only the capturer's calls. ``N`` requests run at all times; each step
announces one new position of every decoding request and a few chunked-prefill chunks of
requests that just arrived, with KV slots from a paged block table (block size 16, blocks taken
from a free list as positions grow and returned when a request ends). A request that reaches
its length is finished (``finish_request``; ``sink=None`` returns the record) and a new one
takes its place, so the batch keeps turning over.

Two record paths:

- ``graphed`` (what a compiled / CUDA-graphed engine runs): the capturer has a fixed step
  buffer (:func:`r3rdma.kernels.record_op.new_step_buffer`) and each step is
  ``begin_step(..., graphed=True)`` + ``end_step()``; no ``record`` call.
- ``eager`` (for reference): ``record(layer, topk_ids_TK)`` per MoE layer between them.

- ``vllm_plugin``: the vLLM plug-in's whole step path (lifecycle, snapshot of the step,
  begin, end, finishes committed by its writer to a local store), through stand-ins for vLLM's
  input batch and scheduler output; its own clock, as ``r3rdma bench vllm`` reports it, and the
  same on decode-only steps with no finish (the part that grows with running requests).

Reported per step (microseconds, median and mean over the timed steps): ``begin``, ``end``,
their sum (also over decode-only steps), ``record`` (eager), and ``finish`` (all finishes of
the step, mean per step and per finish). The table lives on the CPU here, so ``end`` includes
the scatter of the step's rows into it (on a GPU, one kernel launch). The yardstick, timed in
the same steps, is the engine's own equivalent host work: building the step's slot mapping
from the block table with numpy (what vLLM's runner does per step before the forward).
Run ``--running 64 256`` to see how the cost grows with the batch. The last line is JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import TYPE_CHECKING

from r3rdma.bench.support import emit

if TYPE_CHECKING:  # numpy is imported where it is used, so `--help` stays light
    import numpy as np

__all__ = ["run_capture_host_bench", "add_arguments", "main"]

BLOCK = 16


class _Sim:
    """A continuous-batching scheduler over a paged KV cache, for ``running`` requests."""

    def __init__(self, args, running: int, seed: int) -> None:
        import numpy as np

        self.args = args
        self.rng = np.random.default_rng(seed)
        self.running = running
        max_len = args.max_prompt + args.max_gen
        self.max_blocks = -(-max_len // BLOCK) + 1
        self.num_blocks = int(running * self.max_blocks * 1.25) + 8
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.block_table = np.zeros((running, self.max_blocks), dtype=np.int32)  # the engine's, per lane
        self.nblocks = np.zeros(running, dtype=np.int64)
        self.prompt = np.zeros(running, dtype=np.int64)
        self.gen = np.zeros(running, dtype=np.int64)
        self.computed = np.zeros(running, dtype=np.int64)
        self.rid = [""] * running
        self.serial = 0
        for lane in range(running):
            self._arrive(lane)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * BLOCK

    def _arrive(self, lane: int) -> None:
        a = self.args
        self.prompt[lane] = self.rng.integers(a.min_prompt, a.max_prompt + 1)
        self.gen[lane] = self.rng.integers(a.min_gen, a.max_gen + 1)
        self.computed[lane] = 0
        self.nblocks[lane] = 0
        self.rid[lane] = f"req-{self.serial}"
        self.serial += 1

    def schedule(self) -> tuple[np.ndarray, np.ndarray]:
        """Lanes of this step's requests and their token counts: every decode, and prefill
        chunks (at most ``--chunk`` tokens each) while the step's prefill budget lasts."""
        import numpy as np

        a = self.args
        left = self.prompt - self.computed
        counts = np.where(left > 0, np.minimum(left, a.chunk), 1)
        prefill = left > 0
        if prefill.any():
            budget = np.cumsum(np.where(prefill, counts, 0))
            counts = np.where(prefill & (budget > a.prefill_budget), 0, counts)
        lanes = np.flatnonzero(counts)
        for lane in lanes.tolist():  # KV blocks for the new positions (the engine's allocator)
            need = -(-(int(self.computed[lane] + counts[lane])) // BLOCK)
            while self.nblocks[lane] < need:
                self.block_table[lane, self.nblocks[lane]] = self.free.pop()
                self.nblocks[lane] += 1
        return lanes, counts[lanes]

    def slot_mapping(self, lanes: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The step's slot of each token, from the block table (the engine's own per-step work)."""
        import numpy as np

        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.repeat(starts, counts) + offsets
        blocks = self.block_table[np.repeat(lanes, counts), positions // BLOCK].astype(np.int64)
        return blocks * BLOCK + positions % BLOCK

    def advance(self, lanes: np.ndarray, counts: np.ndarray) -> list[int]:
        """The step ran: lanes whose request is done (every row computed) after it."""
        self.computed[lanes] += counts
        done = self.computed[lanes] >= self.prompt[lanes] + self.gen[lanes] - 1
        return lanes[done].tolist()

    def retire(self, lane: int) -> None:
        self.free.extend(self.block_table[lane, : self.nblocks[lane]].tolist())
        self._arrive(lane)


def _run(args, running: int, graphed: bool) -> dict:
    import torch

    from r3rdma.capture.capturer import RoutingCapturer
    from r3rdma.kernels.record_op import new_step_buffer

    torch.set_num_threads(1)
    sim = _Sim(args, running, seed=args.seed)
    L, K = args.layers, args.top_k
    max_tokens = running + args.prefill_budget
    kwargs = dict(layer_map=list(range(L)), top_k=K, num_experts=args.experts, num_slots=sim.num_slots, device="cpu")
    if graphed:
        kwargs["step_buffer"] = new_step_buffer(
            max_tokens=max_tokens, num_layers=L, top_k=K, num_experts=args.experts, device="cpu"
        )
    cap = RoutingCapturer(**kwargs)
    topk = torch.randint(0, args.experts, (max_tokens, K), dtype=torch.int64)
    layers = list(range(L))

    begin_ns, end_ns, record_ns, finish_ns, slots_ns, tokens, finishes = [], [], [], [], [], [], []
    total_steps = args.warmup + args.steps
    clock = time.perf_counter_ns
    gc.collect()
    for step in range(total_steps):
        lanes, counts = sim.schedule()
        starts = sim.computed[lanes]
        t0 = clock()
        slots = sim.slot_mapping(lanes, starts, counts)
        t1 = clock()
        ids = [sim.rid[i] for i in lanes.tolist()]
        t2 = clock()
        cap.begin_step(ids, starts, counts, slots, graphed=graphed)
        t3 = clock()
        if not graphed:
            rows = topk[: slots.size]
            for layer in layers:
                cap.record(layer, rows)
        t4 = clock()
        cap.end_step()
        t5 = clock()
        done = sim.advance(lanes, counts)
        t6 = clock()
        for lane in done:
            rec = cap.finish_request(sim.rid[lane], prompt_len=int(sim.prompt[lane]), generated_len=int(sim.gen[lane]))
            assert rec is not None and rec.num_rows == sim.prompt[lane] + sim.gen[lane] - 1
        t7 = clock()
        for lane in done:
            sim.retire(lane)
        if step >= args.warmup:
            slots_ns.append(t1 - t0)
            begin_ns.append(t3 - t2)
            record_ns.append(t4 - t3)
            end_ns.append(t5 - t4)
            finish_ns.append(t7 - t6)
            tokens.append(int(slots.size))
            finishes.append(len(done))
    assert cap.active_requests <= running  # finished requests keep no state

    def us(values: list[int]) -> dict:
        return {"median": round(statistics.median(values) / 1e3, 2), "mean": round(statistics.fmean(values) / 1e3, 2)}

    n_fin = sum(finishes)
    out = {
        "running": running,
        "record_path": "graphed" if graphed else "eager",
        "tokens_per_step_mean": round(statistics.fmean(tokens), 1),
        "finishes_per_step_mean": round(n_fin / len(finishes), 3),
        "begin_us": us(begin_ns),
        "end_us": us(end_ns),
        "begin_end_us": us([a + b for a, b in zip(begin_ns, end_ns)]),
        "begin_end_us_decode_only_steps": us([a + b for a, b, t in zip(begin_ns, end_ns, tokens) if t == running] or [0]),
        "finish_us_per_step_mean": round(sum(finish_ns) / len(finish_ns) / 1e3, 2),
        "finish_us_per_request": round(sum(finish_ns) / max(n_fin, 1) / 1e3, 2),
        "capturer_us_per_step_mean": round(
            (sum(begin_ns) + sum(end_ns) + sum(record_ns) + sum(finish_ns)) / len(begin_ns) / 1e3, 2
        ),
        "yardstick_engine_slot_mapping_us": us(slots_ns),
        "tracked_positions": cap.tracked_positions,
    }
    if not graphed:
        out["record_us"] = us(record_ns)
    return out


def _run_plugin(args, running: int) -> dict:
    """The vLLM plug-in's whole step path (:class:`~r3rdma.integrations.vllm.worker.RunnerRecorder`:
    lifecycle, prepare, begin, end; finished requests committed to a local store by its writer),
    driven by the same scheduler through stand-ins for vLLM's input batch and scheduler output.
    Its own clock (``host_seconds``, what ``bench vllm`` reports) per step."""
    import tempfile
    from types import SimpleNamespace

    import torch

    from r3rdma.config import R3Config
    from r3rdma.integrations.vllm.worker import FinishedRequest, RunnerRecorder
    from r3rdma.kernels.record_op import new_step_buffer

    torch.set_num_threads(1)
    sim = _Sim(args, running, seed=args.seed)
    max_tokens = running + args.prefill_budget
    with tempfile.TemporaryDirectory(prefix="r3rdma-host-bench-") as root:
        runner = SimpleNamespace(device=torch.device("cpu"), input_batch=None)
        recorder = RunnerRecorder(runner, R3Config(local_store_dir=root, rollout_id="bench"))
        recorder.layer_map, recorder.top_k, recorder.num_experts = tuple(range(args.layers)), args.top_k, args.experts
        recorder.step_buf = new_step_buffer(
            max_tokens=max_tokens, num_layers=args.layers, top_k=args.top_k, num_experts=args.experts, device="cpu"
        )
        recorder._check_next_step = False  # the first-step check reads the device once; no forward runs here
        recorder.build(
            SimpleNamespace(
                num_blocks=sim.num_blocks, kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BLOCK))]
            )
        )
        finished: dict[str, FinishedRequest] = {}
        per_step_us: list[float] = []
        decode_us: list[float] = []  # steps of decodes only, no request finishing
        try:
            for step in range(args.warmup + args.steps):
                lanes, counts = sim.schedule()
                ids = [sim.rid[i] for i in lanes.tolist()]
                output = SimpleNamespace(
                    num_scheduled_tokens=dict(zip(ids, counts.tolist())),
                    finished_req_ids=set(finished),
                    preempted_req_ids=set(),
                    r3_finished=finished,
                )
                table = SimpleNamespace(block_size=BLOCK, block_table=SimpleNamespace(np=sim.block_table[lanes]))
                runner.input_batch = SimpleNamespace(
                    req_ids=ids, num_reqs=len(ids), block_table=[table], num_computed_tokens_cpu=sim.computed[lanes].copy()
                )
                before = recorder.host_seconds
                recorder.lifecycle(output)  # execute_model: requests the scheduler freed since the last step
                recorder.prepare(output)  # _prepare_inputs
                recorder.begin()  # _model_forward (the model would write the step buffer here)
                recorder.end(ok=True)
                if step >= args.warmup:
                    per_step_us.append((recorder.host_seconds - before) * 1e6)
                    if not finished and int(counts.max()) == 1:  # the per-running-request part alone
                        decode_us.append(per_step_us[-1])
                finished = {}
                for lane in sim.advance(lanes, counts):
                    finished[sim.rid[lane]] = FinishedRequest(sim.rid[lane], "bench", int(sim.prompt[lane]), int(sim.gen[lane]))
                    sim.retire(lane)
            stored = recorder.flush(60)["stored"]
        finally:
            recorder.close()
    return {
        "running": running,
        "record_path": "vllm_plugin",
        "plugin_host_us": {"median": round(statistics.median(per_step_us), 2), "mean": round(statistics.fmean(per_step_us), 2)},
        "plugin_host_us_decode_only_steps": round(statistics.median(decode_us or [0.0]), 2),
        "requests_stored": stored,
    }


def run_capture_host_bench(args: argparse.Namespace) -> dict:
    """One simulated run per ``--running`` count (the graphed path, the eager one unless ``--no-eager``,
    the vLLM plug-in's path unless ``--no-plugin``); return the summary: host microseconds per step."""
    results = []
    for graphed in [True, False] if args.eager else [True]:
        for running in args.running:
            results.append(_run(args, running, graphed))
            if args.verbose:
                print(json.dumps(results[-1]), flush=True)
    plugin = {}
    if args.plugin:
        for running in args.running:
            plugin[running] = _run_plugin(args, running)
            if args.verbose:
                print(json.dumps(plugin[running]), flush=True)
    graphed_runs = {r["running"]: r for r in results if r["record_path"] == "graphed"}
    summary = {
        "bench": "capture_host",
        "device": "cpu",
        "layers": args.layers,
        "top_k": args.top_k,
        "block_size": BLOCK,
        "steps": args.steps,
        "begin_end_us_median": {n: r["begin_end_us"]["median"] for n, r in graphed_runs.items()},
        "capturer_us_per_step_mean": {n: r["capturer_us_per_step_mean"] for n, r in graphed_runs.items()},
        "begin_end_us_decode_only_steps_median": {
            n: r["begin_end_us_decode_only_steps"]["median"] for n, r in graphed_runs.items()
        },
        "yardstick_engine_slot_mapping_us_median": {
            n: r["yardstick_engine_slot_mapping_us"]["median"] for n, r in graphed_runs.items()
        },
        "begin_end_over_yardstick": {
            n: round(r["begin_end_us"]["median"] / r["yardstick_engine_slot_mapping_us"]["median"], 2)
            for n, r in graphed_runs.items()
        },
        "results": results,
    }
    if plugin:
        summary["vllm_plugin_host_us_median"] = {n: r["plugin_host_us"]["median"] for n, r in plugin.items()}
        summary["vllm_plugin_host_us_mean"] = {n: r["plugin_host_us"]["mean"] for n, r in plugin.items()}
        summary["vllm_plugin_host_us_decode_only_steps_median"] = {
            n: r["plugin_host_us_decode_only_steps"] for n, r in plugin.items()
        }
        summary["goal_vllm_plugin_host_us_at_64"] = 150
        if len(plugin) > 1:
            summary["vllm_plugin_host_us_per_extra_request"] = _per_extra_request(plugin, lambda r: r["plugin_host_us"]["median"])
            summary["vllm_plugin_decode_only_us_per_extra_request"] = _per_extra_request(
                plugin, lambda r: r["plugin_host_us_decode_only_steps"]
            )
        summary["plugin_results"] = list(plugin.values())
    if len(graphed_runs) > 1:
        summary["begin_end_us_per_extra_request"] = _per_extra_request(graphed_runs, lambda r: r["begin_end_us"]["median"])
    return summary


def _per_extra_request(by_running: dict[int, dict], value) -> float:
    """How ``value`` of a run grows per extra running request, from the fewest to the most."""
    lo, hi = min(by_running), max(by_running)
    return round((value(by_running[hi]) - value(by_running[lo])) / (hi - lo), 3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``r3rdma bench capture-host``: running requests, steps, the model's shape, the request mix."""
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256], help="running requests (one run each)")
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=600, help="untimed steps first (the batch reaches steady turnover)")
    parser.add_argument("--layers", type=int, default=48, help="MoE layers (L)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--min-gen", type=int, default=64)
    parser.add_argument("--max-gen", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=128, help="most prefill tokens of one request per step")
    parser.add_argument("--prefill-budget", type=int, default=256, help="most prefill tokens per step")
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="skip the eager record() variant")
    parser.add_argument(
        "--no-plugin", dest="plugin", action="store_false", help="skip the vLLM plug-in's whole step path (RunnerRecorder)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", dest="verbose", action="store_false")


def main(args: argparse.Namespace) -> int:
    """``r3rdma bench capture-host``: run, print the summary as the last JSON line."""
    return emit(run_capture_host_bench(args))
