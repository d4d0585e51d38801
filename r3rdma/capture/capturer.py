"""Engine-agnostic routing capture.

The engine drives a :class:`RoutingCapturer` with four kinds of calls::

    capturer.begin_step(request_ids, start_positions, num_tokens, slots_T)  # what the step computes
    capturer.record(layer_idx, topk_ids_TK)          # from each MoE router, during the forward
    capturer.end_step()                              # rows go to the slot table
    capturer.finish_request(request_id, prompt_len=..., generated_len=...)   # or abort_request

Rows live in a slot table indexed by KV slot, like the KV cache itself: a request whose prefix
hits cached KV slots (announced with :meth:`RoutingCapturer.attach_cached`) gets the rows those
slots hold. A request's rows are gathered from its slots when it finishes.

Host-side bookkeeping knows, for every request position, which slot holds its row and which
*write generation* of that slot it relies on; a slot rewritten by another token before the
request gathered it is detected (:class:`StaleSlotError`) instead of returning someone else's
row, and a position never computed is an error (:class:`MissingRowsError`), never zeros.

Engine features (the contract in full: docs/ENGINE_SEMANTICS.md): chunked prefill (steps with
``start_positions > 0``), chunked MoE (``record(..., token_offset=)``), speculative decoding
(``end_step(accepted_T)``), draft models (their own capturer; :meth:`RoutingCapturer.suspended`
for shared hooks), preemption (:meth:`RoutingCapturer.preempt_request`), n > 1 samples
(:meth:`RoutingCapturer.fork_request` or prefix hits), overlap scheduling (a request may finish
or abort while a step that includes it is open), evicted KV blocks
(:meth:`RoutingCapturer.release_slots`), EPLB replicas (``expert_map``), multi-turn and
prefill/decode disaggregation (``finish_request(..., store_as=, start_row=, final=, total_rows=)``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import zlib
from typing import Iterator, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from r3rdma.errors import ConfigError, CaptureStateError, MissingRowsError, ShapeMismatchError, StaleSlotError
from r3rdma.ids import validate_id
from r3rdma.kernels import gather_rows, graph_regime, record_layer, table_dtype, write_step_rows
from r3rdma.records import RequestRecord, routing_dtype

__all__ = ["RoutingCapturer", "RoutingSink", "DeviceRowsSink", "num_routing_rows"]


def num_routing_rows(prompt_len: int, generated_len: int) -> int:
    """Rows of a finished request: every position that was the input of a forward.

    The last sampled token is never an input, so ``prompt_len + generated_len - 1``.
    """
    if prompt_len < 1 or generated_len < 0:
        raise ShapeMismatchError(f"need prompt_len >= 1 and generated_len >= 0, got {prompt_len}, {generated_len}")
    return prompt_len + max(generated_len, 1) - 1


class RoutingSink(Protocol):
    """Where finished requests go (a :class:`~r3rdma.write.writer.RoutingWriter`, a test list...)."""

    def submit(self, record: RequestRecord) -> None: ...


@runtime_checkable
class DeviceRowsSink(Protocol):
    """A sink that can take :class:`~r3rdma.capture.transfer.DeviceRows` (GPU-direct pushes) and
    measure whether that beats staging: a :class:`~r3rdma.write.writer.RoutingWriter`.

    ``accepts_device_rows`` says whether it can *now*: a writer over store nodes can, a writer
    over the local store cannot (its store writes host bytes), so the attribute is a value, not
    only a presence.
    """

    @property
    def accepts_device_rows(self) -> bool: ...

    def submit(self, record) -> None: ...

    def probe_transfer_mode(self, device=None): ...


def _takes_device_rows(sink: object) -> bool:
    return isinstance(sink, DeviceRowsSink) and bool(sink.accepts_device_rows)


class _RequestState:
    """Per request: slot and slot generation of each position (-1 = not computed)."""

    __slots__ = ("slots", "gens")

    def __init__(self) -> None:
        self.slots = np.full(64, -1, dtype=np.int64)
        self.gens = np.full(64, -1, dtype=np.int64)

    def ensure(self, size: int) -> None:
        if size > self.slots.shape[0]:
            new = max(size, 2 * self.slots.shape[0])
            self.slots = np.concatenate([self.slots, np.full(new - self.slots.shape[0], -1, np.int64)])
            self.gens = np.concatenate([self.gens, np.full(new - self.gens.shape[0], -1, np.int64)])


class RoutingCapturer:
    """Captures top-k routing per token and MoE layer into a KV-slot-indexed table.

    Args:
        layer_map: decoder-layer index of each MoE layer, in order (dense layers absent).
            ``record`` takes the decoder-layer index; row axis L follows this order.
        top_k: experts per token.
        num_experts: ids a router can emit (shared experts included); picks the dtype.
        num_slots: KV slots of the engine's cache (table rows).
        sink: receives each finished request's :class:`RequestRecord`; None keeps them for the
            caller (``finish_request`` returns the record either way).
        rollout_id: rollout of finished requests unless ``finish_request`` names one.
        device: where the slot table and step buffer live. On a CUDA device the whole step
            path is kernels on the current stream, with no host synchronisation: slot indices
            travel host -> device through pinned staging memory, ``record`` is one kernel per
            layer (:mod:`r3rdma.kernels`), and ``end_step`` one scatter. A step can also be
            captured in a CUDA graph (:meth:`graph_capture`, ``begin_step(graphed=True)``).
            On CUDA with a sink, ``finish_request`` gathers on the GPU, starts an asynchronous
            copy into pinned host memory and returns None at once; a finisher thread hands the
            record to the sink when the copy has landed (:meth:`flush` waits for that).
        transfer_mode: how finished rows leave the GPU (:mod:`r3rdma.capture.transfer`): ``auto``
            (measure both against the sink's first store node at construction and keep the
            faster; ``staged`` when the sink is not a store-node pusher or off CUDA), ``staged``
            (pinned host copy, the default) or
            ``gpu_direct`` (the device rows themselves go to a sink that takes them, a
            :class:`~r3rdma.write.writer.RoutingWriter` over a
            :class:`~r3rdma.write.push_client.StoreNodesClient`, and UCX reads device memory). With a
            sink that cannot take device rows, ``gpu_direct`` is refused at construction.
        pin_memory: keep the slot table in pinned host memory. On CUDA it is mapped into the
            device's address space (UVA), so the same kernels write it over PCIe: no HBM for
            the table (it can be large: slots x layers x top-k), at the price of slower
            scatters and gathers.
        tp_group: a tensor-parallel process group whose ranks split each step's MoE tokens
            (sequence-parallel MoE): rank ``r`` of ``P`` routes tokens ``[r*c, min((r+1)*c, T))``
            with ``c = ceil(T/P)``, and ``end_step`` all-gathers the step's rows of all layers in
            one ``all_gather_into_tensor`` so every rank's slot table holds every row. Every rank
            announces the whole step. The rank ``crc32(stored id) % P`` gathers and pushes a
            finished request (the stored id is ``store_as`` when given, else the request id, so
            every turn of a conversation is pushed by the same rank, in order);
            ``finish_request`` returns None on the others.
        expert_map: EPLB / redundant experts: ``expert_map[physical_id]`` is the logical expert
            of each physical replica the router may emit (1-D integer tensor, values in
            ``0 .. num_experts - 1``). ``record`` maps ids through it on the device, without a
            host sync, so the stored ids are always logical. ``num_experts`` counts logical
            experts. Change it between steps with :meth:`set_expert_map`.
        check_ids: check every recorded router id against the range the capturer can store
            (``0 .. num_experts - 1``, or ``0 .. len(expert_map) - 1`` physical ids with an
            ``expert_map``): an id outside it would wrap in the narrow storage dtype and be
            stored as the wrong expert (EPLB physical ids without an ``expert_map``). Off by
            default: it costs no host sync, but it doubles the capture's device work. On an
            H200 (CUDA graphs, batch 64, 24 layers, ``r3rdma bench capture``) capture cost
            +69 us per step (0.30%) without it and +139-154 us (0.62-0.68%) with it, past the
            0.5% budget. Turn it on for validation runs, or whenever the router may emit
            physical ids (EPLB) and no ``expert_map`` is set. It works so: ``record`` adds one ``aminmax`` reduction
            per layer on the device (into this step's ``[L]`` pair), and ``end_step`` two
            in-place clamps folding it into a running ``[L]`` pair of lowest and highest ids
            (chunked MoE: three small kernels per chunk instead). On CPU (torch dispatch
            overhead) this measured 0.83 -> 1.3 ms per step for L=48, K=8, T=256. That pair is read where a host read
            happens anyway: on a CPU device at ``finish_request``; on CUDA from a pinned copy
            issued asynchronously at ``finish_request`` and read at a later ``finish_request``
            once its event has completed (``Event.query``, no wait), at :meth:`flush` and at
            :meth:`set_expert_map` (both synchronise already). A bad id raises
            :class:`ShapeMismatchError` naming the layer and the id; on CUDA it may surface a
            few finishes after the step that produced it.
        owns_sink: :meth:`close` also closes ``sink`` (which must then have ``close()``, taking
            the timeout when :meth:`close` is given one).
            :meth:`R3Config.build_capturer <r3rdma.config.R3Config.build_capturer>` sets it for
            the writer (and store) it builds; a sink the caller passes in stays the caller's to
            close unless it says otherwise.

    A capturer is a context manager: ``with`` closes it (see :meth:`close`).
    """

    def __init__(
        self,
        *,
        layer_map: Sequence[int],
        top_k: int,
        num_experts: int,
        num_slots: int,
        sink: RoutingSink | None = None,
        rollout_id: str = "default",
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
        expert_map: torch.Tensor | Sequence[int] | None = None,
        tp_group: "torch.distributed.ProcessGroup | None" = None,
        transfer_mode: str = "staged",
        owns_sink: bool = False,
        check_ids: bool = False,
    ) -> None:
        self.layer_map = tuple(int(x) for x in layer_map)
        if not self.layer_map:
            raise ShapeMismatchError("layer_map is empty: the model has no MoE layer to capture")
        if len(set(self.layer_map)) != len(self.layer_map):
            raise ShapeMismatchError(f"layer_map has repeated layers: {self.layer_map}")
        if top_k < 1 or num_slots < 1:
            raise ShapeMismatchError(f"need top_k >= 1 and num_slots >= 1, got {top_k}, {num_slots}")
        self.top_k = int(top_k)
        self.num_experts = int(num_experts)
        self.num_slots = int(num_slots)
        self.storage_dtype = routing_dtype(num_experts)
        if owns_sink and not callable(getattr(sink, "close", None)):
            raise ConfigError(f"owns_sink=True needs a sink with close(), got {type(sink).__name__}")
        self.sink = sink
        self.owns_sink = bool(owns_sink)
        self.rollout_id = validate_id(rollout_id, "rollout_id")
        self.device = _device(device)
        if (self.device.type == "cuda" or pin_memory) and not torch.cuda.is_available():
            what = f"device {self.device}" if self.device.type == "cuda" else "pin_memory=True (page-locked host memory)"
            raise ConfigError(f"{what} needs CUDA, but torch sees no CUDA device (torch {torch.__version__})")
        self._moe_index = {layer: i for i, layer in enumerate(self.layer_map)}
        dtype = table_dtype(num_experts)
        shape = (self.num_slots, len(self.layer_map), self.top_k)
        self._host_table: torch.Tensor | None = None
        if pin_memory and self.device.type == "cpu":
            self.table_SLK = torch.zeros(shape, dtype=dtype).pin_memory()
        elif pin_memory:
            # Pinned memory from cudaHostAlloc is mapped, and with unified addressing its host
            # pointer is valid on the device: a CUDA tensor over the same bytes lets the usual
            # kernels (torch and Triton) write it. _host_table keeps the allocation alive.
            self._host_table = torch.zeros(shape, dtype=dtype).pin_memory()
            self.table_SLK = _device_view_of_pinned(self._host_table, self.device)
        else:
            self.table_SLK = torch.zeros(shape, dtype=dtype, device=self.device)
        self._step_buf = torch.zeros((0, len(self.layer_map), self.top_k), dtype=dtype, device=self.device)
        self._cuda = self.device.type == "cuda"
        self.transfer_probe = None
        if transfer_mode == "auto":
            # Measured once, at start-up, against the sink's first store node when the sink can
            # push device memory; otherwise (local store, CPU) staged, as r3rdma.capture.transfer says.
            transfer_mode = "staged"
            if self._cuda and _takes_device_rows(sink):
                self.transfer_probe = sink.probe_transfer_mode(device=self.device)
                transfer_mode = self.transfer_probe.mode
        if transfer_mode not in ("staged", "gpu_direct"):
            raise ConfigError(f"transfer_mode must be auto, staged or gpu_direct, got {transfer_mode!r}")
        if transfer_mode == "gpu_direct" and not _takes_device_rows(sink):
            raise ConfigError(
                "transfer_mode 'gpu_direct' needs a sink that pushes device memory (a RoutingWriter over a "
                f"StoreNodesClient); {type(sink).__name__} does not"
            )
        self.transfer_mode = transfer_mode
        self._rows_buf = torch.zeros(0, dtype=torch.int64, device=self.device)  # graphed router_rows
        self._graph_tokens: dict[int, tuple[int, int, bool]] = {}  # T -> (step buf ptr, rows buf ptr, router_rows)
        self._finisher: _Finisher | None = None
        self._slot_gen = np.zeros(self.num_slots, dtype=np.int64)  # writes so far, per slot
        self._requests: dict[str, _RequestState] = {}
        self._step: _Step | None = None
        self._slot_valid = np.zeros(self.num_slots, dtype=bool)  # written and not released since
        self._suspended = 0
        self._expert_map: torch.Tensor | None = None
        self.check_ids = bool(check_ids)
        # Running lowest / highest router id per MoE layer since the last check (device).
        self._ids_lo_L = torch.zeros(len(self.layer_map), dtype=torch.int64, device=self.device)
        self._ids_hi_L = torch.zeros(len(self.layer_map), dtype=torch.int64, device=self.device)
        self._ids_probe: tuple[torch.Tensor, torch.cuda.Event] | None = None  # CUDA: copy in flight
        # This step's range per layer, in the router's dtype (one aminmax writes it in place).
        self._step_lo_L: torch.Tensor | None = None
        self._step_hi_L: torch.Tensor | None = None
        if expert_map is not None:
            self.set_expert_map(expert_map)
        self._tp_group = tp_group
        if tp_group is not None:
            import torch.distributed as dist

            self._tp_rank, self._tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        else:
            self._tp_rank, self._tp_size = 0, 1
        self.steps = 0  # steps ended with at least one token
        self.collectives = 0  # all-gathers issued (one per step under TP)
        self.rows_captured = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        self.requests_preempted = 0
        self.records_suppressed = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_map)

    def set_expert_map(self, expert_map: torch.Tensor | Sequence[int] | None) -> None:
        """Install (or with None remove) the physical -> logical expert map used by ``record``.

        Validated here once (one host read of the map); ``record`` then only indexes it on the
        device. Call between steps, e.g. after an EPLB rebalance: rows already captured are
        logical ids and are unaffected.
        """
        if self.check_ids:
            self._check_id_range(block=True)  # ids seen so far, against the map they went through
            self._reset_id_range()  # ids from now on are checked against the new map
        if expert_map is None:
            self._expert_map = None
            return
        emap = expert_map if isinstance(expert_map, torch.Tensor) else torch.as_tensor(list(expert_map))
        if emap.dim() != 1 or emap.numel() == 0 or emap.dtype.is_floating_point or emap.dtype == torch.bool:
            raise ShapeMismatchError(f"expert_map must be a non-empty 1-D integer tensor, got {emap.dtype} {tuple(emap.shape)}")
        lo, hi = int(emap.min()), int(emap.max())
        if lo < 0 or hi >= self.num_experts:
            raise ShapeMismatchError(
                f"expert_map maps physical experts to logical ids {lo}..{hi}, expected 0..{self.num_experts - 1}"
            )
        self._expert_map = emap.to(device=self.device, dtype=torch.int64)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Within this block ``record`` is a no-op (counted in ``records_suppressed``).

        For forwards whose routers share hooks with the target model but must not be captured
        into it: a draft / MTP model's forward, warm-up, CUDA-graph capture. Steps must not be
        begun or ended inside.
        """
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    # -- the step path ----------------------------------------------------------------------

    def begin_step(
        self,
        request_ids: Sequence[str],
        start_positions: Sequence[int],
        num_tokens: Sequence[int],
        slots_T: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        router_rows: torch.Tensor | None = None,
        graphed: bool = False,
    ) -> None:
        """Announce the tokens of the next forward, request by request.

        The step computes, for each ``i``, positions ``start_positions[i] ..
        start_positions[i] + num_tokens[i] - 1`` of ``request_ids[i]``; tokens are ordered
        request by request and ``slots_T[t]`` is the KV slot token ``t`` writes (host values:
        the engine's own slot mapping, so no device read is needed).

        ``router_rows`` (on the device, optional) maps token t to the row of the router's
        input that computed it, when the router also sees padding; default: row t.

        ``graphed``: this step's forward is the replay of a CUDA graph captured inside
        :meth:`graph_capture` with the same number of tokens; the replay itself writes the
        routing, so ``record`` is not called, and ``end_step`` follows the replay as usual.
        """
        if self._step is not None:
            raise CaptureStateError("begin_step called twice without end_step")
        if not (len(request_ids) == len(start_positions) == len(num_tokens)):
            raise ShapeMismatchError(
                f"request_ids, start_positions, num_tokens must have one entry per request; got "
                f"{len(request_ids)}, {len(start_positions)}, {len(num_tokens)}"
            )
        slots = _host_int64(slots_T)
        counts = np.asarray(num_tokens, dtype=np.int64)
        total = int(counts.sum()) if counts.size else 0
        if slots.shape != (total,):
            raise ShapeMismatchError(f"slots_T must have one slot per token: {total} tokens, got shape {tuple(slots.shape)}")
        if total and (slots.min() < 0 or slots.max() >= self.num_slots):
            raise ShapeMismatchError(f"slots must be in 0..{self.num_slots - 1}, got {slots.min()}..{slots.max()}")
        if total and np.unique(slots).size != total:
            raise ShapeMismatchError("a slot appears twice in one step: each token writes its own KV slot")
        if router_rows is not None and tuple(router_rows.shape) != (total,):
            raise ShapeMismatchError(f"router_rows must have shape ({total},), got {tuple(router_rows.shape)}")
        if graphed:
            captured = self._graph_tokens.get(total)
            if captured is None:
                raise CaptureStateError(f"begin_step(graphed=True) with {total} tokens, but graph_capture() was used for "
                                        f"{sorted(self._graph_tokens)} tokens only")
            if captured != self._graph_key(total, router_rows is not None):
                raise CaptureStateError("begin_step(graphed=True): the step buffers moved or router_rows use differs since "
                                        "graph_capture(); capture the graph again")
        step = self._open_step(list(request_ids), np.asarray(start_positions, dtype=np.int64), counts, slots, router_rows, graphed)
        if graphed:
            step.recorded = [True] * self.num_layers  # the replay writes every layer
            step.covered = [step.local] * self.num_layers
        self._step = step

    def _open_step(self, request_ids, starts, counts, slots, router_rows, graphed: bool) -> "_Step":
        total = int(slots.shape[0])
        chunk = -(-total // self._tp_size)  # tokens per TP rank (the last may have fewer)
        need = chunk * self._tp_size
        if self._step_buf.shape[0] < need:
            self._step_buf = torch.zeros(
                (max(need, 2 * self._step_buf.shape[0]), self.num_layers, self.top_k),
                dtype=self._step_buf.dtype,
                device=self.device,
            )
        step = _Step(request_ids, starts, counts, slots, router_rows, self.num_layers)
        # This rank's share of the step's tokens: all of them without TP.
        step.chunk = chunk
        step.base = self._tp_rank * chunk
        step.local = max(0, min(chunk, total - step.base))
        if router_rows is not None and self._tp_size > 1:
            step.router_rows = router_rows[step.base : step.base + step.local]
        if router_rows is not None and graphed:
            # A graph reads router rows from a fixed address: copy them there (device to device).
            if self._rows_buf.shape[0] < step.local:
                self._rows_buf = torch.zeros(max(step.local, 2 * self._rows_buf.shape[0]), dtype=torch.int64, device=self.device)
            rows_view = self._rows_buf[: step.local]
            if step.router_rows is not None:
                rows_view.copy_(step.router_rows, non_blocking=True)
            step.router_rows = rows_view
        return step

    def _graph_key(self, total: int, with_rows: bool) -> tuple[int, int, bool]:
        return (self._step_buf.data_ptr(), self._rows_buf.data_ptr() if with_rows else 0, with_rows)

    @contextlib.contextmanager
    def graph_capture(self, num_tokens: int, *, router_rows: bool = False) -> Iterator[None]:
        """Open a placeholder step of ``num_tokens`` tokens for capturing a forward in a CUDA graph.

        Use it around ``torch.cuda.graph(...)`` (and the warm-up forwards before it): the
        routers' hooks call ``record`` as usual and their kernels, which write the step buffer
        at fixed addresses, become part of the graph; nothing is written to the slot table
        and no request state changes. Then, for each replay::

            capturer.begin_step(ids, starts, counts, slots, graphed=True)   # same token count
            graph.replay()
            capturer.end_step()

        ``router_rows=True`` when the steps will pass ``router_rows`` (a fixed device buffer
        holds them; ``begin_step`` copies each step's rows into it).
        """
        if self._step is not None:
            raise CaptureStateError("graph_capture() inside an open step")
        if num_tokens < 1:
            raise ShapeMismatchError(f"graph_capture needs num_tokens >= 1, got {num_tokens}")
        slots = np.zeros(num_tokens, dtype=np.int64)
        rows = None
        if router_rows:
            rows = torch.arange(num_tokens, device=self.device)
        step = self._open_step([], np.zeros(0, np.int64), np.zeros(0, np.int64), slots, rows, graphed=router_rows)
        self._step = step
        try:
            with graph_regime():
                yield
        finally:
            self._step = None
        self._graph_tokens[num_tokens] = self._graph_key(num_tokens, router_rows)

    def record(self, layer_idx: int, topk_ids_TK: torch.Tensor, *, token_offset: int | None = None) -> None:
        """Record one MoE layer's top-k ids for the current step (called from the router).

        ``token_offset`` is for chunked MoE, where a layer routes the step's tokens in several
        calls: each call passes the rows of tokens ``token_offset .. token_offset + n - 1`` of
        the step, in order (the first at 0, each next one where the previous ended); the step
        must end with every token covered. Without it, one call carries every token.
        """
        if self._suspended:
            self.records_suppressed += 1
            return
        step = self._step
        if step is None:
            raise CaptureStateError(f"record(layer {layer_idx}) called outside begin_step/end_step")
        moe = self._moe_index.get(layer_idx)
        if moe is None:
            raise ShapeMismatchError(f"layer {layer_idx} is not a captured MoE layer; layer_map is {self.layer_map}")
        if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[1] != self.top_k:
            raise ShapeMismatchError(f"layer {layer_idx}: expected top-k ids [T, {self.top_k}], got {tuple(topk_ids_TK.shape)}")
        total, base = step.local, step.base
        if token_offset is not None:
            if step.router_rows is not None:
                raise CaptureStateError("record(token_offset=...) cannot be combined with begin_step(router_rows=...)")
            done = step.covered[moe]
            n = int(topk_ids_TK.shape[0])
            if step.recorded[moe] or token_offset != done or done + n > total:
                raise CaptureStateError(
                    f"layer {layer_idx}: chunk of {n} rows at token_offset {token_offset}, but {done} of the "
                    f"{total} tokens this rank routes were recorded so far (chunks must be in order and cover them once)"
                )
            if self.check_ids:
                self._fold_id_range(moe, topk_ids_TK)
            record_layer(self._step_buf[base + done : base + done + n], moe, topk_ids_TK, None, self._expert_map)
            step.covered[moe] = done + n
            step.recorded[moe] = step.covered[moe] == total
            return
        n_rows = topk_ids_TK.shape[0] if step.router_rows is None else step.router_rows.shape[0]
        if n_rows != total:
            raise ShapeMismatchError(
                f"layer {layer_idx}: the step announced {total} tokens{'' if self._tp_size == 1 else ' for this TP rank'} "
                f"but the router produced {topk_ids_TK.shape[0]} rows"
                + ("" if step.router_rows is None else " (after router_rows selection)")
            )
        if step.recorded[moe] or step.covered[moe]:
            raise CaptureStateError(f"layer {layer_idx} recorded twice in one step (chunked MoE? pass token_offset)")
        step.recorded[moe] = True
        step.covered[moe] = total
        if self.check_ids:
            rows_ids = topk_ids_TK if step.router_rows is None else topk_ids_TK.index_select(0, step.router_rows)
            self._step_id_range(moe, rows_ids)
        # One kernel: select the router rows, map EPLB replicas to logical ids, narrow, store.
        record_layer(self._step_buf[base : base + total], moe, topk_ids_TK, step.router_rows, self._expert_map)

    def _step_id_range(self, moe: int, ids: torch.Tensor) -> None:
        # One kernel per record: aminmax straight into this step's [L] pair (folded at end_step).
        if ids.numel() == 0:
            return
        if self._step_lo_L is None or self._step_lo_L.dtype != ids.dtype or self._step_lo_L.device != ids.device:
            if self._step_lo_L is not None:
                self._fold_step_id_range()
            self._step_lo_L = torch.zeros(self.num_layers, dtype=ids.dtype, device=ids.device)
            self._step_hi_L = torch.zeros(self.num_layers, dtype=ids.dtype, device=ids.device)
        torch.aminmax(ids, out=(self._step_lo_L[moe], self._step_hi_L[moe]))

    def _fold_step_id_range(self) -> None:
        # Two kernels per step. Layers not recorded this step hold last step's values: folding
        # them again changes nothing.
        if self._step_lo_L is not None:
            self._ids_lo_L.clamp_(max=self._step_lo_L.to(self._ids_lo_L.device, torch.int64))
            self._ids_hi_L.clamp_(min=self._step_hi_L.to(self._ids_hi_L.device, torch.int64))

    def _fold_id_range(self, moe: int, ids: torch.Tensor) -> None:
        # Device only: one reduction, two in-place clamps on 1-element views (no host sync).
        if ids.numel() == 0:
            return
        lo, hi = torch.aminmax(ids)
        self._ids_lo_L[moe : moe + 1].clamp_(max=lo.to(torch.int64))
        self._ids_hi_L[moe : moe + 1].clamp_(min=hi.to(torch.int64))

    def _reset_id_range(self) -> None:
        for t in (self._ids_lo_L, self._ids_hi_L, self._step_lo_L, self._step_hi_L):
            if t is not None:
                t.zero_()

    def _check_id_range(self, *, block: bool) -> None:
        """Raise if a recorded id lay outside what the capturer stores (see ``check_ids``).

        CPU: reads the running range at once. CUDA: reads the pinned copy issued earlier if it
        has landed (or, with ``block``, waits for it and reads the current range too), then
        issues the next copy; the engine thread never waits unless ``block``.
        """
        if not self._cuda:
            self._raise_bad_ids(self._ids_lo_L.numpy(), self._ids_hi_L.numpy())
            return
        if self._ids_probe is not None:
            host, event = self._ids_probe
            if block:
                event.synchronize()
            if block or event.query():
                self._ids_probe = None
                self._raise_bad_ids(host[0].numpy(), host[1].numpy())
        if block:
            both = torch.stack([self._ids_lo_L, self._ids_hi_L]).cpu()
            self._raise_bad_ids(both[0].numpy(), both[1].numpy())
        elif self._ids_probe is None:
            host = torch.empty((2, self.num_layers), dtype=torch.int64, pin_memory=True)
            host.copy_(torch.stack([self._ids_lo_L, self._ids_hi_L]), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._ids_probe = (host, event)

    def _raise_bad_ids(self, lo_L: np.ndarray, hi_L: np.ndarray) -> None:
        limit = self.num_experts if self._expert_map is None else int(self._expert_map.numel())
        bad = np.flatnonzero((lo_L < 0) | (hi_L >= limit))
        if bad.size:
            moe = int(bad[0])
            lo, hi = int(lo_L[moe]), int(hi_L[moe])
            self._reset_id_range()  # reported once; later records are checked afresh
            what = "physical ids (expert_map has " if self._expert_map is not None else "ids (num_experts is "
            raise ShapeMismatchError(
                f"layer {self.layer_map[moe]} (MoE layer {moe}) recorded router id {hi if hi >= limit else lo}, expected "
                f"0..{limit - 1}: {what}{limit}); stored in {self.storage_dtype} they would wrap to wrong experts "
                f"(EPLB physical ids without an expert_map?)"
                + ("" if bad.size == 1 else f"; layers {[self.layer_map[int(i)] for i in bad]} are all out of range")
            )

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        """Host int64 indices on the table's device without a host sync.

        Through pinned memory from torch's caching host allocator: it reuses a staging block
        only once the copy recorded on it has completed, so the next step cannot overwrite
        indices still in flight (the race of a shared pinned buffer, vLLM #39568).
        """
        host = torch.from_numpy(values)
        if not self._cuda:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def end_step(self, accepted_T: Sequence[bool] | np.ndarray | None = None) -> None:
        """Commit the step's rows to the slot table.

        ``accepted_T`` (host booleans, one per token) keeps only accepted tokens, as in
        speculative decoding where rejected draft tokens' rows must not be stored.
        """
        step = self._step
        if step is None:
            raise CaptureStateError("end_step called without begin_step")
        self._step = None
        if step.local and not all(step.recorded):
            missing = [self.layer_map[i] for i, done in enumerate(step.recorded) if not done]
            raise CaptureStateError(
                f"step ended without routing for MoE layers {missing} (a router skipped its hook, or a chunked "
                "MoE layer did not cover every token?)"
            )
        if self.check_ids and step.local:
            self._fold_step_id_range()
        if step.total:
            self.steps += 1
            if self._tp_group is not None:
                self._gather_step(step)
        keep = None
        if accepted_T is not None:
            keep = np.asarray(accepted_T, dtype=bool)
            if keep.shape != (step.total,):
                raise ShapeMismatchError(f"accepted_T must have {step.total} entries, got shape {keep.shape}")
        token_idx = np.arange(step.total) if keep is None else np.flatnonzero(keep)
        if token_idx.size == 0:
            return
        slots = step.slots[token_idx]
        rows = self._step_buf[: step.total]
        if keep is None:
            write_step_rows(self.table_SLK, self._to_device(slots), rows)
        else:  # one transfer for both index arrays
            both = self._to_device(np.concatenate([slots, token_idx]))
            write_step_rows(self.table_SLK, both[: slots.size], rows, both[slots.size :])
        self._slot_gen[slots] += 1
        self._slot_valid[slots] = True
        gens = self._slot_gen[slots]
        # Host bookkeeping: position -> (slot, generation) for each request's kept tokens.
        if keep is None:
            # Every token kept: request i's tokens are one contiguous run of positions, so
            # plain slices do (this is the decode hot path: no per-token index arrays).
            ends = np.cumsum(step.counts).tolist()
            begin = 0
            for rid, start, end in zip(step.request_ids, step.starts.tolist(), ends):
                state = self._state_for(rid, step)
                if state is not None and end > begin:
                    stop = start + end - begin
                    state.ensure(stop)
                    state.slots[start:stop] = slots[begin:end]
                    state.gens[start:stop] = gens[begin:end]
                begin = end
        else:
            positions = np.repeat(step.starts, step.counts) + (
                np.arange(step.total) - np.repeat(np.cumsum(step.counts) - step.counts, step.counts)
            )
            owner = np.repeat(np.arange(len(step.request_ids)), step.counts)[token_idx]
            positions = positions[token_idx]
            bounds = np.flatnonzero(np.diff(owner)) + 1
            for chunk in np.split(np.arange(token_idx.size), bounds):
                state = self._state_for(step.request_ids[owner[chunk[0]]], step)
                if state is not None:
                    pos = positions[chunk]
                    state.ensure(int(pos.max()) + 1)
                    state.slots[pos] = slots[chunk]
                    state.gens[pos] = gens[chunk]
        self.rows_captured += int(token_idx.size)

    def _state_for(self, request_id: str, step: "_Step") -> "_RequestState | None":
        if request_id in step.retired:
            # Finished, aborted or preempted while this step was in flight (overlap
            # scheduling): its slots were written, but the request keeps no state.
            return None
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState()
        return state

    def _gather_step(self, step: "_Step") -> None:
        """One all-gather per step: every rank's share of every layer's rows, as raw bytes.

        Bytes because NCCL has no int16; the collective runs in place on the step buffer
        (rank r's share already sits at ``[r*c, (r+1)*c)``), so nothing is copied around it.
        """
        import torch.distributed as dist

        c = step.chunk
        out = self._step_buf[: c * self._tp_size].view(torch.uint8)
        mine = self._step_buf[step.base : step.base + c].view(torch.uint8)
        # torch 2.13 renamed all_gather_into_tensor to all_gather_single (same semantics).
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(out, mine, group=self._tp_group)
        self.collectives += 1

    def pushes(self, request_id: str) -> bool:
        """Whether this rank gathers and pushes the request stored as ``request_id`` (always,
        without TP). Pass the stored id: ``store_as`` when a turn is stored under its conversation."""
        return self._tp_size == 1 or zlib.crc32(request_id.encode()) % self._tp_size == self._tp_rank

    def cancel_step(self) -> None:
        """Drop the current step without writing anything (its forward failed)."""
        self._step = None

    # -- requests ---------------------------------------------------------------------------

    def attach_cached(self, request_id: str, positions: Sequence[int], slots: Sequence[int]) -> None:
        """A prefix-cache hit: ``positions`` of ``request_id`` reuse rows already in ``slots``."""
        pos = _host_int64(positions)
        slt = _host_int64(slots)
        if pos.shape != slt.shape:
            raise ShapeMismatchError(f"positions and slots differ in length: {pos.shape[0]} vs {slt.shape[0]}")
        if pos.size == 0:
            return
        if slt.min() < 0 or slt.max() >= self.num_slots:
            raise ShapeMismatchError(f"slots must be in 0..{self.num_slots - 1}, got {slt.min()}..{slt.max()}")
        never = slt[self._slot_gen[slt] == 0]
        if never.size:
            raise StaleSlotError(f"request {request_id!r} attaches to slots never written: {never[:8].tolist()}")
        released = slt[~self._slot_valid[slt]]
        if released.size:
            raise StaleSlotError(
                f"request {request_id!r} attaches to slots released (evicted) and not rewritten since: "
                f"{released[:8].tolist()} (a prefix-cache hit on a block that no longer holds its prefix?)"
            )
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState()
        state.ensure(int(pos.max()) + 1)
        state.slots[pos] = slt
        state.gens[pos] = self._slot_gen[slt]

    def finish_request(
        self,
        request_id: str,
        *,
        prompt_len: int,
        generated_len: int,
        rollout_id: str | None = None,
        start_row: int = 0,
        store_as: str | None = None,
        final: bool = True,
        total_rows: int | None = None,
    ) -> RequestRecord | None:
        """Gather the request's rows ``start_row .. prompt_len + generated_len - 2`` and hand them to the sink.

        ``prompt_len + generated_len`` is the request's whole sequence, with ``generated_len``
        counted up to and including EOS (tokens a speculative step accepted after EOS are not
        part of it). The last token is never an input, so it has no row, whether the request
        ended by EOS or by length.

        ``store_as`` names the stored request when it differs from the engine's request id (a
        later turn of a conversation stored under the conversation's id). ``start_row``,
        ``final`` and ``total_rows`` go into the record (see :class:`RequestRecord`): a later
        turn passes the rows already stored as ``start_row``; a prefill engine in a
        disaggregated deployment passes ``final=False``; a decode engine passes
        ``start_row=prompt_len`` and ``total_rows``.

        Raises :class:`MissingRowsError` if a position was never computed and
        :class:`StaleSlotError` if a slot was rewritten by another token or released since.
        The request's bookkeeping is released either way; the engine may then free its slots.
        """
        state = self._requests.pop(request_id, None)
        self._retire_in_open_step(request_id)
        rows = num_routing_rows(prompt_len, generated_len)
        if not 0 <= start_row < rows:
            # A record of 0 rows would be stored as an array no Zarr reader can open; the
            # request is refused here, before anything reaches the sink.
            raise ShapeMismatchError(
                f"request {request_id!r}: start_row must be in 0..{rows - 1} so the record holds at least 1 row "
                f"(prompt_len={prompt_len} + generated_len={generated_len} - 1 = {rows} rows), got start_row={start_row}"
            )
        if state is None:
            raise MissingRowsError(f"request {request_id!r} finished with {rows} rows but no step ever computed it")
        state.ensure(rows)
        gens = state.gens[start_row:rows]
        missing = np.flatnonzero(gens < 0) + start_row
        if missing.size:
            raise MissingRowsError(
                f"request {request_id!r}: {missing.size} of {rows} positions were never computed "
                f"(first: {missing[:8].tolist()}); prompt_len={prompt_len}, generated_len={generated_len}"
            )
        slots = state.slots[start_row:rows]
        stale = np.flatnonzero(self._slot_gen[slots] != gens)
        if stale.size:
            raise StaleSlotError(
                f"request {request_id!r}: slots of positions {(stale[:8] + start_row).tolist()} were rewritten "
                "by other tokens before the request finished (slot freed too early?)"
            )
        # The owner follows the stored id: turns of one conversation (store_as) must leave from
        # one rank, one FIFO writer, or a later turn could reach the store before an earlier one.
        if self.check_ids:
            self._check_id_range(block=False)
        if not self.pushes(store_as or request_id):
            self.requests_finished += 1
            return None  # another rank of the TP group pushes it (see tp_group)
        meta = dict(rollout_id=rollout_id or self.rollout_id, request_id=store_as or request_id, layer_map=self.layer_map,
                    num_experts=self.num_experts, start_row=start_row, final=final, total_rows=total_rows)
        self.requests_finished += 1
        if self._cuda and self.sink is not None:
            from r3rdma.capture.transfer import DeviceRows, stage_to_host

            self._raise_finisher_error()
            if self.transfer_mode == "gpu_direct":
                # The gathered device rows are the payload; the pusher waits on `ready`
                # (a CUDA event) in its own thread before UCX reads them.
                rows = gather_rows(self.table_SLK, self._to_device(slots))
                ready = torch.cuda.Event()
                ready.record()
                self.sink.submit(DeviceRows(ids_TLK=rows, ready=ready, **meta))
                return None
            # Gather on the GPU, copy to pinned host memory asynchronously, and let the
            # finisher thread wait for the copy and hand the record over: no sync here.
            staged = stage_to_host(gather_rows(self.table_SLK, self._to_device(slots)))
            deferred = _StagedRecord(staged, self.storage_dtype, meta, int(slots.size) * self.num_layers * self.top_k * self.storage_dtype.itemsize)
            if getattr(self.sink, "accepts_deferred", False):
                # A RoutingWriter resolves it on its own thread, so its flush() also covers
                # records whose copy is still in flight.
                self.sink.submit(deferred)
            else:
                if self._finisher is None:
                    self._finisher = _Finisher(self.sink)
                self._finisher.put(deferred)
            return None
        ids = gather_rows(self.table_SLK, self._to_device(slots)).cpu().numpy()
        record = _make_record(ids, self.storage_dtype, meta)
        if self.sink is not None:
            self.sink.submit(record)
        return record

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every finished request was handed to the sink (CUDA: its copy landed).

        Raises the first error the finisher thread met (from the sink, or building a record).
        """
        if self._finisher is not None:
            self._finisher.flush(timeout)
        self._raise_finisher_error()
        if self.check_ids:
            self._check_id_range(block=True)

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the finisher thread (if one was started), then close the sink if the
        capturer owns it (``owns_sink``: a capturer from :meth:`R3Config.build_capturer
        <r3rdma.config.R3Config.build_capturer>`, whose writer then commits what it holds and
        closes its store). A sink the caller passed in is left open.

        Everything is released even when a step fails; the first error is raised. Calling it
        again does nothing more.
        """
        errors: list[BaseException] = []
        try:
            self.flush(timeout)
        except BaseException as e:
            errors.append(e)
        if self._finisher is not None:
            self._finisher.stop()
            self._finisher = None
        if self.owns_sink:
            self.owns_sink = False  # closed once, even if close() is called again
            try:
                self.sink.close() if timeout is None else self.sink.close(timeout)
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> "RoutingCapturer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_finisher_error(self) -> None:
        if self._finisher is not None and self._finisher.error is not None:
            error, self._finisher.error = self._finisher.error, None
            raise error

    def abort_request(self, request_id: str) -> None:
        """Forget an aborted request; nothing is stored. Safe to call for unknown ids."""
        if self._requests.pop(request_id, None) is not None:
            self.requests_aborted += 1
        self._retire_in_open_step(request_id)

    def preempt_request(self, request_id: str) -> None:
        """The engine preempted ``request_id`` and freed its KV: forget every position.

        When it is rescheduled (recompute), its steps and prefix-cache hits announce the
        positions again; positions it never recomputes are then missing, not stale.
        """
        if self._requests.pop(request_id, None) is not None:
            self.requests_preempted += 1
        self._retire_in_open_step(request_id)

    def fork_request(
        self,
        parent_id: str,
        child_id: str,
        num_positions: int,
        *,
        slots: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    ) -> None:
        """n > 1 samples: ``child_id`` starts with positions ``0 .. num_positions - 1`` of ``parent_id``.

        For engines that prefill a prompt once and fork it into several samples. ``slots``
        (optional, one per position) are the child's own KV slots for those positions: where
        a slot equals the parent's, the block is shared; where it differs, the engine copied
        the block (copy-on-write of the partly filled last block), and the rows are copied
        into the child's slots too, on the device, so the child no longer depends on the
        parent's copy. Without ``slots`` every position is shared.
        """
        parent = self._requests.get(parent_id)
        if parent is None:
            raise MissingRowsError(f"fork_request: parent {parent_id!r} has no computed positions")
        if child_id in self._requests:
            raise CaptureStateError(f"fork_request: {child_id!r} already has positions")
        parent.ensure(num_positions)
        missing = np.flatnonzero(parent.gens[:num_positions] < 0)
        if missing.size:
            raise MissingRowsError(
                f"fork_request: positions {missing[:8].tolist()} of {parent_id!r} were never computed"
            )
        src = parent.slots[:num_positions]
        stale = np.flatnonzero(self._slot_gen[src] != parent.gens[:num_positions])
        if stale.size:
            raise StaleSlotError(f"fork_request: slots of positions {stale[:8].tolist()} of {parent_id!r} were rewritten")
        dst = src.copy() if slots is None else _host_int64(slots)
        if dst.shape != (num_positions,):
            raise ShapeMismatchError(f"fork_request: need {num_positions} slots, got {dst.shape[0]}")
        if num_positions and (dst.min() < 0 or dst.max() >= self.num_slots):
            raise ShapeMismatchError(f"slots must be in 0..{self.num_slots - 1}, got {dst.min()}..{dst.max()}")
        child = _RequestState()
        child.ensure(num_positions)
        child.slots[:num_positions] = dst
        child.gens[:num_positions] = parent.gens[:num_positions]
        copied = np.flatnonzero(dst != src)
        if copied.size:
            if np.unique(dst[copied]).size != copied.size:
                raise ShapeMismatchError("fork_request: a copy-on-write slot appears twice")
            rows = gather_rows(self.table_SLK, self._to_device(src[copied]))
            write_step_rows(self.table_SLK, self._to_device(dst[copied]), rows)
            self._slot_gen[dst[copied]] += 1
            self._slot_valid[dst[copied]] = True
            child.gens[copied] = self._slot_gen[dst[copied]]
        self._requests[child_id] = child

    def release_slots(self, slots: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """The engine evicted or reassigned these KV slots: their rows stop being valid.

        Call it when a block's *content* is discarded (prefix-cache eviction, reassignment to
        another request), not when a request merely stops referencing a block that stays in
        the prefix cache. Afterwards a request that still relies on such a slot fails with
        :class:`StaleSlotError` at finish, and a prefix hit on it is refused, until the slot
        is written again. Optional: without it, a rewrite is still detected.
        """
        slt = _host_int64(slots)
        if slt.size and (slt.min() < 0 or slt.max() >= self.num_slots):
            raise ShapeMismatchError(f"slots must be in 0..{self.num_slots - 1}, got {slt.min()}..{slt.max()}")
        self._slot_gen[slt] += 1
        self._slot_valid[slt] = False

    def _retire_in_open_step(self, request_id: str) -> None:
        # Overlap scheduling: the engine may launch step N+1 (with this request in it) before it
        # learns the request finished at step N. Its tokens in the open step keep no state.
        step = self._step
        if step is not None and request_id in step.members:
            step.retired.add(request_id)

    @property
    def active_requests(self) -> int:
        """Requests with host state (computed positions); 0 once every request finished or aborted."""
        return len(self._requests)

    @property
    def tracked_positions(self) -> int:
        """Host bookkeeping entries held for active requests (leak check)."""
        return int(sum(state.slots.shape[0] for state in self._requests.values()))


class _Step:
    __slots__ = ("request_ids", "members", "retired", "starts", "counts", "slots", "router_rows", "total", "recorded",
                 "covered", "chunk", "base", "local")

    def __init__(self, request_ids, starts, counts, slots, router_rows, num_layers) -> None:
        self.request_ids = request_ids
        self.members = frozenset(request_ids)
        self.retired: set[str] = set()
        self.starts = starts
        self.counts = counts
        self.slots = slots
        self.router_rows = router_rows
        self.total = int(slots.shape[0])
        self.recorded = [False] * num_layers
        self.covered = [0] * num_layers  # tokens recorded so far per layer (chunked MoE)


class _PinnedOnDevice:
    """``__cuda_array_interface__`` of pinned host memory, for torch.as_tensor(device="cuda")."""

    def __init__(self, host: torch.Tensor) -> None:
        typestr = {torch.uint8: "|u1", torch.int16: "<i2", torch.int32: "<i4"}[host.dtype]
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape), "typestr": typestr, "data": (host.data_ptr(), False),
            "version": 3, "strides": None, "stream": None,
        }


def _device_view_of_pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    view = torch.as_tensor(_PinnedOnDevice(host), device=device)
    if view.data_ptr() != host.data_ptr() or view.device.type != "cuda":
        raise ConfigError("pinned host slot table: this CUDA setup does not map pinned memory into the device (no UVA)")
    return view


def _make_record(ids: np.ndarray, storage_dtype: np.dtype, meta: dict) -> RequestRecord:
    if storage_dtype == np.uint16:
        ids = ids.view(np.uint16)  # the table holds uint16 bit patterns as int16
    return RequestRecord(ids_TLK=ids, **meta)


class _StagedRecord:
    """A finished request whose rows are still being copied to pinned host memory.

    ``result()`` waits for the copy (its CUDA event, not the device) and builds the record.
    """

    __slots__ = ("_staged", "_dtype", "_meta", "nbytes")

    def __init__(self, staged, storage_dtype: np.dtype, meta: dict, nbytes: int) -> None:
        self._staged, self._dtype, self._meta, self.nbytes = staged, storage_dtype, meta, nbytes

    @property
    def rollout_id(self) -> str:
        return self._meta["rollout_id"]

    @property
    def request_id(self) -> str:
        return self._meta["request_id"]

    def result(self) -> RequestRecord:
        # The pinned block returns to torch's pool when `staged` is dropped; the record owns a
        # copy-free numpy view of it until then.
        return _make_record(self._staged.wait(), self._dtype, self._meta)


class _Finisher:
    """A thread that waits for finished requests' D2H copies and hands the records to the sink.

    Started on the first CUDA finish (never at import or construction). The engine thread
    only enqueues; the wait on the copy's event, the CRC of the record and the sink's
    back-pressure all happen here.
    """

    def __init__(self, sink: RoutingSink) -> None:
        self.sink = sink
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="r3rdma-finish", daemon=True)
        self._thread.start()

    def put(self, deferred: _StagedRecord) -> None:
        self._queue.put(deferred)

    def flush(self, timeout: float | None = None) -> None:
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout):
            from r3rdma.errors import R3TimeoutError

            raise R3TimeoutError(f"finished requests not handed to the sink within {timeout} s")

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(30)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self.sink.submit(item.result())
            except BaseException as e:  # raised to the engine at its next finish / flush
                if self.error is None:
                    self.error = e


def _device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device must name a torch device such as 'cpu', 'cuda' or 'cuda:0', got {device!r}") from e


def _host_int64(values: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ShapeMismatchError("slot and position arrays must be host values (the engine's own mapping), got a device tensor")
        values = values.numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)
