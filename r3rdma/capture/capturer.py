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

:class:`RoutingCapturer` is the façade over four parts, one module each, wired here:

- :mod:`r3rdma.capture.slot_table`: the device slot table (step buffer, scatter, gather, graph
  addresses, slot generations and validity, copy-on-write for forks);
- :mod:`r3rdma.capture.step`: the open step (announcement, per-layer records, graph capture, TP
  all-gather), ended into a frozen :class:`~r3rdma.capture.step.EndedStep`;
- :mod:`r3rdma.capture.ledger`: the request ledger (per-request positions and slots, finish,
  abort, preempt, fork, cached prefixes), which commits ended steps;
- :mod:`r3rdma.capture.finishing`: records and their dispatch to the sink (host, GPU-direct,
  deferred, finisher thread), beside :mod:`r3rdma.capture.transfer`;

plus :mod:`r3rdma.capture.id_check`, the optional router-id range check (real or no-op).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager

import numpy as np
import torch

from r3rdma.capture.finishing import Finishing
from r3rdma.capture.id_check import id_range_check
from r3rdma.capture.ledger import RequestLedger, num_routing_rows
from r3rdma.capture.slot_table import SlotTable, host_int64
from r3rdma.capture.step import StepRecorder
from r3rdma.capture.stored_prefixes import StoredPrefixes
from r3rdma.capture.transfer import TRANSFER_MODES
from r3rdma.contracts import Closable, DeviceRowsSink, RoutingSink, takes_deferred, takes_device_rows
from r3rdma.errors import ConfigError, OutOfRangeError, ShapeMismatchError
from r3rdma.ids import validate_id
from r3rdma.records import RequestRecord, routing_dtype

__all__ = ["RoutingCapturer", "RoutingSink", "DeviceRowsSink", "num_routing_rows"]


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
            default: it costs no host sync, but it doubles the capture's device work, past the
            capture budget (BENCHMARKS.md, "Capture overhead"). Turn it on for validation runs,
            or whenever the router may emit physical ids (EPLB) and no ``expert_map`` is set.
            How it works: :mod:`r3rdma.capture.id_check`. A bad id raises
            :class:`~r3rdma.errors.OutOfRangeError` (a :class:`ShapeMismatchError`) naming the
            layer and the id; on CUDA it may surface a few finishes after the step that produced it.
        step_buffer: a fixed device buffer ``[max_tokens, L, K]`` (from
            :func:`r3rdma.kernels.record_op.new_step_buffer`) that the model's routers write
            themselves through :func:`r3rdma.kernels.record_op.record_hook`: the record path
            for compiled models and CUDA graphs, where no Python runs per step. Each step then
            begins with ``graphed=True`` (any token count up to ``max_tokens``) and ``record``
            is not called; ``end_step`` stores rows ``0 .. T - 1`` only, so padded rows a graph
            wrote for a larger size are never stored. Without TP only (``tp_group`` None).
        share_prefixes: store rows a request shares with a request already stored once
            (:mod:`r3rdma.capture.stored_prefixes`): a finished request whose first rows the engine
            reused from another stored request's KV (prefix-cache hit, fork) goes to the sink
            with its own rows and a :class:`~r3rdma.records.SharedPrefix`, which the store
            resolves into segments over the rows it holds. None (default): on for a
            :class:`~r3rdma.write.writer.RoutingWriter` sink (its stores resolve references),
            off for other sinks and without one, which get every record whole.
        owns_sink: :meth:`close` also closes ``sink`` (which must then have ``close()``, taking
            the timeout when :meth:`close` is given one).
            :func:`~r3rdma.integrations.builders.build_capturer` sets it for
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
        tp_group: torch.distributed.ProcessGroup | None = None,
        transfer_mode: str = "staged",
        owns_sink: bool = False,
        share_prefixes: bool | None = None,
        check_ids: bool = False,
        step_buffer: torch.Tensor | None = None,
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
        if owns_sink and not isinstance(sink, Closable):
            raise ConfigError(f"owns_sink=True needs a sink with close(), got {type(sink).__name__}")
        self.sink = sink
        self.owns_sink = bool(owns_sink)
        self.rollout_id = validate_id(rollout_id, "rollout_id")
        self.device = _device(device)
        if (self.device.type == "cuda" or pin_memory) and not torch.cuda.is_available():
            what = f"device {self.device}" if self.device.type == "cuda" else "pin_memory=True (page-locked host memory)"
            raise ConfigError(f"{what} needs CUDA, but torch sees no CUDA device (torch {torch.__version__})")
        self._table = SlotTable(
            num_slots=self.num_slots,
            num_layers=len(self.layer_map),
            top_k=self.top_k,
            num_experts=self.num_experts,
            device=self.device,
            pin_memory=pin_memory,
        )
        if transfer_mode not in TRANSFER_MODES:
            raise ConfigError(f"transfer_mode must be auto, staged or gpu_direct, got {transfer_mode!r}")
        self.transfer_probe = None
        if transfer_mode == "auto":
            # Measured once, at start-up, against the sink's first store node when the sink can
            # push device memory; otherwise (local store, CPU) staged, as r3rdma.capture.transfer says.
            transfer_mode = "staged"
            if self._table.cuda and takes_device_rows(sink):
                self.transfer_probe = sink.probe_transfer_mode(device=self.device)
                transfer_mode = self.transfer_probe.mode
        if transfer_mode == "gpu_direct" and not takes_device_rows(sink):
            raise ConfigError(
                "transfer_mode 'gpu_direct' needs a sink that pushes device memory (a RoutingWriter over a "
                f"StoreNodesClient); {type(sink).__name__} does not"
            )
        self.transfer_mode = transfer_mode
        self.check_ids = bool(check_ids)
        self._ids = id_range_check(
            self.check_ids,
            layer_map=self.layer_map,
            num_experts=self.num_experts,
            storage_dtype=self.storage_dtype,
            device=self.device,
        )
        self._steps = StepRecorder(
            table=self._table, layer_map=self.layer_map, top_k=self.top_k, ids=self._ids, tp_group=tp_group
        )
        if step_buffer is not None:
            if tp_group is not None:
                raise ConfigError(
                    "step_buffer with tp_group: under TP each rank routes a share of the tokens and "
                    "end_step gathers them; a model-written buffer holds one rank's view"
                )
            self._table.fix_step_buffer(step_buffer)
        self._ledger = RequestLedger(self._table)
        self._finishing = Finishing(
            table=self._table,
            sink=sink,
            transfer_mode=transfer_mode,
            storage_dtype=self.storage_dtype,
            row_bytes=len(self.layer_map) * self.top_k * self.storage_dtype.itemsize,
        )
        share = takes_deferred(sink) if share_prefixes is None else bool(share_prefixes)
        self._prefixes = StoredPrefixes() if share else None
        self._suspended = 0
        if expert_map is not None:
            self.set_expert_map(expert_map)
        # Request id -> its rows 0..n-1 as first computed, copied to the host when the engine
        # preempted it (see preempt_request); used for those rows when it finishes.
        self._first_rows: dict[str, np.ndarray] = {}
        self.rows_captured = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        self.requests_preempted = 0
        self.records_suppressed = 0

    @property
    def num_layers(self) -> int:
        """MoE layers captured (``len(layer_map)``)."""
        return len(self.layer_map)

    @property
    def table_SLK(self) -> torch.Tensor:
        """The slot table ``[num_slots, L, K]`` (on the device; pinned host memory mapped into it with ``pin_memory``)."""
        return self._table.table_SLK

    @property
    def step_buffer(self) -> torch.Tensor | None:
        """The fixed step buffer the model's routers write (``step_buffer=``), or None."""
        return self._table.step_buf if self._table.fixed_step_rows else None

    @property
    def steps(self) -> int:
        """Steps ended with at least one token."""
        return self._steps.steps

    @property
    def collectives(self) -> int:
        """All-gathers issued (one per step under TP)."""
        return self._steps.collectives

    @property
    def active_requests(self) -> int:
        """Requests with host state (computed positions); 0 once every request finished or aborted."""
        return self._ledger.active_requests

    @property
    def tracked_positions(self) -> int:
        """Host bookkeeping entries held for active requests (leak check)."""
        return self._ledger.tracked_positions

    def set_expert_map(self, expert_map: torch.Tensor | Sequence[int] | None) -> None:
        """Install (or with None remove) the physical -> logical expert map used by ``record``.

        Validated here once (one host read of the map); ``record`` then only indexes it on the
        device. Call between steps, e.g. after an EPLB rebalance: rows already captured are
        logical ids and are unaffected.
        """
        self._ids.check(block=True)  # ids seen so far, against the map they went through
        self._ids.reset()  # ids from now on are checked against the new map
        if expert_map is None:
            self._steps.expert_map = None
            self._ids.set_limit(None)
            return
        emap = expert_map if isinstance(expert_map, torch.Tensor) else torch.as_tensor(list(expert_map))
        if emap.dim() != 1 or emap.numel() == 0 or emap.dtype.is_floating_point or emap.dtype == torch.bool:
            raise ShapeMismatchError(f"expert_map must be a non-empty 1-D integer tensor, got {emap.dtype} {tuple(emap.shape)}")
        lo, hi = int(emap.min()), int(emap.max())
        if lo < 0 or hi >= self.num_experts:
            raise OutOfRangeError(
                f"expert_map maps physical experts to logical ids {lo}..{hi}, expected 0..{self.num_experts - 1}"
            )
        self._steps.expert_map = emap.to(device=self.device, dtype=torch.int64)
        self._ids.set_limit(self._steps.expert_map)

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
        start_positions: Sequence[int] | np.ndarray,
        num_tokens: Sequence[int] | np.ndarray | int,
        slots_T: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        router_rows: torch.Tensor | None = None,
        graphed: bool = False,
    ) -> None:
        """Announce the tokens of the next forward, request by request.

        The step computes, for each ``i``, positions ``start_positions[i] ..
        start_positions[i] + num_tokens[i] - 1`` of ``request_ids[i]``; tokens are ordered
        request by request and ``slots_T[t]`` is the KV slot token ``t`` writes (host values:
        the engine's own slot mapping, so no device read is needed). ``num_tokens`` may be
        one int for every request (a decode step: ``1``), which spares the step two reductions
        over the batch.

        ``router_rows`` (on the device, optional) maps token t to the row of the router's
        input that computed it, when the router also sees padding; default: row t.

        ``graphed``: this step's forward is the replay of a CUDA graph captured inside
        :meth:`graph_capture` with the same number of tokens; the replay itself writes the
        routing, so ``record`` is not called, and ``end_step`` follows the replay as usual.
        """
        self._steps.begin(request_ids, start_positions, num_tokens, slots_T, router_rows=router_rows, graphed=graphed)

    def graph_capture(self, num_tokens: int, *, router_rows: bool = False) -> AbstractContextManager[None]:
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
        return self._steps.graph_capture(num_tokens, router_rows=router_rows)

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
        self._steps.record(layer_idx, topk_ids_TK, token_offset)

    def end_step(self, accepted_T: Sequence[bool] | np.ndarray | None = None) -> None:
        """Commit the step's rows to the slot table.

        ``accepted_T`` (host booleans, one per token) keeps only accepted tokens, as in
        speculative decoding where rejected draft tokens' rows must not be stored.
        """
        ended = self._steps.end(accepted_T)
        if ended is not None:
            self._ledger.commit(ended)
            self.rows_captured += ended.rows

    def pushes(self, request_id: str) -> bool:
        """Whether this rank gathers and pushes the request stored as ``request_id`` (always,
        without TP). Pass the stored id: ``store_as`` when a turn is stored under its conversation."""
        tp_size = self._steps.tp_size
        return tp_size == 1 or zlib.crc32(request_id.encode()) % tp_size == self._steps.tp_rank

    def cancel_step(self) -> None:
        """Drop the current step without writing anything (its forward failed)."""
        self._steps.cancel()

    # -- requests ---------------------------------------------------------------------------

    def attach_cached(self, request_id: str, positions: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray) -> None:
        """A prefix-cache hit: ``positions`` of ``request_id`` reuse rows already in ``slots``."""
        self._ledger.attach(request_id, positions, slots)

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
        :class:`StaleSlotError` if a slot was rewritten by another token or released since
        (the engine's bookkeeping disagrees with what it computed: this request alone is not
        stored), :class:`~r3rdma.errors.OutOfRangeError` / :class:`ShapeMismatchError` for
        lengths that leave no row (``start_row`` past the rows, ``prompt_len < 1``), and
        :class:`~r3rdma.errors.StoreError` when the writer was closed already: the caller's
        bugs, about this call. The request's bookkeeping is released either way; the engine
        may then free its slots. Never raised here: errors of the store (a refused record, a
        node down, a full disk, a conflicting copy), about this request or an earlier one: the
        writer commits on its own thread and keeps them (logged with the requests, counted,
        listed by its ``failures()``, raised by its ``flush()``; ``RoutingWriter.hand_over``).
        """
        first = self._first_rows.pop(request_id, None)
        if first is not None and start_row < first.shape[0]:
            return self._finish_with_first_rows(
                request_id, first, prompt_len, generated_len, rollout_id, start_row, store_as, final, total_rows
            )
        try:
            slots, gens = self._ledger.resolve_with_generations(
                request_id, start_row=start_row, prompt_len=prompt_len, generated_len=generated_len
            )
        finally:
            self._steps.retire(request_id)
        self._ids.check(block=False)
        # The owner follows the stored id: turns of one conversation (store_as) must leave from
        # one rank, one FIFO writer, or a later turn could reach the store before an earlier one.
        if not self.pushes(store_as or request_id):
            self.requests_finished += 1
            return None  # another rank of the TP group pushes it (see tp_group)
        meta = self._record_meta(rollout_id, store_as or request_id, start_row, final, total_rows)
        prefixes = self._prefixes
        if prefixes is not None and start_row == 0 and final and total_rows is None:
            rollout, stored = str(meta["rollout_id"]), str(meta["request_id"])
            shared = prefixes.match(rollout, slots, gens)
            if shared is not None and shared[0] != stored:
                meta["shared"] = shared
            # Only prompt rows are ever reused from KV by another request (prefix hits, forks).
            prompt_rows = min(prompt_len, slots.size)
            prefixes.remember(rollout, stored, slots[:prompt_rows], gens[:prompt_rows])
        self.requests_finished += 1
        return self._finishing.finish(slots, meta)

    def _finish_with_first_rows(
        self,
        request_id: str,
        first: np.ndarray,
        prompt_len: int,
        generated_len: int,
        rollout_id: str | None,
        start_row: int,
        store_as: str | None,
        final: bool,
        total_rows: int | None,
    ) -> RequestRecord | None:
        """:meth:`finish_request` of a request preempted after computing rows ``0 .. len(first) - 1``:
        those rows as first computed, the rest from the table. Stored whole (inline), and not
        offered as a shared prefix: its table rows for the first positions are the recompute's."""
        rows = num_routing_rows(prompt_len, generated_len)
        kept = min(first.shape[0], rows)
        try:
            if rows > kept:
                slots, _ = self._ledger.resolve_with_generations(
                    request_id, start_row=kept, prompt_len=prompt_len, generated_len=generated_len
                )
                tail = self._table.gather_host(slots)
            else:
                self._ledger.forget(request_id)
                tail = first[:0]
        finally:
            self._steps.retire(request_id)
        self._ids.check(block=False)
        if not self.pushes(store_as or request_id):
            self.requests_finished += 1
            return None
        meta = self._record_meta(rollout_id, store_as or request_id, start_row, final, total_rows)
        self.requests_finished += 1
        return self._finishing.finish_rows(np.concatenate([first[start_row:kept], tail]), meta)

    def _record_meta(self, rollout_id: str | None, request_id: str, start_row: int, final: bool, total_rows: int | None) -> dict:
        """The fields of a finished request's :class:`RequestRecord` besides its rows."""
        return dict(
            rollout_id=rollout_id or self.rollout_id,
            request_id=request_id,
            layer_map=self.layer_map,
            num_experts=self.num_experts,
            start_row=start_row,
            final=final,
            total_rows=total_rows,
        )

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every finished request was handed to the sink (CUDA: its copy landed).

        Raises the first error the finisher thread met (from the sink, or building a record).
        """
        self._finishing.flush(timeout)
        self._ids.check(block=True)

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the finisher thread (if one was started), then close the sink if the
        capturer owns it (``owns_sink``: a capturer from :func:`~r3rdma.integrations.builders.build_capturer`, whose writer then commits what it holds and
        closes its store). A sink the caller passed in is left open.

        Everything is released even when a step fails; the first error is raised. Calling it
        again does nothing more.
        """
        errors: list[BaseException] = []
        try:
            self.flush(timeout)
        except BaseException as e:
            errors.append(e)
        self._finishing.stop()
        if self.owns_sink:
            self.owns_sink = False  # closed once, even if close() is called again
            try:
                sink = self.sink
                if not isinstance(sink, Closable):  # refused at construction; only a hand-set owns_sink gets here
                    raise ConfigError(f"owns_sink=True needs a sink with close(), got {type(sink).__name__}")
                sink.close() if timeout is None else sink.close(timeout)
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> RoutingCapturer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def abort_request(self, request_id: str) -> None:
        """Forget an aborted request; nothing is stored. Safe to call for unknown ids."""
        self._first_rows.pop(request_id, None)
        if self._ledger.forget(request_id):
            self.requests_aborted += 1
        self._steps.retire(request_id)

    def preempt_request(self, request_id: str, *, computed: int | None = None) -> None:
        """The engine preempted ``request_id`` and freed its KV: keep the rows it computed, forget its slots.

        The rows of positions ``0 .. n - 1`` (the run from position 0 the request computed or
        attached, at most ``computed``: positions whose input was a real token, so an engine
        with speculative drafts passes the positions it had accepted) are copied to the host
        now, before the engine hands the slots to others, and stored for those positions when
        it finishes: the routing of the forwards that sampled its tokens, not of the recompute
        (which may order or pick experts differently in low precision). When it is
        rescheduled, its steps and prefix-cache hits announce the positions again; positions
        past ``n`` it never recomputes are then missing, not stale. From a device table the
        copy is synchronous (preemption is rare; the vLLM plug-in keeps a GPU model's table
        on the host).
        """
        slots, _ = self._ledger.computed_prefix(request_id, computed)
        if slots.size:
            rows = self._table.gather_host(slots)
            earlier = self._first_rows.get(request_id)
            if earlier is not None:  # preempted before: those positions' first rows stay
                rows = np.concatenate([earlier, rows[earlier.shape[0] :]]) if rows.shape[0] > earlier.shape[0] else earlier
            self._first_rows[request_id] = rows
        if self._ledger.forget(request_id):
            self.requests_preempted += 1
        self._steps.retire(request_id)

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
        self._ledger.fork(parent_id, child_id, num_positions, slots)

    def release_slots(self, slots: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """The engine evicted or reassigned these KV slots: their rows stop being valid.

        Call it when a block's *content* is discarded (prefix-cache eviction, reassignment to
        another request), not when a request merely stops referencing a block that stays in
        the prefix cache. Afterwards a request that still relies on such a slot fails with
        :class:`StaleSlotError` at finish, and a prefix hit on it is refused, until the slot
        is written again. Optional: without it, a rewrite is still detected.
        """
        self._table.release(host_int64(slots))


def _device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device must name a torch device such as 'cpu', 'cuda' or 'cuda:0', got {device!r}") from e
