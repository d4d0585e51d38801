"""The worker side of the vLLM plug-in: vLLM's model runner drives r3rdma's capturer.

One :class:`StepRecorder` per model runner (so per worker process), on tensor-parallel rank 0
only: under vLLM's tensor parallelism every rank routes every token (the router's logits are
replicated), so one rank's routing is the whole step's, and one rank storing it keeps "each
request stored once". The mapping onto the capturer's calls:

- MoE layers: every ``MoERunner`` whose router is a vLLM ``BaseRouter`` gets r3rdma's record
  function as its ``capture_fn`` (the hook vLLM's own routed-experts capture uses). vLLM calls
  it right after top-k and before EPLB maps logical to physical experts, so the ids are
  logical; the layer index is the runner's ``layer_id`` (the decoder layer), so dense layers
  are simply absent from the layer map.
- ``begin_step``: from the runner's persistent input batch as ``_prepare_inputs`` reads it:
  the request order, each request's computed tokens (the step's first position) and the
  scheduler's token counts; KV slots from the host block table (``block * block_size +
  offset``, the slot mapping vLLM computes on the device, computed here on the host so the
  step needs no device read).
- ``record`` / ``end_step``: around the runner's ``_model_forward``. Forwards outside it
  (profiling, warm-up, dummy batches) record nothing.
- Positions a request did not compute in this engine's steps but holds in KV (a prefix-cache
  hit, a request resumed after preemption whose blocks were still cached) are announced with
  ``attach_cached`` from the same block table, the first time a step starts past them.
- Lifecycle, from the scheduler output at the start of the next ``execute_model``, before any
  slot is rewritten: finished requests (with the totals and stored id the scheduler side of the
  plug-in attached, :mod:`r3rdma.integrations.vllm.scheduler`) go to ``finish_request``;
  aborted ones to ``abort_request``; preempted ones to ``preempt_request``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from r3rdma.config import R3Config
from r3rdma.errors import ConfigError, R3Error

__all__ = ["StepRecorder", "FinishedRequest"]

log = logging.getLogger("r3rdma.vllm")


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """What the scheduler tells the workers about a request that left the engine (pickled into
    vLLM's scheduler output). ``stored_id`` None: aborted, store nothing."""

    stored_id: str | None
    rollout_id: str | None = None
    prompt_len: int = 0
    generated_len: int = 0


class StepRecorder:
    """Maps one vLLM model runner's steps and request lifecycle onto a ``RoutingCapturer``."""

    def __init__(self, runner: Any, config: R3Config) -> None:
        self.runner = runner
        self.config = config
        self.capturer = None
        self.layer_map: tuple[int, ...] = ()
        self.top_k = 0
        self.num_experts = 0
        self._step_tokens: int | None = None  # tokens of the open step (None: no step open)
        self._pending: tuple | None = None  # (req_ids, starts, counts, slots) from _prepare_inputs
        self._known: dict[str, int] = {}  # request -> positions the capturer holds (0 .. n-1)
        self._early: set[str] = set()  # finished by a flush before their scheduler output came
        self._lock = threading.Lock()
        self.requests_failed = 0
        self.requests_stored = 0
        self.requests_aborted = 0
        self.positions_attached = 0  # prefix-cache hits and resumed requests' cached positions
        self.host_seconds = 0.0  # time spent in this recorder on the engine's step path (bench vllm)

    # -- set-up ----------------------------------------------------------------------------

    def bind_model(self, model: Any) -> None:
        """Install the record hook on every MoE router of ``model``; fix the geometry."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        vcfg = self.runner.vllm_config
        if vcfg.speculative_config is not None:
            raise ConfigError("r3rdma's vLLM plug-in does not support speculative decoding yet (draft tokens would "
                              "need the accepted-token mask per step); turn off speculative_config or routing replay")
        if vcfg.parallel_config.pipeline_parallel_size > 1:
            raise ConfigError("r3rdma's vLLM plug-in does not support pipeline parallelism yet "
                              f"(pipeline_parallel_size={vcfg.parallel_config.pipeline_parallel_size}); each stage "
                              "holds only its own MoE layers")
        compiled = _name(getattr(vcfg.compilation_config, "mode", None))
        graphs = _name(getattr(vcfg.compilation_config, "cudagraph_mode", None))
        if compiled not in (None, "NONE") or graphs not in (None, "NONE"):
            # A Python hook runs while torch.compile traces the model or a CUDA graph is captured,
            # not in the compiled code or a replayed graph: those steps would have no rows (the
            # capturer refuses such a step, which would stop the engine mid-rollout).
            raise ConfigError(
                "r3rdma's vLLM plug-in records routing in eager steps; this engine compiles the model "
                f"(compilation mode {compiled}, cudagraph_mode {graphs}). Start it with enforce_eager=True "
                "(--enforce-eager), or turn routing replay off"
            )
        runners: dict[int, Any] = {}
        for name, module in model.named_modules():
            if not isinstance(module, MoERunner):
                continue
            router = getattr(module, "router", None)
            quant = getattr(module, "_quant_method", None)
            if getattr(quant, "is_monolithic", False) or not isinstance(router, BaseRouter):
                # A monolithic fused kernel routes inside the kernel: no top-k ids reach Python,
                # and vLLM's own capture returned correctly shaped zeros there (vLLM #44116).
                raise ConfigError(
                    f"MoE layer {name} routes inside a fused kernel ({type(quant).__name__}, router "
                    f"{type(router).__name__}), so its top-k ids cannot be recorded; r3rdma supports MoE layers "
                    "whose router is a vLLM BaseRouter (unquantized and most quantized MoE)"
                )
            layer = int(module.layer_id)
            if layer in runners:
                raise ConfigError(f"two MoE layers claim decoder layer {layer}: {runners[layer][0]} and {name}")
            runners[layer] = (name, module, router)
        if not runners:
            raise ConfigError(
                f"routing replay is on, but model {vcfg.model_config.model!r} "
                f"({type(model).__name__}) has no MoE layer: r3rdma records the routing of Mixture-of-Experts "
                "models (Qwen3-MoE, Qwen2-MoE, DeepSeek-V2/V3, Mixtral, OLMoE, ... as vLLM's FusedMoE)"
            )
        self.layer_map = tuple(sorted(runners))
        top_ks = {int(r.top_k) for _, _, r in runners.values()}
        if len(top_ks) != 1:
            raise ConfigError(f"MoE layers disagree on top-k: {sorted(top_ks)}")
        self.top_k = top_ks.pop()
        self.num_experts = int(vcfg.model_config.get_num_experts())
        for layer, (_, _, router) in runners.items():
            router.set_capture_fn(partial(self._record, layer))
        log.info("r3rdma: recording %d MoE layers %s, top-%d of %d experts", len(self.layer_map), list(self.layer_map),
                 self.top_k, self.num_experts)

    def build(self, kv_cache_config: Any) -> None:
        """Build the capturer once vLLM sized its KV cache: one table row per KV slot."""
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ConfigError(f"r3rdma's vLLM plug-in supports models with one KV cache group, got {len(groups)} "
                              "(hybrid attention / mamba models are not supported yet)")
        block_size = int(groups[0].kv_cache_spec.block_size)
        num_slots = int(kv_cache_config.num_blocks) * block_size
        from r3rdma.capture.capturer import RoutingCapturer

        writer = self.config.build_writer()
        try:
            check = getattr(writer.store, "check", None)
            if callable(check):
                check()  # store nodes: connect and authenticate now, not at the end of the rollout
            self.capturer = RoutingCapturer(
                layer_map=self.layer_map, top_k=self.top_k, num_experts=self.num_experts, num_slots=num_slots,
                sink=_ReportingSink(writer), rollout_id=self.config.rollout_id, device=self.runner.device,
                pin_memory=self.config.pin_host_table, transfer_mode=self.config.transfer_mode, owns_sink=True,
            )
        except BaseException:
            writer.close()
            raise
        log.info("r3rdma: capturing into %s (rollout %r), slot table %d slots",
                 self.config.routing_store_type, self.config.rollout_id, num_slots)

    # -- the step ----------------------------------------------------------------------------

    def prepare(self, scheduler_output: Any) -> None:
        """Snapshot the step as ``_prepare_inputs`` is about to read it (host arrays only)."""
        t0 = time.perf_counter()
        batch = self.runner.input_batch
        n = batch.num_reqs
        req_ids = list(batch.req_ids[:n])
        counts = np.fromiter((scheduler_output.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=n)
        starts = batch.num_computed_tokens_cpu[:n].astype(np.int64)
        slots = self._slots(np.repeat(np.arange(n), counts), np.repeat(starts, counts) + _ranges(counts))
        self._pending = (req_ids, starts, counts, slots)
        self.host_seconds += time.perf_counter() - t0

    def _slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        table = self.runner.input_batch.block_table[0]
        bs = int(table.block_size)
        blocks = table.block_table.np[rows, positions // bs].astype(np.int64)
        return blocks * bs + positions % bs

    def begin(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None or self.capturer is None:
            return
        t0 = time.perf_counter()
        req_ids, starts, counts, slots = pending
        cap = self.capturer
        for i, rid in enumerate(req_ids):
            known = self._known.get(rid, 0)
            if starts[i] > known:
                # Positions this request holds in KV but never computed here: a prefix-cache
                # hit, or blocks still cached when a preempted request resumed.
                positions = np.arange(known, starts[i], dtype=np.int64)
                cap.attach_cached(rid, positions, self._slots(np.full(positions.size, i), positions))
                self.positions_attached += int(positions.size)
            self._known[rid] = int(starts[i] + counts[i])
        cap.begin_step(req_ids, starts, counts, slots)
        self._step_tokens = int(slots.size)
        self.host_seconds += time.perf_counter() - t0

    def end(self, ok: bool) -> None:
        if self._step_tokens is None:
            return
        t0 = time.perf_counter()
        self._step_tokens = None
        if ok:
            self.capturer.end_step()
        else:
            self.capturer.cancel_step()
        self.host_seconds += time.perf_counter() - t0

    def _record(self, layer: int, topk_ids: Any) -> None:
        tokens = self._step_tokens
        if tokens is None:
            return  # profiling, warm-up, dummy batches: not a scheduled step
        if topk_ids.shape[0] < tokens:
            raise ConfigError(
                f"MoE layer {layer} routed {topk_ids.shape[0]} tokens in a step of {tokens}: its tokens are split "
                "across ranks (sequence-parallel or expert-parallel MoE), which r3rdma's vLLM plug-in does not "
                "support yet"
            )
        # Rows past `tokens` are padding (CUDA-graph or data-parallel sizes): a view, no copy.
        t0 = time.perf_counter()
        self.capturer.record(layer, topk_ids[:tokens])
        self.host_seconds += time.perf_counter() - t0

    # -- request lifecycle -------------------------------------------------------------------

    def lifecycle(self, scheduler_output: Any) -> None:
        """Finish, abort and preempt, as the scheduler decided since the last step."""
        if self.capturer is None:
            return
        t0 = time.perf_counter()
        try:
            self._lifecycle(scheduler_output)
        finally:
            self.host_seconds += time.perf_counter() - t0

    def _lifecycle(self, scheduler_output: Any) -> None:
        cap = self.capturer
        for rid in scheduler_output.preempted_req_ids or ():
            self._known.pop(rid, None)
            cap.preempt_request(rid)
        if not scheduler_output.finished_req_ids:
            return
        info = getattr(scheduler_output, "r3_finished", None) or {}
        for rid in scheduler_output.finished_req_ids:
            if rid in self._early:
                self._early.discard(rid)
                continue
            self._finish(rid, info.get(rid))

    def finish_early(self, finished: dict[str, FinishedRequest]) -> None:
        """Requests the scheduler freed but has not sent in a step yet (a flush asked): finish
        them now; their later scheduler output skips them."""
        if self.capturer is None:
            return
        for rid, fin in finished.items():
            self._early.add(rid)
            self._finish(rid, fin)

    def _finish(self, rid: str, fin: "FinishedRequest | None") -> None:
        cap = self.capturer
        self._known.pop(rid, None)
        if fin is None or fin.stored_id is None:
            cap.abort_request(rid)
            self.requests_aborted += 1
            return
        try:
            cap.finish_request(rid, prompt_len=fin.prompt_len, generated_len=fin.generated_len,
                               rollout_id=fin.rollout_id, store_as=fin.stored_id)
            self.requests_stored += 1
        except R3Error as e:
            # One request's rows cannot be stored: say which and why, keep serving the others.
            self.requests_failed += 1
            log.error("r3rdma: routing of request %s (stored as %s/%s) not stored: %s", rid, fin.rollout_id,
                      fin.stored_id, e)

    # -- flush / close -----------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> dict[str, int]:
        """Wait until every finished request is durable in the store; return the counters."""
        if self.capturer is not None:
            self.capturer.flush(timeout)
            try:
                self.capturer.sink.flush(timeout)
            except R3Error as e:
                # Requests whose commit failed (the writer raises them once): reported in the
                # counters and the log below, not as an error that would stop the engine's caller.
                if getattr(e, "failed_request_ids", None) is None:
                    raise
            failed = self.capturer.sink.failed_requests()
            if failed:
                log.error("r3rdma: %d requests could not be committed to the store: %s", len(failed), failed[:10])
        return self.counters()

    def counters(self) -> dict[str, int]:
        cap = self.capturer
        writer_failed = len(cap.sink.failed_requests()) if cap is not None else 0
        return {"stored": self.requests_stored, "aborted": self.requests_aborted,
                "failed": self.requests_failed + writer_failed,
                "preempted": cap.requests_preempted if cap is not None else 0,
                "cached_positions": self.positions_attached,
                "active": cap.active_requests if cap is not None else 0,
                "steps": cap.steps if cap is not None else 0,
                "host_seconds": self.host_seconds}

    def close(self) -> None:
        cap, self.capturer = self.capturer, None
        if cap is not None:
            cap.close()


class _ReportingSink:
    """The writer, with its failures logged instead of refusing the next request.

    A :class:`~r3rdma.write.writer.RoutingWriter` reports a failed commit by raising it from
    the next ``submit``, which would drop that next (good) request too. In an engine the
    failure is logged with the requests it names and the next request is queued as usual;
    :meth:`StepRecorder.flush` returns the count. Everything else is the writer's.
    """

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    def submit(self, record: Any) -> None:
        try:
            self._writer.submit(record)
        except R3Error as e:
            failed = getattr(e, "failed_request_ids", None)
            if failed is None:
                raise  # about this record itself
            log.error("r3rdma: %d requests could not be committed to the store (%s): %s", len(failed), e, failed[:10])
            self._writer.submit(record)  # the error was about earlier requests; it is cleared now

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


def _name(value: Any) -> str | None:
    return None if value is None else str(getattr(value, "name", value))


def _ranges(counts: np.ndarray) -> np.ndarray:
    """[2, 3] -> [0, 1, 0, 1, 2]: each token's offset within its request's run."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - counts, counts)
