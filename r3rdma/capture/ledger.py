"""The request ledger: host-side lifecycle of every request the capturer tracks.

For each live request it knows, per position, which KV slot holds the row and which write
generation of that slot the request relies on (-1: never computed). It commits what an ended
step wrote (:meth:`RequestLedger.commit`, from an :class:`~r3rdma.capture.step.EndedStep`),
attaches prefix-cache hits, forks a request's prefix into another (copy-on-write slots go
through the :class:`~r3rdma.capture.slot_table.SlotTable`), forgets aborted and preempted
requests, and at finish resolves ``(request, start_row, rows) -> slots``, refusing positions
never computed (:class:`MissingRowsError`) and slots rewritten since
(:class:`StaleSlotError`). No device work happens here, except a fork's row copy.

Storage is a paged arena, like the engine's own KV block table, so that committing a step is a
few array operations whatever the number of requests in it (no per-request Python on the
decode hot path):

- each live request holds a *lane*, a row of the page table ``[lanes, pages]``;
- page ``j`` of a lane holds positions ``j*P .. j*P + P - 1`` of that request, as one page of
  the ``slots`` and ``gens`` pools (``P`` positions each, a power of two); the page table holds
  each page's offset into the pools, so position ``p`` is at ``offset | (p & (P - 1))``;
- page 0 is the *empty page*: never written, its generations all -1. A page-table entry that
  was never given a page points at it, so a read of a position never computed needs no mask;
- pages and lanes come from free lists and go back when a request finishes, aborts, is
  preempted or forgotten; every array grows by doubling when a free list runs dry.

Decode steps (one token per request, every token kept: the step of a steady rollout) are not
written into the pages when they end but logged, one copied array per step, and written
``_LOG_STEPS`` at a time, or before anything reads or releases a lane (every other method
applies the log first). Why: on the engine's step path a numpy call costs 5-15 us with the
caches cold from the forward (measured on the CPU VM inside vLLM), and a step's write is ~10
of them; a batch of 32 decode steps costs the same ~10 calls once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from r3rdma.capture.slot_table import SlotTable, host_int64
from r3rdma.capture.step import EndedStep
from r3rdma.errors import CaptureStateError, ConfigError, MissingRowsError, OutOfRangeError, ShapeMismatchError, StaleSlotError

__all__ = ["RequestLedger", "num_routing_rows"]

_EMPTY_PAGE = 0  # never written: every generation -1 (a position never computed)
_LOG_STEPS = 32  # decode steps logged before they are written into the pages (module docstring)


def num_routing_rows(prompt_len: int, generated_len: int) -> int:
    """Rows of a finished request: every position that was the input of a forward.

    The last sampled token is never an input, so ``prompt_len + generated_len - 1``.
    """
    if prompt_len < 1 or generated_len < 0:
        raise ShapeMismatchError(f"need prompt_len >= 1 and generated_len >= 0, got {prompt_len}, {generated_len}")
    return prompt_len + max(generated_len, 1) - 1


class _Lanes(dict[str, int]):
    """Request id -> lane; looking up an id without one gives it a free lane (a new request)."""

    __slots__ = ("ledger",)

    def __init__(self, ledger: RequestLedger) -> None:
        super().__init__()
        self.ledger = ledger

    def __missing__(self, request_id: str) -> int:
        return self.ledger._new_lane(request_id)


class RequestLedger:
    """Per-request positions -> (slot, generation), over one :class:`SlotTable`.

    Args:
        table: the slot table whose generations the positions rely on.
        page_positions: positions per page (``P``, a power of two).
        lanes, pages: initial capacities (requests, pages of ``P`` positions); both grow on demand.
    """

    def __init__(self, table: SlotTable, *, page_positions: int = 128, lanes: int = 64, pages: int = 256) -> None:
        if page_positions < 1 or page_positions & (page_positions - 1):
            raise ConfigError(f"page_positions must be a power of two, got {page_positions}")
        if lanes < 1 or pages < 1:
            raise ConfigError(f"need lanes >= 1 and pages >= 1, got {lanes}, {pages}")
        self.table = table
        self._P = page_positions
        self._shift = page_positions.bit_length() - 1
        self._mask = page_positions - 1
        self._offsets = np.arange(page_positions, dtype=np.int64)  # positions within a page
        self._lanes = _Lanes(self)
        self._free_lanes = list(range(lanes - 1, -1, -1))
        # lane, page index -> the page's offset into the pools (page * P; 0: the empty page)
        self._page_table = np.zeros((lanes, 4), dtype=np.int64)
        self._created: list[str] = []  # requests given a lane by the commit in progress
        pages += 1  # and the empty page
        self._slots = np.zeros(pages * page_positions, dtype=np.int64)
        self._gens = np.full(pages * page_positions, -1, dtype=np.int64)
        # Free pages, by offset into the pools (page * P): a stack, [:_num_free] are free.
        self._free_pages = np.arange(pages - 1, 0, -1, dtype=np.int64) * page_positions
        self._num_free = pages - 1
        # Decode steps not yet in the pages: per step [lanes, positions, slots] as one array of
        # 3 x n (a copy: the engine may reuse its arrays once the step ended) and the step's
        # generation.
        self._log: list[np.ndarray] = []
        self._log_gens: list[int] = []
        # The lanes of the last decode step's requests: a steady batch repeats its request ids
        # (the same string objects, compared by identity), so a step reuses them instead of
        # looking up every id again. Forgotten when any lane is released.
        self._last_ids: tuple[str, ...] = ()
        self._last_lanes = np.zeros(0, np.int64)

    # -- bookkeeping ---------------------------------------------------------------------------

    @property
    def active_requests(self) -> int:
        """Requests holding a lane (live: not yet finished, aborted, preempted or forgotten)."""
        return len(self._lanes)

    @property
    def tracked_positions(self) -> int:
        """Positions held in pages by live requests (a page is held whole)."""
        self._apply_log()
        return (self._free_pages.shape[0] - self._num_free) * self._P

    def forget(self, request_id: str) -> bool:
        """Drop a request's state (abort, preempt); whether it had any."""
        self._apply_log()
        lane = self._lanes.pop(request_id, None)
        if lane is None:
            return False
        self._release_lane(lane)
        return True

    def _new_lane(self, request_id: str) -> int:
        if not self._free_lanes:
            have, width = self._page_table.shape
            self._page_table = np.concatenate([self._page_table, np.zeros((have, width), np.int64)])
            self._free_lanes.extend(range(2 * have - 1, have - 1, -1))
        lane = self._lanes[request_id] = self._free_lanes.pop()
        self._created.append(request_id)
        return lane

    def _release_lane(self, lane: int) -> None:
        self._last_ids = ()  # the lane may go to another request
        row = self._page_table[lane]
        held = row[row != _EMPTY_PAGE]
        if held.size:
            self._free_pages[self._num_free : self._num_free + held.size] = held
            self._num_free += held.size
            row[:] = _EMPTY_PAGE
        self._free_lanes.append(lane)

    def _take_pages(self, n: int) -> np.ndarray:
        """``n`` free pages (their offsets), every position marked never computed."""
        if n > self._num_free:
            P = self._P
            have = self._gens.shape[0] // P  # pages in the pools, the empty page included
            grown = max(2 * have, have + n)
            self._slots = np.concatenate([self._slots, np.zeros((grown - have) * P, np.int64)])
            self._gens = np.concatenate([self._gens, np.empty((grown - have) * P, np.int64)])
            # The stack's free part is kept; the new pages go on top of it.
            free = np.empty(grown - 1, np.int64)
            free[: self._num_free] = self._free_pages[: self._num_free]
            free[self._num_free : self._num_free + grown - have] = np.arange(grown - 1, have - 1, -1) * P
            self._free_pages = free
            self._num_free += grown - have
        self._num_free -= n
        pages = self._free_pages[self._num_free : self._num_free + n].copy()
        # A reused page held another request's positions.
        self._gens.reshape(-1, self._P)[pages >> self._shift] = -1
        return pages

    def _give_back(self, pages: np.ndarray) -> None:
        self._free_pages[self._num_free : self._num_free + pages.size] = pages
        self._num_free += pages.size

    # -- positions ------------------------------------------------------------------------------

    def _write(
        self, lane_T: np.ndarray, pos_T: np.ndarray, slots_T: np.ndarray, gens_T: np.ndarray | int, *, last_wins: bool = False
    ) -> None:
        """Position ``pos_T[i]`` of lane ``lane_T[i]`` -> ``(slots_T[i], gens_T[i])`` (or ``gens_T``
        for all, an int); pages as needed.

        ``last_wins``: a position may come more than once (logged steps of an engine that
        computed a position again), the last one counts; numpy's fancy assignment does not
        promise an order for repeated indices, so repeats are dropped first (one sort).

        Positions are >= 0 (the callers check). Tokens of one request come in runs of
        consecutive positions (steps, prefix hits, forks), which the page allocation relies on
        for speed, not for correctness.
        """
        index_T = pos_T >> self._shift
        try:
            page_T = self._page_table[lane_T, index_T]
        except IndexError:  # a position past every lane's pages so far: widen the page table
            lanes, width = self._page_table.shape
            grown = max(2 * width, int(index_T.max()) + 1)
            self._page_table = np.concatenate([self._page_table, np.zeros((lanes, grown - width), np.int64)], axis=1)
            page_T = self._page_table[lane_T, index_T]
        fresh = page_T == _EMPTY_PAGE
        if fresh.any():
            # A new page for each (lane, page index) without one. Keys repeat in runs (one run
            # per prefill chunk crossing into a page), so dropping repeats of the previous key
            # leaves each key once, without a sort; a key that still repeats (tokens out of
            # order) gets several pages, of which the page table keeps one: the others go back.
            fresh_keys = lane_T[fresh] * self._page_table.shape[1] + index_T[fresh]
            keys = fresh_keys
            if keys.size > 1:
                keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]
            pages = self._take_pages(keys.size)
            table = self._page_table.reshape(-1)
            table[keys] = pages
            if keys.size > 1:
                lost = table[keys] != pages
                if lost.any():
                    self._give_back(pages[lost])
            page_T[fresh] = table[fresh_keys]
        flat_T = page_T | (pos_T & self._mask)
        if last_wins:
            # Each position's last occurrence: the first of the reversed order.
            _, first = np.unique(flat_T[::-1], return_index=True)
            if first.size < flat_T.size:
                last = flat_T.size - 1 - first
                flat_T, slots_T = flat_T[last], slots_T[last]
                if isinstance(gens_T, np.ndarray):
                    gens_T = gens_T[last]
        self._slots[flat_T] = slots_T
        self._gens[flat_T] = gens_T

    def _read(self, lane: int, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots and generations of positions ``begin .. end - 1`` of ``lane`` (-1: never computed)."""
        if end <= begin:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        first, last = begin >> self._shift, (end - 1) >> self._shift
        pages = self._page_table[lane, first : last + 1]
        if pages.shape[0] < last + 1 - first:  # positions past the lane's pages: the empty page
            pages = np.concatenate([pages, np.zeros(last + 1 - first - pages.shape[0], np.int64)])
        flat = (pages[:, None] + self._offsets).reshape(-1)[begin - (first << self._shift) : end - (first << self._shift)]
        return self._slots[flat], self._gens[flat]

    def _apply_log(self) -> None:
        """Write the logged decode steps into the pages, in step order."""
        if not self._log:
            return
        log, self._log = self._log, []
        gens, self._log_gens = self._log_gens, []
        if len(log) == 1:  # a step logged and read at once (a request finished every step): no copies
            lane_T, pos_T, slots_T = log[0].reshape(3, -1)
            self._write(lane_T, pos_T, slots_T, gens[0])
            return
        lane_T, pos_T, slots_T = np.concatenate([entry.reshape(3, -1) for entry in log], axis=1)
        gens_T = np.repeat(np.array(gens, dtype=np.int64), [entry.size // 3 for entry in log])
        self._write(lane_T, pos_T, slots_T, gens_T, last_wins=True)

    # -- the step -------------------------------------------------------------------------------

    def commit(self, step: EndedStep) -> None:
        """Position -> (slot, generation) for each request's kept tokens of an ended step.

        A handful of array operations, whatever the number of requests: each request's lane
        comes from one dict lookup per request (in C, through ``map``), every token's page and
        offset from the page table.
        """
        ids, counts, n = step.request_ids, step.counts, len(step.request_ids)
        self._created.clear()
        if step.token_idx is None and step.fewest == 1 and step.total == n and not step.retired:
            # A decode step: token i is position starts[i] of request i, kept. Logged (module
            # docstring); its lanes are looked up now, while every id still has its own.
            if ids != self._last_ids:
                self._last_ids, self._last_lanes = ids, np.fromiter(map(self._lanes.__getitem__, ids), np.int64, n)
            lanes = self._last_lanes
            self._log.append(np.concatenate((lanes, step.starts, step.slots)))
            self._log_gens.append(step.gen)
            if len(self._log) >= _LOG_STEPS:
                self._apply_log()
            return
        self._apply_log()
        if step.retired:
            # Finished, aborted or preempted while this step was in flight (overlap
            # scheduling): their slots were written, but these requests keep no state.
            lanes = np.fromiter((-1 if r in step.retired else self._lanes[r] for r in ids), np.int64, n)
        else:
            lanes = np.fromiter(map(self._lanes.__getitem__, ids), np.int64, n)
        if step.token_idx is None and step.fewest == 1 and step.total == n:
            lane_T, pos_T = lanes, step.starts  # one token per request (retired ones among them)
        else:
            first = np.cumsum(counts) - counts  # each request's first token in the step
            lane_T = np.repeat(lanes, counts)
            pos_T = np.arange(step.total, dtype=np.int64) + np.repeat(step.starts - first, counts)
            if step.token_idx is not None:
                lane_T, pos_T = lane_T[step.token_idx], pos_T[step.token_idx]
        slots_T = step.slots
        if step.retired:
            kept = lane_T >= 0
            lane_T, pos_T, slots_T = lane_T[kept], pos_T[kept], slots_T[kept]
        if self._created and (step.token_idx is not None or step.fewest == 0):
            # A new request none of whose tokens was kept (all rejected drafts) or announced (0
            # tokens) computed nothing: it gets no state.
            used = np.zeros(self._page_table.shape[0], dtype=bool)
            used[lane_T] = True
            for rid in [r for r in self._created if not used[self._lanes[r]]]:
                self._release_lane(self._lanes.pop(rid))
        if lane_T.size:
            self._write(lane_T, pos_T, slots_T, step.gen)

    # -- requests -------------------------------------------------------------------------------

    def attach(self, request_id: str, positions: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray) -> None:
        """A prefix-cache hit: ``positions`` of ``request_id`` reuse rows already in ``slots``."""
        self._apply_log()
        pos = host_int64(positions)
        slt = host_int64(slots)
        if pos.shape != slt.shape:
            raise ShapeMismatchError(f"positions and slots differ in length: {pos.shape[0]} vs {slt.shape[0]}")
        if pos.size == 0:
            return
        if pos.min() < 0:
            raise OutOfRangeError(f"attach_cached({request_id!r}): positions must be >= 0, got {pos.min()}")
        self.table.check_slots(slt)
        self.table.check_attachable(request_id, slt)
        lane = self._lanes[request_id]
        self._write(np.full(pos.size, lane, np.int64), pos, slt, self.table.gen[slt])

    def fork(
        self, parent_id: str, child_id: str, num_positions: int, slots: Sequence[int] | np.ndarray | torch.Tensor | None
    ) -> None:
        """``child_id`` starts with positions ``0 .. num_positions - 1`` of ``parent_id``
        (see :meth:`RoutingCapturer.fork_request`)."""
        self._apply_log()
        parent = self._lanes.get(parent_id)
        if parent is None:
            raise MissingRowsError(f"fork_request: parent {parent_id!r} has no computed positions")
        if child_id in self._lanes:
            raise CaptureStateError(f"fork_request: {child_id!r} already has positions")
        if num_positions < 0:
            raise ShapeMismatchError(f"fork_request: num_positions must be >= 0, got {num_positions}")
        src, gens = self._read(parent, 0, num_positions)
        missing = np.flatnonzero(gens < 0)
        if missing.size:
            raise MissingRowsError(f"fork_request: positions {missing[:8].tolist()} of {parent_id!r} were never computed")
        stale = self.table.stale(src, gens)
        if stale.size:
            raise StaleSlotError(f"fork_request: slots of positions {stale[:8].tolist()} of {parent_id!r} were rewritten")
        dst = src.copy() if slots is None else host_int64(slots)
        if dst.shape != (num_positions,):
            raise ShapeMismatchError(f"fork_request: need {num_positions} slots, got {dst.shape[0]}")
        self.table.check_slots(dst)
        copied = np.flatnonzero(dst != src)
        if copied.size:
            gens[copied] = self.table.copy_rows(src[copied], dst[copied])
        child = self._lanes[child_id]
        if num_positions:
            self._write(np.full(num_positions, child, np.int64), np.arange(num_positions, dtype=np.int64), dst, gens)

    def computed_prefix(self, request_id: str, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Slots and generations of ``request_id``'s positions ``0 .. n - 1``: the longest run
        from position 0 that is known and not rewritten since (at most ``limit``); the state stays.
        Empty for a request without state."""
        self._apply_log()
        lane = self._lanes.get(request_id)  # .get: no lane is made for an unknown id
        if lane is None:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        end = self._page_table.shape[1] << self._shift
        if limit is not None:
            end = min(end, max(int(limit), 0))
        slots, gens = self._read(lane, 0, end)
        bad = (gens < 0) | (self.table.gen[slots] != gens)  # never computed, or rewritten since
        first_bad = np.flatnonzero(bad)
        n = int(first_bad[0]) if first_bad.size else int(slots.size)
        return slots[:n], gens[:n]

    def resolve_with_generations(
        self, request_id: str, *, start_row: int, prompt_len: int, generated_len: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Release ``request_id``'s state; return the slots of its rows ``start_row .. rows - 1``
        and the generation of each slot the rows rely on.

        The state is released whether or not this raises: :class:`OutOfRangeError` for a
        ``start_row`` that leaves no row, :class:`MissingRowsError` for positions never
        computed, :class:`StaleSlotError` for slots rewritten or released since.
        """
        self._apply_log()
        lane = self._lanes.pop(request_id, None)
        try:
            rows = num_routing_rows(prompt_len, generated_len)
            if not 0 <= start_row < rows:
                # A record of 0 rows would be stored as an array no Zarr reader can open; the
                # request is refused here, before anything reaches the sink.
                raise OutOfRangeError(
                    f"request {request_id!r}: start_row must be in 0..{rows - 1} so the record holds at least 1 row "
                    f"(prompt_len={prompt_len} + generated_len={generated_len} - 1 = {rows} rows), got start_row={start_row}"
                )
            if lane is None:
                raise MissingRowsError(f"request {request_id!r} finished with {rows} rows but no step ever computed it")
            slots, gens = self._read(lane, start_row, rows)
        finally:
            if lane is not None:
                self._release_lane(lane)
        # One reduction each when all is well (the finishing request's path); the indices
        # only to name what is wrong.
        if gens.size and gens.min() < 0:
            missing = np.flatnonzero(gens < 0) + start_row
            raise MissingRowsError(
                f"request {request_id!r}: {missing.size} of {rows} positions were never computed "
                f"(first: {missing[:8].tolist()}); prompt_len={prompt_len}, generated_len={generated_len}"
            )
        if self.table.any_stale(slots, gens):
            stale = self.table.stale(slots, gens)
            raise StaleSlotError(
                f"request {request_id!r}: slots of positions {(stale[:8] + start_row).tolist()} were rewritten "
                "by other tokens before the request finished (slot freed too early?)"
            )
        return slots, gens

    def resolve(self, request_id: str, *, start_row: int, prompt_len: int, generated_len: int) -> np.ndarray:
        """Release ``request_id``'s state and return the slots of its rows ``start_row .. rows - 1``.

        :meth:`resolve_with_generations`, without the generations."""
        return self.resolve_with_generations(request_id, start_row=start_row, prompt_len=prompt_len, generated_len=generated_len)[
            0
        ]
