"""Routing capture under transformers' own continuous batching (``generate_batch`` machinery).

transformers (>= 5.2x) ships a continuous-batching engine: a background thread schedules requests
into ragged batches over a paged KV cache, with chunked prefill (prompts longer than
``max_batch_tokens`` are split over several forwards), prefix caching (complete blocks are hashed
and shared by later requests with the same prefix), block de-duplication and "soft resets"
(requests evicted under cache pressure and re-prefilled later). :class:`HFContinuousDriver` runs
that engine and announces every forward to a :class:`~r3rdma.capture.capturer.RoutingCapturer` with the
engine's real per-step mapping, so all of the above is exercised on a real model.

How it hooks in (all of it private transformers API, pinned by :func:`_check_internals`, which
raises :class:`~r3rdma.errors.ConfigError` naming the installed version if a piece moved):

* ``ModelRunner.compute_batch(model, batch_data)``: the single choke point before the forward.
  ``inputs_and_outputs.requests_in_batch`` lists the batch's requests in row order with their
  ``query_length``; ``state.position_offset`` has already been advanced past the batch, so each
  request computes positions ``offset - query_length .. offset - 1``. Slots come from the
  allocator's logical block table (``slot = block_id * page_size + offset``, a compact numbering
  the capturer's table is sized for); on CPU they are checked against the physical
  ``write_index`` the attention kernel really uses.
* ``PagedAttentionCache.search_prefix_match``: a prefix hit gives the request shared blocks whose
  positions are never computed for it: ``capturer.attach_cached`` points them at the blocks' slots.
* ``CacheAllocator.mark_complete_blocks``: de-duplication may swap a block the request just wrote
  for an identical existing one and free the written block. The request's positions in it are
  re-pointed (``attach_cached``) at the kept block, whose rows were computed for the same tokens
  after the same prefix (exactly what a prefix hit relies on).
* ``PagedAttentionCache.free_blocks(no_cache=True)``: only the soft-reset path frees this way;
  counted for stats. A reset request is re-prefilled, so its rows are simply rewritten (the
  capturer keeps the latest write per position).
* ``OutputRouter.deliver_batch``: finished requests (prompt and generated tokens) are gathered
  with ``capturer.finish_request`` *before* the output is delivered, so when :meth:`run` returns
  every record was handed to the sink. Blocks are released earlier in the same ``update_batch``
  call, but no forward runs in between, so no slot can be rewritten before the gather.

The wrappers are set as *instance* attributes of this run's own engine objects (not on the
classes), so another model's continuous batching in the same process is untouched, and they are
removed in ``finally``. Every capturer call happens in the engine's generation thread; the
calling thread touches the capturer only before the thread starts and after it has joined.

Not supported (refused with :class:`ConfigError`): CUDA graphs and ``torch.compile`` (router hooks
do not run under graph replay), async double-buffered batching (batch N+1 is scheduled before
batch N's update), CPU KV offloading (restored blocks are copies the capturer does not see),
``num_return_sequences > 1`` (forks copy blocks), sliding-window / hybrid attention (one
full-attention allocator only), a persistent (cached) manager on the model.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from r3rdma.capture.capturer import RoutingCapturer
from r3rdma.errors import ConfigError, R3Error, R3TimeoutError
from r3rdma.ids import validate_id
from r3rdma.integrations.hf_rollout import RolloutOutput, RolloutRequest, StepInfo
from r3rdma.integrations.hf_routers import find_moe_routers

__all__ = ["ContinuousStats", "HFContinuousDriver", "run_continuous_batching", "paged_cache_num_slots"]

_WARMUP_PREFIX = "__warmup_"


@dataclass(slots=True)
class ContinuousStats:
    """What the engine did during one :meth:`HFContinuousDriver.run` (for tests and logs)."""

    steps: int = 0  # forwards captured
    tokens: int = 0  # rows computed (sum over steps)
    chunked_prefill_steps: int = 0  # (request, step) pairs that prefill part of a prompt (more follows)
    prefix_hits: int = 0  # requests that got cached prefix blocks
    prefix_hit_tokens: int = 0  # positions attached from the cache instead of computed
    dedup_swaps: int = 0  # blocks de-duplicated after being written
    soft_resets: int = 0  # requests evicted and requeued for re-prefill
    recomputed_tokens: int = 0  # positions computed more than once for the same request
    num_slots: int = 0  # capturer slots the paged cache needs
    finished: int = 0
    hit_requests: set[str] = field(default_factory=set)
    reset_requests: set[str] = field(default_factory=set)


def paged_cache_num_slots(cache) -> int:
    """Capturer slots needed for a built ``PagedAttentionCache``: every block id it can hand out, times page size.

    Block ids count whole sectors from 0, including the two reserved trash sectors the pool never
    allocates, so ids run up to ``(num_sectors + reserved) * blocks_per_sector - 1``.
    """
    allocator = _single_allocator(cache)
    pool = cache.pool
    num_block_ids = (pool.num_sectors + pool.num_reserved_sectors) * allocator.blocks_per_sector
    return int(num_block_ids * allocator.tokens_per_page)


class HFContinuousDriver:
    """Generates with ``model``'s transformers continuous batching, announcing each forward to ``capturer``.

    Args:
        model: a HF MoE causal LM (``generate_batch``-capable, full attention only).
        capturer: a :class:`RoutingCapturer` with at least :func:`paged_cache_num_slots` slots, or a
            factory ``num_slots -> RoutingCapturer`` called once the paged cache is built (its size
            is only known then), or None to run without capture (stats and listeners only).
        generation_config: a ``transformers.GenerationConfig`` (``max_new_tokens``, ``eos_token_id``,
            ``do_sample``...); ``num_return_sequences`` must be 1.
        cb_config: a ``ContinuousBatchingConfig``; copied, then CUDA graphs, compile, async batching,
            CPU offload and the automatic switch to flash attention are turned off (explicitly
            requesting one of them is a :class:`ConfigError`). ``page_size``, ``num_blocks``,
            ``max_batch_tokens`` (chunked prefill), ``allow_block_sharing`` (prefix caching) and
            ``seed`` are honoured.
        step_listeners: called in the generation thread with each step's :class:`StepInfo` before
            its forward (e.g. :meth:`r3rdma.cli.shadow.ShadowRecorder.on_step`).
        verify_slots: check the compact slots against the engine's physical ``write_index`` when
            it lives on the CPU (free there; on a GPU it would cost a sync per step).
        timeout_s: limit for the whole run; :class:`R3TimeoutError` past it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        capturer: RoutingCapturer | Callable[[int], RoutingCapturer] | None,
        *,
        generation_config=None,
        cb_config=None,
        step_listeners: Sequence[Callable[[StepInfo], None]] = (),
        verify_slots: bool = True,
        timeout_s: float | None = 600.0,
    ) -> None:
        self.model = model
        self._capturer_arg = capturer
        self.capturer: RoutingCapturer | None = capturer if isinstance(capturer, RoutingCapturer) else None
        self.generation_config = generation_config if generation_config is not None else model.generation_config
        self.cb_config = _prepare_cb_config(cb_config)
        self.step_listeners = list(step_listeners)
        self.verify_slots = verify_slots
        self.timeout_s = timeout_s
        self.stats = ContinuousStats()
        self._routers = find_moe_routers(model)
        nrs = getattr(self.generation_config, "num_return_sequences", None)
        if nrs not in (None, 1):
            raise ConfigError(f"num_return_sequences must be 1 (forked requests copy KV blocks), got {nrs}")

    # -- public ----------------------------------------------------------------------------

    def run(self, requests: Sequence[RolloutRequest] | Mapping[str, Sequence[int]]) -> list[RolloutOutput]:
        """Generate every request; returns outputs in request order. Raises on any capture error."""
        reqs = self._normalize(requests)
        if not reqs:
            return []
        if getattr(self.model, "_cached_continuous_batching_manager", None) is not None:
            raise ConfigError(
                "the model holds a persistent continuous batching manager whose cache predates this capturer; "
                "call model.destroy_cached_continuous_batching_manager() first"
            )
        self.stats = ContinuousStats()
        run = _GenerateCall(self, reqs)
        return run.execute()

    # -- helpers ---------------------------------------------------------------------------

    def _normalize(self, requests) -> list[RolloutRequest]:
        if isinstance(requests, Mapping):
            max_new = getattr(self.generation_config, "max_new_tokens", None)
            if max_new is None:
                raise ConfigError("generation_config.max_new_tokens must be set when prompts are given as a mapping")
            requests = [RolloutRequest(rid, tuple(int(t) for t in p), int(max_new)) for rid, p in requests.items()]
        out = list(requests)
        seen = set()
        for r in out:
            validate_id(r.request_id, "request_id")
            if r.request_id in seen:
                raise ConfigError(f"request id {r.request_id!r} appears twice")
            seen.add(r.request_id)
            if not r.prompt or r.max_new_tokens < 1:
                raise ConfigError(f"request {r.request_id!r} needs a non-empty prompt and max_new_tokens >= 1")
        return out


def run_continuous_batching(
    model: torch.nn.Module,
    capturer: RoutingCapturer | Callable[[int], RoutingCapturer] | None,
    prompts: Sequence[RolloutRequest] | Mapping[str, Sequence[int]],
    *,
    generation_config=None,
    cb_config=None,
    step_listeners: Sequence[Callable[[StepInfo], None]] = (),
    timeout_s: float | None = 600.0,
) -> list[RolloutOutput]:
    """One-shot :class:`HFContinuousDriver` run (see its docstring for the arguments)."""
    driver = HFContinuousDriver(
        model,
        capturer,
        generation_config=generation_config,
        cb_config=cb_config,
        step_listeners=step_listeners,
        timeout_s=timeout_s,
    )
    return driver.run(prompts)


# ------------------------------------------------------------------------------------------------
# Internals
# ------------------------------------------------------------------------------------------------

_FORCED_OFF = {
    "use_cuda_graph": (False, lambda v: v is None or v is False or v == (False, False)),
    "use_async_batching": (False, lambda v: not v),
    "varlen_compile_config": (None, lambda v: v is None),
    "decode_compile_config": (None, lambda v: v is None),
    "default_compile_level": (0, lambda v: not v),
    "cpu_offload_space": (0.0, lambda v: v == 0),
    "q_padding_interval_size": (0, lambda v: not v),
    "kv_padding_interval_size": (0, lambda v: not v),
}


def _prepare_cb_config(cb_config):
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as e:  # pragma: no cover - depends on the installed transformers
        raise ConfigError(f"transformers {_tf_version()} has no ContinuousBatchingConfig (needs continuous batching)") from e
    cfg = ContinuousBatchingConfig() if cb_config is None else copy.deepcopy(cb_config)
    for name, (off, ok) in _FORCED_OFF.items():
        if not hasattr(cfg, name):
            raise ConfigError(f"ContinuousBatchingConfig of transformers {_tf_version()} has no field {name!r}")
        value = getattr(cfg, name)
        if not ok(value):
            raise ConfigError(
                f"routing capture needs {name}={off!r} (hooks cannot see graph replays / async or offloaded KV), got {value!r}"
            )
        setattr(cfg, name, off)
    cfg.auto_switch_to_flash = False
    if cfg.page_size < 4:
        raise ConfigError(f"page_size must be >= 4, got {cfg.page_size}")
    return cfg


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def _single_allocator(cache):
    allocators = getattr(cache, "cache_allocators", None)
    if not isinstance(allocators, dict) or len(allocators) != 1 or "full_attention" not in allocators:
        kinds = list(allocators) if isinstance(allocators, dict) else allocators
        raise ConfigError(
            f"routing capture under continuous batching supports full-attention-only models; cache allocators: {kinds}"
        )
    return allocators["full_attention"]


def _require(obj, names: Sequence[str], what: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise ConfigError(
            f"transformers {_tf_version()}: {what} lacks {missing}; the continuous-batching internals r3rdma hooks "
            "changed (see docs/INTEGRATION.md, 'Hugging Face transformers'). Pin a tested transformers version."
        )


def _check_internals(manager) -> None:
    """Pin the private structure this module relies on; ConfigError naming the version if it moved."""
    _require(
        manager,
        [
            "batch_processor",
            "output_router",
            "continuous_batching_config",
            "is_running",
            "add_request",
            "get_result",
            "start",
            "stop",
            "warmup",
            "background_thread_status",
        ],
        "ContinuousBatchingManager",
    )
    bp = manager.batch_processor
    _require(
        bp,
        ["model_runner", "cache", "inputs_and_outputs", "scheduler", "offloading_manager", "use_async_batching"],
        "ContinuousBatchProcessor",
    )
    _require(bp.model_runner, ["compute_batch", "pad_inputs", "inputs_and_outputs"], "ModelRunner")
    _require(bp.inputs_and_outputs, ["requests_in_batch"], "ContinuousBatchingIOs")
    _require(
        bp.cache, ["search_prefix_match", "free_blocks", "pool", "cache_allocators", "use_prefix_sharing"], "PagedAttentionCache"
    )
    _require(bp.cache.pool, ["num_sectors", "num_reserved_sectors"], "CachePool")
    alloc = _single_allocator(bp.cache)
    _require(
        alloc,
        ["block_table", "tokens_per_page", "block_physical_stride", "blocks_per_sector", "mark_complete_blocks"],
        "FullAttentionCacheAllocator",
    )
    _require(manager.output_router, ["deliver_batch"], "OutputRouter")
    from transformers.generation.continuous_batching.requests import FutureRequestState

    if not {"state", "query_length", "has_new_token"} <= set(getattr(FutureRequestState, "__slots__", ())):
        raise ConfigError(f"transformers {_tf_version()}: FutureRequestState lacks state/query_length/has_new_token")
    if bp.use_async_batching or bp.model_runner.pad_inputs:
        raise ConfigError("the resolved continuous batching config uses async batching or padded inputs (graphs/compile)")
    cfg = manager.continuous_batching_config
    if (
        tuple(cfg.cuda_graph_booleans) != (False, False)
        or cfg.varlen_compile_config is not None
        or cfg.decode_compile_config is not None
    ):
        raise ConfigError("the resolved continuous batching config enabled CUDA graphs or torch.compile")
    if bp.offloading_manager._cpu_pool is not None:
        raise ConfigError("CPU KV offloading is enabled; routing capture supports soft resets only")


class _GenerateCall:
    """One generate call: owns the manager, the wrappers and the error channel from the engine thread."""

    def __init__(self, driver: HFContinuousDriver, requests: list[RolloutRequest]) -> None:
        self.d = driver
        self.requests = requests
        self.by_id = {r.request_id: r for r in requests}
        self.stats = driver.stats
        self.capturer: RoutingCapturer | None = driver.capturer
        self.live = False  # hooks act only while True (set False before they are removed)
        self.in_step = False  # router hooks record only inside an announced step
        self.errors: list[BaseException] = []
        self.outputs: dict[str, RolloutOutput] = {}
        self.failed: dict[str, str] = {}
        self.seen: set[str] = set()
        self.max_pos: dict[str, int] = {}
        self._restore: list[Callable[[], None]] = []

    # -- lifecycle -------------------------------------------------------------------------

    def execute(self) -> list[RolloutOutput]:
        model = self.d.model
        try:
            # GenerationMixin's method on the causal LM; torch types a Module's unknown attributes as Tensor | Module.
            manager = model.init_continuous_batching(  # type: ignore[operator]
                generation_config=self.d.generation_config, continuous_batching_config=self.d.cb_config
            )
        except AttributeError as e:
            raise ConfigError(f"{type(model).__name__} has no continuous batching (transformers {_tf_version()})") from e
        started = False
        try:
            # warmup() builds the batch processor (cache, scheduler, runner) in this thread; the
            # generation thread reuses it, so the wrappers below are in place before any step.
            manager.warmup()
            _check_internals(manager)
            bp = manager.batch_processor
            self.cache = bp.cache
            self.alloc = _single_allocator(bp.cache)
            self.tpp = int(self.alloc.tokens_per_page)
            self.io = bp.inputs_and_outputs
            self.stats.num_slots = paged_cache_num_slots(bp.cache)
            self._resolve_capturer()
            self._install(bp, manager.output_router)
            self.live = True
            manager.start()
            started = True
            order = (
                sorted(self.requests, key=lambda r: r.prompt, reverse=True) if bp.cache.use_prefix_sharing else self.requests
            )  # as generate_batch does: neighbours share prefixes
            for r in order:
                manager.add_request(list(r.prompt), request_id=r.request_id, max_new_tokens=r.max_new_tokens)
            self._wait(manager)
        finally:
            try:
                if started:
                    manager.stop(block=True, timeout=self.d.timeout_s)
            finally:
                self.live = False
                thread_alive = manager.is_running()
                if thread_alive and not self.errors:
                    self.errors.append(
                        R3TimeoutError(
                            f"continuous batching thread still running {self.d.timeout_s} s after stop; capture abandoned"
                        )
                    )
                for restore in reversed(self._restore):
                    restore()
                for rid in self.seen - set(self.outputs):
                    if self.capturer is not None and not thread_alive:
                        self.capturer.abort_request(rid)
                if not thread_alive:
                    manager.destroy()
        if self.errors:
            raise self.errors[0]
        if self.failed:
            rid, msg = next(iter(self.failed.items()))
            raise R3Error(f"{len(self.failed)} request(s) failed inside transformers continuous batching; {rid!r}: {msg}")
        missing = [r.request_id for r in self.requests if r.request_id not in self.outputs]
        if missing:
            raise R3Error(f"continuous batching ended without finishing requests {missing[:8]}")
        self.stats.finished = len(self.outputs)
        return [self.outputs[r.request_id] for r in self.requests]

    def _wait(self, manager) -> None:
        deadline = None if self.d.timeout_s is None else time.monotonic() + self.d.timeout_s
        pending = set(self.by_id)
        while pending:
            if self.errors:
                return
            result = manager.get_result(timeout=0.05)
            if result is not None:
                if result.error is not None:
                    self.failed[result.request_id] = str(result.error)
                    pending.discard(result.request_id)
                elif result.is_finished():
                    pending.discard(result.request_id)
                continue
            if not manager.is_running():
                fatal = manager.background_thread_status.fatal_error
                if not self.errors and fatal is not None:
                    self.errors.append(R3Error(f"continuous batching thread died: {fatal!r}"))
                return
            if deadline is not None and time.monotonic() > deadline:
                self.errors.append(
                    R3TimeoutError(f"continuous batching: {len(pending)} requests unfinished after {self.d.timeout_s} s")
                )
                return

    def _resolve_capturer(self) -> None:
        arg = self.d._capturer_arg
        need = self.stats.num_slots
        if arg is None:
            return
        if not isinstance(arg, RoutingCapturer):
            arg = arg(need)
            if not isinstance(arg, RoutingCapturer):
                raise ConfigError(f"the capturer factory returned {type(arg).__name__}, not a RoutingCapturer")
            self.d.capturer = arg
        self.capturer = arg
        if arg.num_slots < need:
            raise ConfigError(
                f"capturer has {arg.num_slots} slots; the paged cache needs {need} "
                "(pass a factory taking num_slots, or size it with paged_cache_num_slots)"
            )
        layers = tuple(r.layer_idx for r in self.d._routers)
        if layers != arg.layer_map:
            raise ConfigError(f"model MoE layers {layers} differ from the capturer's layer_map {arg.layer_map}")

    # -- wrappers --------------------------------------------------------------------------

    def _patch(self, obj, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(obj, name)  # bound method of this instance
        setattr(obj, name, make(original))

        def restore() -> None:
            try:
                delattr(obj, name)  # the instance attribute shadowed the class method
            except AttributeError:
                pass

        self._restore.append(restore)

    def _guard(self, fn: Callable, *args) -> None:
        """Run a capture action in the engine thread; keep the first error and re-raise it to stop the engine."""
        try:
            fn(*args)
        except BaseException as e:
            if not self.errors:
                self.errors.append(e)
            raise

    def _install(self, bp, router) -> None:
        self._patch(bp.model_runner, "compute_batch", self._wrap_compute)
        self._patch(bp.cache, "search_prefix_match", self._wrap_prefix)
        self._patch(bp.cache, "free_blocks", self._wrap_free)
        self._patch(self.alloc, "mark_complete_blocks", self._wrap_complete)
        self._patch(router, "deliver_batch", self._wrap_deliver)
        handles = [r.module.register_forward_hook(self._router_hook(r.layer_idx)) for r in self.d._routers]

        def remove_router_hooks() -> None:
            for handle in handles:
                handle.remove()

        self._restore.append(remove_router_hooks)

    def _slots(self, rid: str, positions: np.ndarray) -> np.ndarray:
        table = np.asarray(self.alloc.block_table[rid], dtype=np.int64)
        return table[positions // self.tpp] * self.tpp + positions % self.tpp

    def _wrap_compute(self, original):
        def compute_batch(model, batch_data):
            if not self.live:
                return original(model, batch_data)
            reqs = list(self.io.requests_in_batch)
            if any(fs.state.request_id.startswith(_WARMUP_PREFIX) for fs in reqs):
                return original(model, batch_data)
            self._guard(self._begin, reqs, batch_data)
            self.in_step = True
            try:
                out = original(model, batch_data)
            except BaseException:
                self.in_step = False
                if self.capturer is not None:
                    self.capturer.cancel_step()
                raise
            self.in_step = False
            if self.capturer is not None:
                self._guard(self.capturer.end_step)
            return out

        return compute_batch

    def _begin(self, reqs, batch_data) -> None:
        rids, starts, counts, slot_parts = [], [], [], []
        for fs in reqs:
            rid = fs.state.request_id
            q = int(fs.query_length)
            past = int(fs.state.position_offset) - q
            if rid not in self.by_id:
                raise ConfigError(f"continuous batching scheduled unknown request {rid!r} (a fork?)")
            pos = np.arange(past, past + q, dtype=np.int64)
            rids.append(rid)
            starts.append(past)
            counts.append(q)
            slot_parts.append(self._slots(rid, pos))
            prev = self.max_pos.get(rid, -1)
            if past <= prev:
                self.stats.recomputed_tokens += int(min(prev + 1, past + q) - past)
            if not fs.has_new_token:  # a prefill chunk that does not end the prompt
                self.stats.chunked_prefill_steps += 1
            self.max_pos[rid] = max(prev, past + q - 1)
            self.seen.add(rid)
        slots = np.concatenate(slot_parts) if slot_parts else np.zeros(0, np.int64)
        total = int(slots.size)
        n_rows = int(batch_data["input_ids"].shape[-1])
        if n_rows != total:
            raise ConfigError(
                f"transformers {_tf_version()}: the batch has {n_rows} input rows but its requests "
                f"announce {total} tokens (padding or a layout change)"
            )
        if self.d.verify_slots:
            wi = batch_data.get("write_index")
            if wi and wi[0].device.type == "cpu" and wi[0].numel():
                physical = wi[0][:total].numpy()
                stride = int(self.alloc.block_physical_stride)
                expect = (slots // self.tpp) * stride + slots % self.tpp
                if physical.shape[0] != total or not np.array_equal(physical, expect):
                    raise ConfigError(
                        f"transformers {_tf_version()}: the KV write indices differ from the block "
                        "table mapping (block_id * block_physical_stride + offset); internals changed"
                    )
        self.stats.steps += 1
        self.stats.tokens += total
        info = StepInfo(tuple(rids), tuple(starts), tuple(counts), torch.arange(total))
        for listener in self.d.step_listeners:
            listener(info)
        if self.capturer is not None:
            self.capturer.begin_step(rids, starts, counts, slots)

    def _router_hook(self, layer_idx: int):
        def hook(_module, _args, output):
            if self.live and self.in_step and self.capturer is not None:
                self._guard(self.capturer.record, layer_idx, output[2])

        return hook

    def _wrap_prefix(self, original):
        def search_prefix_match(request_id, prompt_ids):
            n = original(request_id, prompt_ids)
            if self.live and n and request_id in self.by_id:
                self._guard(self._on_prefix_hit, request_id, int(n))
            return n

        return search_prefix_match

    def _on_prefix_hit(self, rid: str, n: int) -> None:
        self.stats.prefix_hits += 1
        self.stats.prefix_hit_tokens += n
        self.stats.hit_requests.add(rid)
        self.seen.add(rid)
        self.max_pos[rid] = max(self.max_pos.get(rid, -1), n - 1)
        if self.capturer is not None:
            pos = np.arange(n, dtype=np.int64)
            self.capturer.attach_cached(rid, pos, self._slots(rid, pos))

    def _wrap_complete(self, original):
        def mark_complete_blocks(request_id, token_ids, new_new_blocks):
            before = list(self.alloc.block_table.get(request_id, ()))
            result = original(request_id, token_ids, new_new_blocks)
            if self.live and request_id in self.by_id:
                after = self.alloc.block_table.get(request_id, [])
                swapped = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
                if swapped:
                    self._guard(self._on_dedup, request_id, swapped)
            return result

        return mark_complete_blocks

    def _on_dedup(self, rid: str, block_indices: list[int]) -> None:
        # The written block was swapped for an identical one (same tokens, same prefix) and freed;
        # its slots may be reused at once, so point the request at the kept block's rows.
        self.stats.dedup_swaps += len(block_indices)
        if self.capturer is None:
            return
        pos = np.concatenate([np.arange(i * self.tpp, (i + 1) * self.tpp, dtype=np.int64) for i in block_indices])
        self.capturer.attach_cached(rid, pos, self._slots(rid, pos))

    def _wrap_free(self, original):
        def free_blocks(request_id, no_cache=False):
            if self.live and no_cache and request_id in self.by_id:
                # Only the offloading manager frees with no_cache=True: a soft reset (CPU offload is off).
                self.stats.soft_resets += 1
                self.stats.reset_requests.add(request_id)
            return original(request_id, no_cache)

        return free_blocks

    def _wrap_deliver(self, original):
        def deliver_batch(outputs):
            if self.live:
                self._guard(self._on_deliver, outputs)
            return original(outputs)

        return deliver_batch

    def _on_deliver(self, outputs) -> None:
        for out in outputs:
            rid = out.request_id
            if rid not in self.by_id or not out.is_finished():
                continue
            if out.error is not None:
                if self.capturer is not None:
                    self.capturer.abort_request(rid)
                continue
            prompt = tuple(int(t) for t in out.prompt_ids)
            generated = tuple(int(t) for t in out.generated_tokens)
            request = self.by_id[rid]
            if prompt != request.prompt:
                raise ConfigError(f"transformers {_tf_version()}: request {rid!r} came back with a different prompt")
            if self.capturer is not None:
                self.capturer.finish_request(rid, prompt_len=len(prompt), generated_len=len(generated))
            eos = _eos_ids(self.d.generation_config)
            reason = "eos" if generated and generated[-1] in eos else "length"
            self.outputs[rid] = RolloutOutput(rid, prompt, generated, reason)


def _eos_ids(generation_config) -> set[int]:
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        return set()
    if isinstance(eos, int):
        return {eos} if eos >= 0 else set()
    return {int(e) for e in eos if e >= 0}
