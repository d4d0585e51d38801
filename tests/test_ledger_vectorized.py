"""The request ledger's paged arena against a plain model: a dict of positions per request.

:class:`~r3rdma.capture.ledger.RequestLedger` commits a step with array operations over a page
table (lanes x pages of ``P`` positions). Here it runs with tiny pages and capacities, so lanes,
pages and page-table width all grow, next to a model that keeps ``{request: {position: (slot,
generation)}}`` and follows the contract of docs/ENGINE_SEMANTICS.md literally: steps (chunked
prefill, decode, speculative accepted masks, zero-token requests, requests finished or aborted
while the step is open), prefix hits, forks with copy-on-write, forget (abort / preempt),
finish, and released slots. After every operation the ledger's positions, its live requests and
its page accounting must match the model; errors must be the model's, and leave the same state.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3rdma.capture.capturer import RoutingCapturer
from r3rdma.capture.id_check import NoIdRangeCheck
from r3rdma.capture.ledger import RequestLedger
from r3rdma.capture.slot_table import SlotTable
from r3rdma.capture.step import StepRecorder
from r3rdma.errors import CaptureStateError, MissingRowsError, OutOfRangeError, ShapeMismatchError, StaleSlotError

NUM_SLOTS = 96
IDS = [f"r{i}" for i in range(7)]


class Harness:
    """The ledger under test (over a real slot table and step recorder) and the model."""

    def __init__(self, *, page_positions: int, lanes: int, pages: int) -> None:
        self.table = SlotTable(num_slots=NUM_SLOTS, num_layers=1, top_k=1, num_experts=8, device=torch.device("cpu"),
                               pin_memory=False)
        self.table.fix_step_buffer(torch.zeros((NUM_SLOTS, 1, 1), dtype=torch.uint8))
        self.steps = StepRecorder(table=self.table, layer_map=(0,), top_k=1, ids=NoIdRangeCheck(), tp_group=None)
        self.ledger = RequestLedger(self.table, page_positions=page_positions, lanes=lanes, pages=pages)
        self.P = page_positions
        self.model: dict[str, dict[int, tuple[int, int]]] = {}

    # -- operations, each on both ----------------------------------------------------------------

    def step(self, reqs: list[tuple[str, int, int]], slots: np.ndarray, accepted: np.ndarray | None,
             retire: list[str]) -> None:
        ids = [r for r, _, _ in reqs]
        self.steps.begin(ids, [s for _, s, _ in reqs], [c for _, _, c in reqs], slots, router_rows=None, graphed=True)
        for rid in retire:  # finished / aborted while the step is open (overlap scheduling)
            self.forget(rid)
            self.steps.retire(rid)
        ended = self.steps.end(accepted)
        if ended is not None:
            self.ledger.commit(ended)
        gens = self.table.gen[slots]
        t = 0
        for rid, start, count in reqs:
            for p in range(start, start + count):
                if (accepted is None or accepted[t]) and rid not in retire:
                    self.model.setdefault(rid, {})[p] = (int(slots[t]), int(gens[t]))
                t += 1

    def attach(self, rid: str, positions: np.ndarray, slots: np.ndarray) -> None:
        refused = positions.size and (bool((self.table.gen[slots] == 0).any()) or not self.table.valid[slots].all())
        if refused:
            with pytest.raises(StaleSlotError):
                self.ledger.attach(rid, positions, slots)
            return
        self.ledger.attach(rid, positions, slots)
        if positions.size:
            entry = self.model.setdefault(rid, {})
            for p, s in zip(positions.tolist(), slots.tolist()):
                entry[p] = (s, int(self.table.gen[s]))

    def fork(self, parent: str, child: str, n: int, child_slots: np.ndarray | None) -> None:
        src = self.model.get(parent)
        expected = None
        if src is None:
            expected = MissingRowsError
        elif child in self.model:
            expected = CaptureStateError
        elif any(p not in src for p in range(n)):
            expected = MissingRowsError
        elif any(self.table.gen[src[p][0]] != src[p][1] for p in range(n)):
            expected = StaleSlotError
        if expected is not None:
            with pytest.raises(expected):
                self.ledger.fork(parent, child, n, child_slots)
            return
        self.ledger.fork(parent, child, n, child_slots)
        entry = self.model[child] = {}
        for p in range(n):
            slot, gen = src[p]
            if child_slots is not None and child_slots[p] != slot:  # copy-on-write: a fresh write
                slot = int(child_slots[p])
                gen = int(self.table.gen[slot])
            entry[p] = (slot, gen)

    def forget(self, rid: str) -> None:
        assert self.ledger.forget(rid) == (rid in self.model)
        self.model.pop(rid, None)

    def finish(self, rid: str, prompt_len: int, generated_len: int, start_row: int) -> None:
        entry = self.model.pop(rid, None)
        rows = prompt_len + max(generated_len, 1) - 1
        expected = None
        if not 0 <= start_row < rows:
            expected = OutOfRangeError
        elif entry is None or any(p not in entry for p in range(start_row, rows)):
            expected = MissingRowsError
        elif any(self.table.gen[entry[p][0]] != entry[p][1] for p in range(start_row, rows)):
            expected = StaleSlotError
        if expected is not None:
            with pytest.raises(expected):
                self.ledger.resolve(rid, start_row=start_row, prompt_len=prompt_len, generated_len=generated_len)
            return
        got = self.ledger.resolve(rid, start_row=start_row, prompt_len=prompt_len, generated_len=generated_len)
        assert got.tolist() == [entry[p][0] for p in range(start_row, rows)]

    def release(self, slots: np.ndarray) -> None:
        self.table.release(slots)

    # -- the comparison ---------------------------------------------------------------------------

    def check(self) -> None:
        ledger = self.ledger
        ledger._apply_log()  # decode steps logged and not yet in the pages (read directly below)
        assert ledger.active_requests == len(self.model)
        assert set(ledger._lanes) == set(self.model)
        for rid, entry in self.model.items():
            end = max(entry, default=-1) + 2 * self.P  # and positions past the last one
            slots, gens = ledger._read(ledger._lanes[rid], 0, end)
            for p in range(end):
                if p in entry:
                    assert (int(slots[p]), int(gens[p])) == entry[p], (rid, p)
                else:
                    assert gens[p] == -1, (rid, p)
        # Pages: each held by one (lane, page index) of a live request, none lost or shared.
        lanes = np.array(sorted(ledger._lanes.values()), dtype=np.int64)
        held = ledger._page_table[lanes][ledger._page_table[lanes] != 0] if lanes.size else np.zeros(0, np.int64)
        assert np.unique(held).size == held.size
        assert ledger.tracked_positions == held.size * self.P
        free = ledger._free_pages[: ledger._num_free]
        assert np.intersect1d(free, held).size == 0 and np.unique(free).size == free.size
        assert free.size + held.size == ledger._gens.size // self.P - 1  # every page but the empty one
        assert (ledger._gens[: self.P] == -1).all()  # the empty page is never written
        if not self.model:
            assert ledger.tracked_positions == 0


def _slots(data, n: int) -> np.ndarray:
    """``n`` distinct slots."""
    return np.array(data.draw(st.lists(st.integers(0, NUM_SLOTS - 1), min_size=n, max_size=n, unique=True)),
                    dtype=np.int64)


def _run_op(h: Harness, data) -> None:
    op = data.draw(st.sampled_from(["step", "step", "step", "decode", "attach", "fork", "forget", "finish", "release"]))
    rid = data.draw(st.sampled_from(IDS))
    if op in ("step", "decode"):
        names = data.draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=5, unique=True))
        if op == "decode":  # one token per request, each at its next position
            reqs = [(r, max(h.model.get(r) or [-1]) + 1, 1) for r in names]
        else:
            reqs = [(r, data.draw(st.integers(0, 40)), data.draw(st.integers(0, 9))) for r in names]
        total = sum(c for _, _, c in reqs)
        accepted = None
        if total and data.draw(st.booleans()):
            accepted = np.array(data.draw(st.lists(st.booleans(), min_size=total, max_size=total)), dtype=bool)
        retire = data.draw(st.lists(st.sampled_from(names), max_size=2, unique=True)) if data.draw(st.booleans()) else []
        h.step(reqs, _slots(data, total), accepted, retire)
    elif op == "attach":
        # Out of order and across pages sometimes, and on slots never written or released.
        positions = np.array(data.draw(st.lists(st.integers(0, 40), max_size=10, unique=True)), dtype=np.int64)
        if data.draw(st.booleans()):
            positions.sort()
        h.attach(rid, positions, _slots(data, positions.size))
    elif op == "fork":
        child = data.draw(st.sampled_from(IDS))
        n = data.draw(st.integers(0, 20))
        child_slots = None
        parent = h.model.get(rid, {})
        if data.draw(st.booleans()) and all(p in parent for p in range(n)):
            own = _slots(data, n)
            shared = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
            child_slots = np.array([parent[p][0] if s else own[p] for p, s in enumerate(shared)], dtype=np.int64)
            copied = child_slots[[not s for s in shared]] if n else child_slots
            if np.unique(copied).size != copied.size:
                child_slots = None
        h.fork(rid, child, n, child_slots)
    elif op == "forget":
        h.forget(rid)
    elif op == "finish":
        h.finish(rid, data.draw(st.integers(1, 30)), data.draw(st.integers(0, 12)), data.draw(st.integers(0, 20)))
    else:
        h.release(_slots(data, data.draw(st.integers(1, 4))))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), page_positions=st.sampled_from([1, 2, 4, 8]), lanes=st.integers(1, 3), pages=st.integers(1, 3),
       num_ops=st.integers(1, 40))
def test_ledger_matches_dict_model(data, page_positions, lanes, pages, num_ops):
    h = Harness(page_positions=page_positions, lanes=lanes, pages=pages)
    for _ in range(num_ops):
        _run_op(h, data)
        if data.draw(st.booleans()):  # not after every op: decode steps stay logged across several
            h.check()
    for rid in list(h.model):
        h.forget(rid)
    h.check()
    assert h.ledger.tracked_positions == 0 and h.ledger.active_requests == 0


def test_growth_past_lanes_pages_and_width():
    """From one lane and one page of 2 positions: 40 requests of up to 300 positions, decoded
    together, then finished: every array grows, every row comes back, nothing stays held."""
    rng = np.random.default_rng(0)
    lengths = {f"g{i}": int(rng.integers(1, 300)) for i in range(40)}
    slot_of = {rid: i * 300 for i, rid in enumerate(lengths)}
    table = SlotTable(num_slots=40 * 300, num_layers=1, top_k=1, num_experts=8, device=torch.device("cpu"),
                      pin_memory=False)
    table.fix_step_buffer(torch.zeros((64, 1, 1), dtype=torch.uint8))
    steps = StepRecorder(table=table, layer_map=(0,), top_k=1, ids=NoIdRangeCheck(), tp_group=None)
    ledger = RequestLedger(table, page_positions=2, lanes=1, pages=1)
    for pos in range(max(lengths.values())):
        live = [r for r, n in lengths.items() if pos < n]
        steps.begin(live, [pos] * len(live), [1] * len(live), [slot_of[r] + pos for r in live], router_rows=None,
                    graphed=True)
        ledger.commit(steps.end(None))
    assert ledger.active_requests == 40
    assert ledger.tracked_positions == sum(-(-n // 2) * 2 for n in lengths.values())
    for rid, n in lengths.items():
        got = ledger.resolve(rid, start_row=0, prompt_len=n, generated_len=1)
        assert got.tolist() == list(range(slot_of[rid], slot_of[rid] + n))
    assert ledger.active_requests == 0 and ledger.tracked_positions == 0


def test_pages_reused_after_finish_hold_no_old_positions():
    """A page a finished request gave back is all 'never computed' for its next owner."""
    h = Harness(page_positions=4, lanes=1, pages=1)
    slots = np.arange(8, dtype=np.int64)
    h.step([("a", 0, 8)], slots, None, [])
    h.finish("a", 8, 1, 0)
    h.step([("b", 0, 1)], np.array([20], np.int64), None, [])  # b reuses a's pages
    h.check()
    with pytest.raises(MissingRowsError, match=r"first: \[1, 2, 3, 4"):
        h.ledger.resolve("b", start_row=0, prompt_len=5, generated_len=1)


def test_unordered_positions_sharing_a_page_get_one_page():
    """Positions of one page that are not adjacent in the input (out-of-order attach) still get
    one page: the extra pages go back to the free list."""
    h = Harness(page_positions=4, lanes=1, pages=1)
    h.step([("w", 0, 12)], np.arange(12, dtype=np.int64), None, [])
    h.attach("x", np.array([0, 8, 1, 9, 2], np.int64), np.array([0, 8, 1, 9, 2], np.int64))
    h.check()
    assert h.ledger.tracked_positions == (3 + 2) * 4  # w: 3 pages, x: pages 0 and 2


def test_new_requests_without_kept_tokens_get_no_state():
    h = Harness(page_positions=4, lanes=2, pages=2)
    # a: every token rejected; b: announced with 0 tokens; c: kept.
    h.step([("a", 0, 2), ("b", 5, 0), ("c", 0, 2)], np.arange(4, dtype=np.int64), np.array([0, 0, 1, 1], bool), [])
    h.check()
    assert h.ledger.active_requests == 1
    h.step([("b", 0, 0), ("c", 2, 1)], np.array([9], np.int64), None, [])
    h.check()
    assert h.ledger.active_requests == 1


def test_capturer_refuses_negative_positions_and_counts():
    cap = RoutingCapturer(layer_map=[0], top_k=1, num_experts=8, num_slots=16)
    with pytest.raises(ShapeMismatchError, match=">= 0"):
        cap.begin_step(["a"], [-1], [1], [0])
    with pytest.raises(ShapeMismatchError, match=">= 0"):
        cap.begin_step(["a", "b"], [0, 0], [2, -1], [0])
    cap.begin_step(["a"], [0], [1], [0])
    cap.record(0, torch.zeros((1, 1), dtype=torch.int64))
    cap.end_step()
    with pytest.raises(OutOfRangeError, match=">= 0"):
        cap.attach_cached("b", [-1], [0])
    assert cap.active_requests == 1
    with pytest.raises(ShapeMismatchError, match="num_positions"):
        cap.fork_request("a", "c", -1)


def test_duplicate_slots_in_a_step_refused_without_sorting():
    cap = RoutingCapturer(layer_map=[0], top_k=1, num_experts=8, num_slots=64)
    for slots in ([3, 9, 3], [0, 1, 2, 63, 0], [5, 5]):
        with pytest.raises(ShapeMismatchError, match="appears twice"):
            cap.begin_step(["a"], [0], [len(slots)], slots)
    cap.begin_step(["a"], [0], [4], [3, 9, 0, 63])  # the scratch left from refused steps does not matter
    cap.cancel_step()
