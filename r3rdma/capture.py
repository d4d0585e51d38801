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
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch

from .errors import CaptureStateError, MissingRowsError, ShapeMismatchError, StaleSlotError
from .ids import validate_id
from .kernels import gather_rows, table_dtype, write_step_rows
from .records import RequestRecord, routing_dtype

__all__ = ["RoutingCapturer", "RoutingSink", "num_routing_rows"]


def num_routing_rows(prompt_len: int, generated_len: int) -> int:
    """Rows of a finished request: every position that was the input of a forward.

    The last sampled token is never an input, so ``prompt_len + generated_len - 1``.
    """
    if prompt_len < 1 or generated_len < 0:
        raise ShapeMismatchError(f"need prompt_len >= 1 and generated_len >= 0, got {prompt_len}, {generated_len}")
    return prompt_len + max(generated_len, 1) - 1


class RoutingSink(Protocol):
    """Where finished requests go (a :class:`~r3rdma.pipeline.RoutingWriter`, a test list...)."""

    def submit(self, record: RequestRecord) -> None: ...


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
        device: where the slot table and step buffer live.
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
        self.sink = sink
        self.rollout_id = validate_id(rollout_id, "rollout_id")
        self.device = torch.device(device)
        self._moe_index = {layer: i for i, layer in enumerate(self.layer_map)}
        dtype = table_dtype(num_experts)
        shape = (self.num_slots, len(self.layer_map), self.top_k)
        if pin_memory and self.device.type == "cpu":
            self.table_SLK = torch.zeros(shape, dtype=dtype).pin_memory()
        else:
            self.table_SLK = torch.zeros(shape, dtype=dtype, device=self.device)
        self._step_buf = torch.zeros((0, len(self.layer_map), self.top_k), dtype=dtype, device=self.device)
        self._slot_gen = np.zeros(self.num_slots, dtype=np.int64)  # writes so far, per slot
        self._requests: dict[str, _RequestState] = {}
        self._step: _Step | None = None
        self.rows_captured = 0
        self.requests_finished = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_map)

    # -- the step path ----------------------------------------------------------------------

    def begin_step(
        self,
        request_ids: Sequence[str],
        start_positions: Sequence[int],
        num_tokens: Sequence[int],
        slots_T: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        router_rows: torch.Tensor | None = None,
    ) -> None:
        """Announce the tokens of the next forward, request by request.

        The step computes, for each ``i``, positions ``start_positions[i] ..
        start_positions[i] + num_tokens[i] - 1`` of ``request_ids[i]``; tokens are ordered
        request by request and ``slots_T[t]`` is the KV slot token ``t`` writes (host values:
        the engine's own slot mapping, so no device read is needed).

        ``router_rows`` (on the device, optional) maps token t to the row of the router's
        input that computed it, when the router also sees padding; default: row t.
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
        if self._step_buf.shape[0] < total:
            self._step_buf = torch.zeros(
                (max(total, 2 * self._step_buf.shape[0]), self.num_layers, self.top_k),
                dtype=self._step_buf.dtype,
                device=self.device,
            )
        self._step = _Step(list(request_ids), np.asarray(start_positions, dtype=np.int64), counts, slots, router_rows, self.num_layers)

    def record(self, layer_idx: int, topk_ids_TK: torch.Tensor) -> None:
        """Record one MoE layer's top-k ids for the current step (called from the router)."""
        step = self._step
        if step is None:
            raise CaptureStateError(f"record(layer {layer_idx}) called outside begin_step/end_step")
        moe = self._moe_index.get(layer_idx)
        if moe is None:
            raise ShapeMismatchError(f"layer {layer_idx} is not a captured MoE layer; layer_map is {self.layer_map}")
        if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[1] != self.top_k:
            raise ShapeMismatchError(f"layer {layer_idx}: expected top-k ids [T, {self.top_k}], got {tuple(topk_ids_TK.shape)}")
        total = step.total
        rows = topk_ids_TK if step.router_rows is None else topk_ids_TK.index_select(0, step.router_rows)
        if rows.shape[0] != total:
            raise ShapeMismatchError(
                f"layer {layer_idx}: the step announced {total} tokens but the router produced {topk_ids_TK.shape[0]} rows"
                + ("" if step.router_rows is None else " (after router_rows selection)")
            )
        if step.recorded[moe]:
            raise CaptureStateError(f"layer {layer_idx} recorded twice in one step (chunked MoE? record whole steps)")
        step.recorded[moe] = True
        self._step_buf[:total, moe].copy_(rows, non_blocking=True)

    def end_step(self, accepted_T: Sequence[bool] | np.ndarray | None = None) -> None:
        """Commit the step's rows to the slot table.

        ``accepted_T`` (host booleans, one per token) keeps only accepted tokens, as in
        speculative decoding where rejected draft tokens' rows must not be stored.
        """
        step = self._step
        if step is None:
            raise CaptureStateError("end_step called without begin_step")
        self._step = None
        if step.total and not all(step.recorded):
            missing = [self.layer_map[i] for i, done in enumerate(step.recorded) if not done]
            raise CaptureStateError(f"step ended without routing for MoE layers {missing} (a router skipped its hook?)")
        keep = None
        if accepted_T is not None:
            keep = np.asarray(accepted_T, dtype=bool)
            if keep.shape != (step.total,):
                raise ShapeMismatchError(f"accepted_T must have {step.total} entries, got shape {keep.shape}")
        token_idx = np.arange(step.total) if keep is None else np.flatnonzero(keep)
        if token_idx.size == 0:
            return
        slots = step.slots[token_idx]
        slots_dev = torch.from_numpy(slots).to(self.device, non_blocking=True)
        rows = self._step_buf[: step.total]
        if keep is not None:
            rows = rows.index_select(0, torch.from_numpy(token_idx).to(self.device, non_blocking=True))
        write_step_rows(self.table_SLK, slots_dev, rows)
        self._slot_gen[slots] += 1
        gens = self._slot_gen[slots]
        # Host bookkeeping: position -> (slot, generation) for each request's kept tokens.
        positions = np.repeat(step.starts, step.counts) + (np.arange(step.total) - np.repeat(np.cumsum(step.counts) - step.counts, step.counts))
        owner = np.repeat(np.arange(len(step.request_ids)), step.counts)[token_idx]
        positions = positions[token_idx]
        bounds = np.flatnonzero(np.diff(owner)) + 1
        for chunk in np.split(np.arange(token_idx.size), bounds):
            rid = step.request_ids[owner[chunk[0]]]
            state = self._requests.get(rid)
            if state is None:
                state = self._requests[rid] = _RequestState()
            pos = positions[chunk]
            state.ensure(int(pos.max()) + 1)
            state.slots[pos] = slots[chunk]
            state.gens[pos] = gens[chunk]
        self.rows_captured += int(token_idx.size)

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
    ) -> RequestRecord:
        """Gather the request's rows ``start_row .. prompt_len + generated_len - 2`` and hand them to the sink.

        Raises :class:`MissingRowsError` if a position was never computed and
        :class:`StaleSlotError` if a slot was rewritten by another token since.
        The request's bookkeeping is released either way; the engine may then free its slots.
        """
        state = self._requests.pop(request_id, None)
        rows = num_routing_rows(prompt_len, generated_len)
        if not 0 <= start_row <= rows:
            raise ShapeMismatchError(f"start_row must be in 0..{rows}, got {start_row}")
        if state is None:
            if rows - start_row == 0:
                state = _RequestState()
            else:
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
        ids = gather_rows(self.table_SLK, torch.from_numpy(slots).to(self.device)).cpu().numpy()
        if self.storage_dtype == np.uint16:
            ids = ids.view(np.uint16)
        record = RequestRecord(
            rollout_id=rollout_id or self.rollout_id,
            request_id=request_id,
            ids_TLK=ids,
            layer_map=self.layer_map,
            num_experts=self.num_experts,
            start_row=start_row,
        )
        self.requests_finished += 1
        if self.sink is not None:
            self.sink.submit(record)
        return record

    def abort_request(self, request_id: str) -> None:
        """Forget an aborted request; nothing is stored."""
        self._requests.pop(request_id, None)

    @property
    def active_requests(self) -> int:
        return len(self._requests)


class _Step:
    __slots__ = ("request_ids", "starts", "counts", "slots", "router_rows", "total", "recorded")

    def __init__(self, request_ids, starts, counts, slots, router_rows, num_layers) -> None:
        self.request_ids = request_ids
        self.starts = starts
        self.counts = counts
        self.slots = slots
        self.router_rows = router_rows
        self.total = int(slots.shape[0])
        self.recorded = [False] * num_layers


def _host_int64(values: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ShapeMismatchError("slot and position arrays must be host values (the engine's own mapping), got a device tensor")
        values = values.numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)
