"""The request ledger: host-side lifecycle of every request the capturer tracks.

For each live request it knows, per position, which KV slot holds the row and which write
generation of that slot the request relies on (-1: never computed). It commits what an ended
step wrote (:meth:`RequestLedger.commit`, from an :class:`~r3rdma.capture.step.EndedStep`),
attaches prefix-cache hits, forks a request's prefix into another (copy-on-write slots go
through the :class:`~r3rdma.capture.slot_table.SlotTable`), forgets aborted and preempted
requests, and at finish resolves ``(request, start_row, rows) -> slots``, refusing positions
never computed (:class:`MissingRowsError`) and slots rewritten since
(:class:`StaleSlotError`). No device work happens here, except a fork's row copy.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from r3rdma.capture.slot_table import SlotTable, host_int64
from r3rdma.capture.step import EndedStep
from r3rdma.errors import CaptureStateError, MissingRowsError, OutOfRangeError, ShapeMismatchError, StaleSlotError

__all__ = ["RequestLedger", "num_routing_rows"]


def num_routing_rows(prompt_len: int, generated_len: int) -> int:
    """Rows of a finished request: every position that was the input of a forward.

    The last sampled token is never an input, so ``prompt_len + generated_len - 1``.
    """
    if prompt_len < 1 or generated_len < 0:
        raise ShapeMismatchError(f"need prompt_len >= 1 and generated_len >= 0, got {prompt_len}, {generated_len}")
    return prompt_len + max(generated_len, 1) - 1


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


class RequestLedger:
    """Per-request positions -> (slot, generation), over one :class:`SlotTable`."""

    def __init__(self, table: SlotTable) -> None:
        self.table = table
        self._requests: dict[str, _RequestState] = {}

    @property
    def active_requests(self) -> int:
        return len(self._requests)

    @property
    def tracked_positions(self) -> int:
        return int(sum(state.slots.shape[0] for state in self._requests.values()))

    def forget(self, request_id: str) -> bool:
        """Drop a request's state (abort, preempt); whether it had any."""
        return self._requests.pop(request_id, None) is not None

    def _state_for(self, request_id: str, retired: frozenset[str]) -> _RequestState | None:
        if request_id in retired:
            # Finished, aborted or preempted while this step was in flight (overlap
            # scheduling): its slots were written, but the request keeps no state.
            return None
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState()
        return state

    def commit(self, step: EndedStep) -> None:
        """Position -> (slot, generation) for each request's kept tokens of an ended step."""
        slots, gens = step.slots, step.gens
        if step.token_idx is None:
            # Every token kept: request i's tokens are one contiguous run of positions, so
            # plain slices do (this is the decode hot path: no per-token index arrays).
            ends = np.cumsum(step.counts).tolist()
            begin = 0
            for rid, start, end in zip(step.request_ids, step.starts.tolist(), ends):
                state = self._state_for(rid, step.retired)
                if state is not None and end > begin:
                    stop = start + end - begin
                    state.ensure(stop)
                    state.slots[start:stop] = slots[begin:end]
                    state.gens[start:stop] = gens[begin:end]
                begin = end
            return
        token_idx = step.token_idx
        positions = np.repeat(step.starts, step.counts) + (
            np.arange(step.total) - np.repeat(np.cumsum(step.counts) - step.counts, step.counts)
        )
        owner = np.repeat(np.arange(len(step.request_ids)), step.counts)[token_idx]
        positions = positions[token_idx]
        bounds = np.flatnonzero(np.diff(owner)) + 1
        for chunk in np.split(np.arange(token_idx.size), bounds):
            state = self._state_for(step.request_ids[owner[chunk[0]]], step.retired)
            if state is not None:
                pos = positions[chunk]
                state.ensure(int(pos.max()) + 1)
                state.slots[pos] = slots[chunk]
                state.gens[pos] = gens[chunk]

    def attach(self, request_id: str, positions: Sequence[int], slots: Sequence[int]) -> None:
        """A prefix-cache hit: ``positions`` of ``request_id`` reuse rows already in ``slots``."""
        pos = host_int64(positions)
        slt = host_int64(slots)
        if pos.shape != slt.shape:
            raise ShapeMismatchError(f"positions and slots differ in length: {pos.shape[0]} vs {slt.shape[0]}")
        if pos.size == 0:
            return
        self.table.check_slots(slt)
        self.table.check_attachable(request_id, slt)
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState()
        state.ensure(int(pos.max()) + 1)
        state.slots[pos] = slt
        state.gens[pos] = self.table.gen[slt]

    def fork(self, parent_id: str, child_id: str, num_positions: int,
             slots: Sequence[int] | np.ndarray | torch.Tensor | None) -> None:
        """``child_id`` starts with positions ``0 .. num_positions - 1`` of ``parent_id``
        (see :meth:`RoutingCapturer.fork_request`)."""
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
        stale = self.table.stale(src, parent.gens[:num_positions])
        if stale.size:
            raise StaleSlotError(f"fork_request: slots of positions {stale[:8].tolist()} of {parent_id!r} were rewritten")
        dst = src.copy() if slots is None else host_int64(slots)
        if dst.shape != (num_positions,):
            raise ShapeMismatchError(f"fork_request: need {num_positions} slots, got {dst.shape[0]}")
        self.table.check_slots(dst)
        child = _RequestState()
        child.ensure(num_positions)
        child.slots[:num_positions] = dst
        child.gens[:num_positions] = parent.gens[:num_positions]
        copied = np.flatnonzero(dst != src)
        if copied.size:
            child.gens[copied] = self.table.copy_rows(src[copied], dst[copied])
        self._requests[child_id] = child

    def resolve(self, request_id: str, *, start_row: int, prompt_len: int, generated_len: int) -> np.ndarray:
        """Release ``request_id``'s state and return the slots of its rows ``start_row .. rows - 1``.

        The state is released whether or not this raises: :class:`OutOfRangeError` for a
        ``start_row`` that leaves no row, :class:`MissingRowsError` for positions never
        computed, :class:`StaleSlotError` for slots rewritten or released since.
        """
        state = self._requests.pop(request_id, None)
        rows = num_routing_rows(prompt_len, generated_len)
        if not 0 <= start_row < rows:
            # A record of 0 rows would be stored as an array no Zarr reader can open; the
            # request is refused here, before anything reaches the sink.
            raise OutOfRangeError(
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
        stale = self.table.stale(slots, gens)
        if stale.size:
            raise StaleSlotError(
                f"request {request_id!r}: slots of positions {(stale[:8] + start_row).tolist()} were rewritten "
                "by other tokens before the request finished (slot freed too early?)"
            )
        return slots
