"""The worker side of the vLLM plug-in: vLLM's model runner drives r3rdma's capturer.

One :class:`RunnerRecorder` per model runner (so per worker process), on tensor-parallel rank
0 only: under vLLM's tensor parallelism every rank routes every token (the router's logits are
replicated), so one rank's routing is the whole step's, and one rank storing it keeps "each
request stored once". The mapping onto the capturer's calls:

- Inside the model, only one op per MoE layer: every ``MoERunner`` whose router is a vLLM
  ``BaseRouter`` gets :func:`r3rdma.kernels.record_op.record_hook` as its ``capture_fn`` (the
  hook vLLM's own routed-experts capture uses), which writes the layer's ids into one fixed
  step buffer allocated at model load, before vLLM compiles the model or captures a graph.
  vLLM calls it right after top-k and before EPLB maps logical to physical experts, so the ids
  are logical; the layer index is the runner's ``layer_id`` (the decoder layer), so dense
  layers are simply absent from the layer map. The same op runs eagerly, inside
  torch.compile's graph (an opaque custom op) and in a replayed CUDA graph; rows a graph
  writes for its padded size are never stored.
- For a model on the GPU the capturer runs on its own thread
  (:class:`~r3rdma.capture.capture_thread.CaptureThread`; ``capture_thread`` in the config):
  the step path only snapshots what the engine will overwrite (the step's request order,
  positions and KV slots from ``_prepare_inputs``, the rows the model wrote, copied after the
  forward) and hands it over with the lifecycle calls, in order; the capturer's bookkeeping and
  finished requests' gathers then run beside the engine instead of on its step path. Ordering
  keeps it exact: a finished request is gathered before any later step can rewrite its slots.
  For a model on the GPU the capturer's slot table is in host memory (see ``_table_device``):
  the step's rows leave the device in one asynchronous copy and the thread makes no other
  CUDA call. For a model on the CPU the same calls run inline
  (:class:`~r3rdma.capture.capture_thread.InlineCapture`): vLLM's CPU forward keeps every core
  busy in its OpenMP pool, and a thread beside it slowed the engine (measured there).
- ``begin_step`` (``graphed=True``: the forward writes the step buffer itself): from the
  runner's persistent input batch as ``_prepare_inputs`` reads it: the request order, each
  request's computed tokens (the step's first position) and the scheduler's token counts; KV
  slots from the host block table (``block * block_size + offset``, the slot mapping vLLM
  computes on the device, computed here on the host so the step needs no device read). All of
  it array operations over the batch: no Python loop per running request.
- ``end_step`` right after the runner's ``_model_forward`` (handed over then, with the step's
  rows). Forwards outside it (profiling, warm-up, graph capture, dummy batches) write the
  buffer and are never stored.
- Speculative decoding (synchronous scheduling): a step's tokens are each request's last
  token and its drafts, all written to their KV slots, as vLLM writes their KV. A rejected
  draft's position is computed again with the corrected token in the next step, which rewrites
  its slot, exactly as vLLM rewrites its KV; a request's rows are gathered only up to its last
  accepted input, so only accepted tokens' rows are ever stored, and only from the target
  model (the drafter's routers are never hooked).
- Positions a request did not compute in this engine's steps but holds in KV (a prefix-cache
  hit, a request resumed after preemption whose blocks were still cached) are announced with
  ``attach_cached`` from the same block table when the request enters the batch (the
  scheduler output's new requests, and those resumed after preemption): a running request
  always starts where its last step ended, so the step path looks at no other request.
- Lifecycle, from the scheduler output at the start of the next ``execute_model``, before any
  slot is rewritten: finished requests (with the totals and stored id the scheduler side of the
  plug-in attached, :class:`~.messages.FinishedRequest`) go to ``finish_request``;
  aborted ones to ``abort_request``; preempted ones to ``preempt_request``, which keeps the
  rows they computed (the forwards that sampled their tokens) for when they finish.
- Requests whose routing could not be stored (a commit the store refused or that failed, rows
  that could not be gathered) go back to the scheduler with the next step's output
  (:meth:`RunnerRecorder.with_failures`), so a sample of the same prompt that finishes later
  can say so in its response (:mod:`r3rdma.integrations.vllm.scheduler`).
- The first step is checked once (one host read, at start-up): every hooked layer must have
  written its rows, or the engine stops with a ``ConfigError`` instead of storing nothing.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from r3rdma.config import R3Config
from r3rdma.errors import ConfigError, R3Error
from r3rdma.integrations.builders import build_writer
from r3rdma.integrations.vllm.engine_gate import check_engine, read
from r3rdma.integrations.vllm.messages import PREEMPTED_ATTR, FailedRouting, FinishedRequest, attach_failures
from r3rdma.integrations.vllm.settings import LOGGER_NAME
from r3rdma.integrations.vllm.threads import threads_beside_the_model
from r3rdma.kernels.record_op import new_step_buffer, record_hook, unwritten_sentinel

if TYPE_CHECKING:
    from r3rdma.capture.capture_thread import CaptureThread, InlineCapture
    from r3rdma.capture.capturer import RoutingCapturer
    from r3rdma.write.writer import CommitFailure, RoutingWriter

# FinishedRequest: defined in .messages (the scheduler sends it), still importable from here.
__all__ = ["RunnerRecorder", "FinishedRequest", "with_record_op"]

log = logging.getLogger(LOGGER_NAME)


class RunnerRecorder:
    """Maps one vLLM model runner's steps and request lifecycle onto a ``RoutingCapturer``."""

    def __init__(self, runner: Any, config: R3Config) -> None:
        self.runner = runner
        self.config = config
        self.capturer: RoutingCapturer | None = None  # built once vLLM sized its KV cache; None again after close
        self._thread: CaptureThread | InlineCapture | None = None  # runs the capturer's calls, built with it
        self._sink: _ReportingSink | None = None  # the capturer's sink, kept typed for its failure reports
        self.layer_map: tuple[int, ...] = ()
        self.top_k = 0
        self.num_experts = 0
        self.step_buf: torch.Tensor | None = None  # the fixed buffer the model's routers write
        self._step_np: np.ndarray | None = None  # a CPU step buffer's numpy view (see _step_rows)
        self._check_next_step = True  # the first real step proves every hooked layer writes
        self._sentinel: int | None = None  # the value that step's rows were filled with
        self._pending: tuple | None = None  # (req_ids, starts, counts, slots, entering) from _prepare_inputs
        self._open: tuple | None = None  # the step begin() opened: (req_ids, starts, counts, slots, before, after)
        self._rows = np.arange(256)  # a decode step's batch rows (a slice of it)
        self._early: set[str] = set()  # finished by a flush before their scheduler output came
        self.requests_failed = 0
        self.requests_stored = 0
        self.requests_aborted = 0
        self.positions_attached = 0  # prefix-cache hits and resumed requests' cached positions
        self.host_seconds = 0.0  # time spent in this recorder on the engine's step path (bench vllm)

    # -- set-up ----------------------------------------------------------------------------

    def bind_model(self, model: Any) -> None:
        """Allocate the step buffer and install the record op on every MoE router of ``model``
        (before vLLM compiles it or captures a graph); fix the geometry."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        vcfg = self.runner.vllm_config
        check_engine(vcfg)
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
        max_tokens = _max_forward_tokens(self.runner)
        self.step_buf = new_step_buffer(
            max_tokens=max_tokens,
            num_layers=len(self.layer_map),
            top_k=self.top_k,
            num_experts=self.num_experts,
            device=self.runner.device,
        )
        for moe, layer in enumerate(self.layer_map):
            router = runners[layer][2]
            setattr(router, _RECORD_ATTR, record_hook(self.step_buf, moe))
            router.set_capture_fn(with_record_op(router, getattr(router, "capture_fn", None)))
        log.info(
            "r3rdma: recording %d MoE layers %s, top-%d of %d experts, up to %d tokens per forward "
            "(compilation mode %s, cudagraph mode %s)",
            len(self.layer_map),
            list(self.layer_map),
            self.top_k,
            self.num_experts,
            max_tokens,
            _name(getattr(vcfg.compilation_config, "mode", None)),
            _name(getattr(vcfg.compilation_config, "cudagraph_mode", None)),
        )

    def build(self, kv_cache_config: Any) -> None:
        """Build the capturer once vLLM sized its KV cache: one table row per KV slot."""
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ConfigError(
                f"r3rdma's vLLM plug-in supports models with one KV cache group, got {len(groups)} "
                "(hybrid attention / mamba models are not supported yet)"
            )
        block_size = int(groups[0].kv_cache_spec.block_size)
        num_slots = int(kv_cache_config.num_blocks) * block_size
        if self.step_buf is None:
            raise ConfigError("r3rdma: the capturer is built after the model is bound (bind_model), not before")
        with threads_beside_the_model():  # the writer's and the store's threads start in here
            self._build(num_slots)

    def _build(self, num_slots: int) -> None:
        from r3rdma.capture.capture_thread import CaptureThread, InlineCapture
        from r3rdma.capture.capturer import RoutingCapturer

        assert self.step_buf is not None  # checked by build()
        writer = build_writer(self.config)  # store nodes: connected and authenticated now, not at the end of the rollout
        try:
            sink = _ReportingSink(writer)
            threaded = self._threaded()
            table = self._table_device(threaded)
            self.capturer = RoutingCapturer(
                layer_map=self.layer_map,
                top_k=self.top_k,
                num_experts=self.num_experts,
                num_slots=num_slots,
                sink=sink,
                rollout_id=self.config.rollout_id,
                device=table,
                pin_memory=self.config.pin_host_table,
                transfer_mode=self.config.transfer_mode,
                owns_sink=True,
                # On a thread, the capturer's own copy: the model's buffer is rewritten by the
                # next forward while the thread still works on this step (and on the host, a GPU
                # model's rows are copied off the device). Inline, the model's buffer itself:
                # the step is scattered before the next forward runs, so there is nothing to copy.
                step_buffer=torch.zeros(self.step_buf.shape, dtype=self.step_buf.dtype, device=table)
                if threaded
                else self.step_buf,
            )
        except BaseException:
            writer.close()
            raise
        self._sink = sink
        self._thread = CaptureThread(self.capturer) if threaded else InlineCapture(self.capturer)
        log.info(
            "r3rdma: capturing into %s (rollout %r), slot table %d slots on %s, capturer %s",
            self.config.routing_store_type,
            self.config.rollout_id,
            num_slots,
            table,
            "on its own thread" if threaded else "inline",
        )

    def _threaded(self) -> bool:
        """Whether the capturer runs on a thread of its own (``capture_thread``; ``auto``: for a
        model on the GPU). On the CPU, vLLM's forward runs in an OpenMP pool bound to every
        core: a thread beside it takes a core from the pool mid-region and the whole forward
        waits (measured: :class:`~r3rdma.capture.capture_thread.InlineCapture`)."""
        mode = self.config.capture_thread
        if mode != "auto":
            return mode == "on"
        return torch.device(self.runner.device).type == "cuda"

    def _table_device(self, threaded: bool) -> torch.device:
        """Where the capturer's slot table lives: for a model on the GPU whose capturer runs on
        a thread, on the host (each step's rows leave the device in one asynchronous copy, and
        the thread then makes no CUDA call: measured, its CUDA calls waited whenever the engine
        thread sat in a synchronous copy), unless the config asks for the GPU
        (``slot_table_device`` ``cuda``, ``pin_host_table``, or ``transfer_mode``
        ``gpu_direct``, which pushes device rows). Inline, on the model's device (the step
        path then stays kernels, with no host sync)."""
        device = torch.device(self.runner.device)
        cfg = self.config
        if device.type != "cuda" or not threaded:
            return device
        if cfg.slot_table_device.startswith("cuda") or cfg.pin_host_table or cfg.transfer_mode == "gpu_direct":
            return device
        return torch.device("cpu")

    # -- the step ----------------------------------------------------------------------------

    def prepare(self, scheduler_output: Any) -> None:
        """Snapshot the step as ``_prepare_inputs`` is about to read it (host arrays only)."""
        t0 = time.perf_counter()
        batch = self.runner.input_batch
        n = batch.num_reqs
        req_ids = batch.req_ids[:n]
        starts = batch.num_computed_tokens_cpu[:n].astype(np.int64)
        if scheduler_output.total_num_scheduled_tokens == n:
            # Decodes only (the common step): token i is request i's next position. No
            # per-request lookup of the token counts (each numpy call or pass over the batch
            # costs microseconds here, with the caches cold from the forward).
            if self._rows.size < n:
                self._rows = np.arange(max(n, 2 * self._rows.size))
            counts: np.ndarray | int = 1  # every request one token (begin_step takes the int)
            slots = self._slots(self._rows[:n], starts)
        else:
            counts = np.fromiter(map(scheduler_output.num_scheduled_tokens.__getitem__, req_ids), dtype=np.int64, count=n)
            slots = self._slots(np.repeat(np.arange(n), counts), np.repeat(starts, counts) + _ranges(counts))
        # Requests that may start past position 0 without having computed it here: new ones
        # (a prefix-cache hit) and ones resumed after preemption (blocks still cached). A
        # running request always starts where its last step ended.
        entering = [d.req_id for d in scheduler_output.scheduled_new_reqs]
        entering.extend(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        self._pending = (req_ids, starts, counts, slots, entering)
        self.host_seconds += time.perf_counter() - t0

    def _slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        table = self.runner.input_batch.block_table[0]
        bs = int(table.block_size)
        block_idx, offset = np.divmod(positions, bs)
        slots = np.multiply(table.block_table.np[rows, block_idx], bs, dtype=np.int64)  # int32 blocks, int64 slots
        slots += offset
        return slots

    def begin(self) -> None:
        """Open the step ``prepare`` snapshotted, right before its forward: find the newly
        cached positions of requests entering the batch (the block table is read now)."""
        pending, self._pending = self._pending, None
        if pending is None or self.capturer is None:
            return
        t0 = time.perf_counter()
        req_ids, starts, counts, slots, entering = pending
        before: list[tuple[str, np.ndarray, np.ndarray]] = []
        after: list[tuple[str, np.ndarray, np.ndarray]] = []
        index = self.runner.input_batch.req_id_to_index
        for rid in entering:
            i = index.get(rid)
            if i is None or i >= len(req_ids) or not starts[i]:
                continue
            # Positions this request holds in KV but never computed here: a prefix-cache hit,
            # or blocks still cached when a preempted request resumed.
            positions = np.arange(starts[i], dtype=np.int64)
            hit = self._slots(np.full(positions.size, i), positions)
            if np.isin(hit, slots).any():
                # vLLM caches a block when it allocates it, so a request scheduled in the same
                # step as the one computing a prompt (n > 1 samples, a shared system prompt)
                # hits blocks this very forward writes (each layer writes the whole batch's KV
                # before any attention reads it). Their rows exist once the step has ended.
                after.append((rid, positions, hit))
            else:
                before.append((rid, positions, hit))
            self.positions_attached += int(positions.size)
        self._open = (req_ids, starts, counts, slots, before, after)
        total = int(slots.size)
        buf = self.step_buf  # set by bind_model, before the capturer is built
        if self._check_next_step and total and buf is not None:
            self._sentinel = unwritten_sentinel(buf, self.num_experts)
            if self._sentinel is not None:
                buf[:total].fill_(self._sentinel)  # on the device, no sync
        self.host_seconds += time.perf_counter() - t0

    def end(self, ok: bool) -> None:
        """Close the open step after its forward: hand it, with the rows the model wrote, to the
        capture thread if the forward returned (``ok``); else drop it (only the positions cached
        before it are handed over)."""
        if self._open is None:
            return
        t0 = time.perf_counter()
        (req_ids, starts, counts, slots, before, after), self._open = self._open, None
        thread = self._thread
        if thread is None:  # begin() opens a step only with a capturer, and the engine closes its workers after the last step
            raise ConfigError("r3rdma: a vLLM step ended after the recorder was closed")
        if not ok:
            if before and self.capturer is not None:
                thread.submit(_attach_all, self.capturer, before)
            return
        total = int(slots.size)
        if self._check_next_step and total:
            self._check_next_step = False
            self._check_layers_wrote(total)
        thread.step(req_ids, starts, counts, slots, self._step_rows(total), before=before, after=after)
        self.host_seconds += time.perf_counter() - t0

    def _step_rows(self, total: int) -> torch.Tensor | np.ndarray:
        """The rows the model wrote this step: a numpy view on the CPU (the hand-over then copies
        them with numpy, without torch's dispatch), the device buffer's first rows on the GPU."""
        buf = self.step_buf
        if buf is None:  # set by bind_model, before the capturer is built
            raise ConfigError("r3rdma: a vLLM step ended before the model was bound")
        if buf.is_cuda:
            return buf[:total]
        if self._step_np is None:
            self._step_np = buf.numpy()
        return self._step_np[:total]

    def _check_layers_wrote(self, total: int) -> None:
        """Once, at the first real step: every hooked MoE layer wrote its rows (one host read).

        A layer that did not means a forward path the hook is not on (a model that routes
        outside vLLM's BaseRouter, a compiled artifact built without the hook): the engine
        would store rows that are not routing, so it stops here, saying which layers."""
        buf = self.step_buf
        if self._sentinel is None or buf is None:  # no sentinel was filled in (the buffer is set whenever one is)
            return
        unwritten = (buf[:total] == self._sentinel).all(dim=-1).any(dim=0).tolist()
        missing = [layer for layer, bad in zip(self.layer_map, unwritten) if bad]
        if missing:
            raise ConfigError(
                f"r3rdma: MoE layers {missing} of {list(self.layer_map)} did not record their routing in the first step "
                "(the forward does not call the router hook r3rdma installed: a model whose MoE routes outside vLLM's "
                "BaseRouter, or a torch.compile cache built without routing replay; try VLLM_DISABLE_COMPILE_CACHE=1)"
            )

    # -- request lifecycle -------------------------------------------------------------------

    def lifecycle(self, scheduler_output: Any) -> None:
        """Finish, abort and preempt, as the scheduler decided since the last step (handed to
        the capture thread, ahead of this step)."""
        cap, thread = self.capturer, self._thread
        if cap is None or thread is None:
            return
        t0 = time.perf_counter()
        try:
            self._lifecycle(cap, thread, scheduler_output)
        finally:
            self.host_seconds += time.perf_counter() - t0

    def _lifecycle(self, cap: RoutingCapturer, thread: CaptureThread | InlineCapture, scheduler_output: Any) -> None:
        preempted = scheduler_output.preempted_req_ids
        if preempted:
            # The rows a preempted request computed are kept as first computed (the forwards
            # that sampled its tokens; vLLM's own capture returns those too). Without drafts,
            # every position it computed. With speculative drafts, the positions the scheduler
            # counted when it preempted (PREEMPTED_ATTR): this input batch is not yet updated
            # for the drafts its last step accepted, so its own count misses those, and their
            # rows would come from the recompute (seen on an H200: 1 row of 540 differed).
            spec = self.runner.vllm_config.speculative_config is not None
            counted = getattr(scheduler_output, PREEMPTED_ATTR, None) or {}
            batch = self.runner.input_batch
            for rid in preempted:
                computed = None
                if spec:
                    computed = counted.get(rid)
                    if computed is None:  # preempted where the plug-in's scheduler side did not see it
                        i = batch.req_id_to_index.get(rid)
                        computed = 0 if i is None else int(batch.num_computed_tokens_cpu[i])
                thread.submit(cap.preempt_request, rid, computed=computed)
        if not scheduler_output.finished_req_ids:
            return
        info = getattr(scheduler_output, "r3_finished", None) or {}
        for rid in scheduler_output.finished_req_ids:
            if rid in self._early:
                self._early.discard(rid)
                continue
            thread.submit(self._finish, cap, rid, info.get(rid))

    def finish_early(self, finished: dict[str, FinishedRequest]) -> None:
        """Requests the scheduler freed but has not sent in a step yet (a flush asked): finish
        them now; their later scheduler output skips them."""
        cap, thread = self.capturer, self._thread
        if cap is None or thread is None:
            return
        for rid, fin in finished.items():
            self._early.add(rid)
            thread.submit(self._finish, cap, rid, fin)

    def _finish(self, cap: RoutingCapturer, rid: str, fin: FinishedRequest | None) -> None:
        """One request leaves the engine (on the capture thread): stored, or forgotten if aborted."""
        if fin is None or fin.stored_id is None:
            cap.abort_request(rid)
            self.requests_aborted += 1
            return
        try:
            cap.finish_request(
                rid, prompt_len=fin.prompt_len, generated_len=fin.generated_len, rollout_id=fin.rollout_id, store_as=fin.stored_id
            )
            self.requests_stored += 1
        except R3Error as e:
            # One request's rows cannot be stored: say which and why, keep serving the others.
            self.requests_failed += 1
            if self._sink is not None:  # always: build() sets it with the capturer
                self._sink.refused(fin.rollout_id, fin.stored_id, e)
            log.error("r3rdma: routing of request %s (stored as %s/%s) not stored: %s", rid, fin.rollout_id, fin.stored_id, e)

    def with_failures(self, output: Any) -> Any:
        """A step's model runner ``output`` carrying the requests whose routing failed since the
        last step (:func:`~.messages.attach_failures`), for the scheduler: a sample of the same
        prompt that finishes later names them in its response. ``output`` unchanged when there
        are none (nearly always: one integer compared per step)."""
        sink = self._sink
        if sink is None or output is None:
            return output
        failures = sink.new_failures()
        if not failures:
            return output
        return attach_failures(
            output,
            tuple(FailedRouting(f.rollout_id, f.request_id, f.reason) for f in failures if f.rollout_id and f.request_id),
        )

    # -- flush / close -----------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until the capture thread ran everything handed to it and every finished
        request is durable in the store, or its commit failed; return :meth:`counters`. A
        failed commit is not raised: the writer logged it when it failed, and the counters
        name it (``failed``, ``failures``)."""
        if self._thread is not None:
            self._thread.call(self._flush_on_thread, timeout, timeout=timeout)
        return self.counters()

    def _flush_on_thread(self, timeout: float | None) -> None:
        if self.capturer is None or self._sink is None:
            return
        self.capturer.flush(timeout)
        try:
            self._sink.flush(timeout)
        except R3Error as e:
            # Requests whose commit failed (the writer raises them once): in the counters,
            # not an error that would stop the engine's caller.
            if getattr(e, "failed_request_ids", None) is None:
                raise

    def counters(self) -> dict[str, Any]:
        """Cumulative since the engine started, JSON-friendly: ``stored`` (finished requests
        handed to the writer), ``aborted``, ``failed`` (requests whose routing is not stored:
        rows that could not be gathered, or a commit that failed) and ``failures`` (each of
        those as ``{"rollout_id", "request_id", "reason"}``), ``preempted``,
        ``cached_positions``, ``active``, ``steps``, ``commits`` (batches the writer handed
        to the store), ``host_seconds`` (on the engine's step
        path), ``capture_thread_seconds`` (the capturer's own work, on its thread),
        ``capture_thread_cpu_seconds`` (that work's CPU time: well below it, the thread waited
        for the GIL) and ``capture_thread_wait_seconds`` (the thread waiting for steps' rows to
        leave the device)."""
        cap = self.capturer
        failures: list[CommitFailure] = self._sink.failures() if cap is not None and self._sink is not None else []
        return {
            "stored": self.requests_stored,
            "aborted": self.requests_aborted,
            "failed": len(failures) if cap is not None else self.requests_failed,
            "preempted": cap.requests_preempted if cap is not None else 0,
            "cached_positions": self.positions_attached,
            "active": cap.active_requests if cap is not None else 0,
            "steps": cap.steps if cap is not None else 0,
            "commits": self._sink.commits if cap is not None and self._sink is not None else 0,
            "host_seconds": self.host_seconds,
            "capture_thread_seconds": self._thread.busy_seconds if self._thread is not None else 0.0,
            "capture_thread_cpu_seconds": self._thread.cpu_seconds if self._thread is not None else 0.0,
            "capture_thread_wait_seconds": self._thread.wait_seconds if self._thread is not None else 0.0,
            "failures": [{"rollout_id": f.rollout_id, "request_id": f.request_id, "reason": f.reason} for f in failures],
        }

    def close(self) -> None:
        """Run what the capture thread holds, then close the capturer (every finished request
        made durable, the writer and its store closed); idempotent. Everything is closed even
        when the thread stopped on an error; the first error is raised."""
        cap, self.capturer = self.capturer, None
        thread, self._thread = self._thread, None
        errors: list[BaseException] = []
        if thread is not None:
            try:
                thread.close()
            except BaseException as e:
                errors.append(e)
        if cap is not None:
            try:
                cap.close()  # on this thread: the capture thread has stopped
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]


class _ReportingSink:
    """The writer, with its failures reported instead of refusing the next request.

    A :class:`~r3rdma.write.writer.RoutingWriter` reports a failed commit by raising it from
    the next ``submit``, which would drop that next (good) request too. The writer already
    logged the failure when it happened (naming the requests and why), so here the next
    request is simply queued as usual. :meth:`failures` adds the requests whose record could
    not even be built (:meth:`refused`, from :meth:`RunnerRecorder._finish`) to the writer's
    failed commits; :meth:`RunnerRecorder.counters` reports them all. Everything else is the
    writer's.
    """

    def __init__(self, writer: RoutingWriter) -> None:
        self._writer = writer
        self._refused: list[CommitFailure] = []
        self._reported = (0, 0, 0)  # refused, the writer's failure count and list length, at new_failures' last call

    def submit(self, record: Any) -> None:
        """Queue ``record`` with the writer; a raised failure of earlier commits does not refuse it."""
        try:
            self._writer.submit(record)
        except R3Error as e:
            if getattr(e, "failed_request_ids", None) is None:
                raise  # about this record itself
            self._writer.submit(record)  # the error was about earlier requests; it is cleared now

    def refused(self, rollout_id: str | None, request_id: str | None, error: BaseException) -> None:
        """Note a finished request whose routing never reached the writer, and why."""
        from r3rdma.write.writer import CommitFailure

        self._refused.append(CommitFailure(rollout_id, request_id, CommitFailure.reason_of(error)))

    def failures(self) -> list[CommitFailure]:
        """The requests refused before the writer, then the writer's failed commits
        (:class:`~r3rdma.write.writer.CommitFailure`, each part in failure order)."""
        return self._refused + self._writer.failures()

    def new_failures(self) -> list[CommitFailure]:
        """The failures (as :meth:`failures`) not handed out by an earlier call; without any,
        two integers compared (the writer's ``requests_failed`` counter moves with each)."""
        seen_refused, seen_count, seen_listed = self._reported
        refused, count = len(self._refused), self._writer.requests_failed
        if refused == seen_refused and count == seen_count:
            return []
        new = self._refused[seen_refused:refused]
        if count != seen_count:
            listed = self._writer.failures()
            new += listed[seen_listed:]
            seen_listed = len(listed)
        self._reported = (refused, count, seen_listed)
        return new

    # What the capturer asks of its sink, spelled out: on Python 3.12+ ``isinstance`` against
    # the protocols in r3rdma.contracts looks attributes up statically, past ``__getattr__``.
    accepts_deferred = True

    @property
    def accepts_device_rows(self) -> bool:
        """The writer's: whether it takes device rows now."""
        return self._writer.accepts_device_rows

    def probe_transfer_mode(self, device=None):
        """The writer's transfer-mode probe."""
        return self._writer.probe_transfer_mode(device=device)

    def hand_over(self, record: Any) -> None:
        """The writer's ``hand_over``: queue a record; a failed commit of another request is not raised here."""
        self._writer.hand_over(record)

    def close(self, *args: Any) -> None:
        """Close the writer (every queued record made durable or failed first)."""
        self._writer.close(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


_RECORD_ATTR = "_r3_record_op"  # the record op bound to a router, kept first by every set_capture_fn


def with_record_op(router: Any, capture_fn: Callable[[torch.Tensor], None] | None) -> Callable[[torch.Tensor], None] | None:
    """The capture function ``router`` should hold when ``capture_fn`` is set on it: r3rdma's
    record op first (when bound), then ``capture_fn`` (another capture: vLLM's own
    ``enable_return_routed_experts`` binds one when the KV cache is sized, after the model
    load where the record op was bound). Both captures then see the same ``topk_ids``; without
    this the later one replaced the record op and the first step's check stopped the engine."""
    ours = getattr(router, _RECORD_ATTR, None)
    if ours is None or capture_fn is None or capture_fn is ours or getattr(capture_fn, "func", None) is _record_then:
        return capture_fn if capture_fn is not None else ours
    return functools.partial(_record_then, ours, capture_fn)


def _record_then(record: Callable[[torch.Tensor], None], other: Callable[[torch.Tensor], None], topk_ids: torch.Tensor) -> None:
    # A partial of a module function, like record_hook: dynamo inlines it to the two calls.
    record(topk_ids)
    other(topk_ids)


def _attach_all(cap: RoutingCapturer, attaches: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
    for rid, positions, slots in attaches:
        cap.attach_cached(rid, positions, slots)


def _max_forward_tokens(runner: Any) -> int:
    """Tokens one forward can carry, padding included: vLLM sizes its input buffers (and so
    every CUDA-graph capture size and dummy run) from ``max_num_tokens``."""
    sched = read(runner.vllm_config, "scheduler_config", "VllmConfig")
    return int(max(read(runner, "max_num_tokens", "GPUModelRunner"), read(sched, "max_num_batched_tokens", "SchedulerConfig")))


def _name(value: Any) -> str | None:
    return None if value is None else str(getattr(value, "name", value))


def _ranges(counts: np.ndarray) -> np.ndarray:
    """[2, 3] -> [0, 1, 0, 1, 2]: each token's offset within its request's run."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - counts, counts)
