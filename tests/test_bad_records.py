"""Issue 19: one bad record never harms the others; failures are named; crashes leave no trace.

Each test here failed before its fix: 0-row records were stored (and broke every read of their
rollout), the writer kept only its first error, TP ranks picked the pushing rank by the engine
request id instead of the stored id, a later turn arriving first made a conversation visible
without its first rows, a crash in a rollout's first commit left a listed but unreadable
rollout, and out-of-range router ids wrapped silently.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import fields

import numpy as np
import pytest
import torch
import zarr

from r3rdma import LocalRoutingStore, RoutingCapturer, RoutingReader, RoutingWriter
from r3rdma.errors import (
    DuplicateRequestError,
    ShapeMismatchError,
    StoreError,
    UnknownRequestError,
)
from r3rdma.records import RequestRecord
from r3rdma.store import publishing as publishing_module

from tests.sinks import ListSink

LAYERS = (0, 2, 5)
K = 2
E = 16


def _capturer(**kw) -> tuple[RoutingCapturer, ListSink]:
    kw.setdefault("check_ids", True)
    sink = ListSink()
    cap = RoutingCapturer(layer_map=LAYERS, top_k=K, num_experts=kw.pop("num_experts", E), num_slots=64,
                          sink=sink, rollout_id="r", **kw)
    return cap, sink


def _step(cap: RoutingCapturer, rid: str, start: int, slots: list[int], *, ids: np.ndarray | None = None) -> None:
    n = len(slots)
    cap.begin_step([rid], [start], [n], slots)
    if ids is None:
        ids = (np.arange(n * len(LAYERS) * K).reshape(n, len(LAYERS), K) + start) % E
    for l, layer in enumerate(LAYERS):
        cap.record(layer, torch.as_tensor(ids[:, l]))
    cap.end_step()


def _unchecked_record(rollout_id: str, request_id: str, ids: np.ndarray) -> RequestRecord:
    """A RequestRecord built around its validation (what a buggy or foreign producer could hand over)."""
    record = object.__new__(RequestRecord)
    values = dict(rollout_id=rollout_id, request_id=request_id, ids_TLK=ids, layer_map=tuple(range(ids.shape[1])),
                  num_experts=E, start_row=50, crc32c=0, final=True, total_rows=None, shared_prefix=None)
    for f in fields(RequestRecord):
        object.__setattr__(record, f.name, values[f.name])
    return record


# -- 1. records of 0 rows ------------------------------------------------------------------------


def test_capturer_refuses_a_record_of_zero_rows():
    cap, sink = _capturer()
    _step(cap, "a", 0, [0, 1, 2, 3, 4, 5, 6])
    with pytest.raises(ShapeMismatchError, match=r"start_row must be in 0\.\.6 .*got start_row=7"):
        cap.finish_request("a", prompt_len=5, generated_len=3, start_row=7)
    assert sink.records == []
    assert cap.active_requests == 0  # bookkeeping released either way


def test_request_record_refuses_zero_rows():
    with pytest.raises(ShapeMismatchError, match="at least 1 routing row, got 0 rows"):
        RequestRecord("r", "n1", np.zeros((0, 3, 2), np.uint8), (0, 1, 2), E, start_row=50)


def test_writer_refuses_zero_rows_at_submit_before_queueing(tmp_path):
    class Deferred:
        nbytes = 0
        rollout_id, request_id = "r", "d0"

        def result(self):  # pragma: no cover - must never be called
            raise AssertionError("a refused record was queued")

    with LocalRoutingStore(tmp_path) as store, RoutingWriter(store) as writer:
        for bad in (_unchecked_record("r", "n1", np.zeros((0, 3, 2), np.uint8)), Deferred()):
            with pytest.raises(ShapeMismatchError, match=r"at least 1 routing row.*nothing was queued"):
                writer.submit(bad)
            assert writer.queued_requests == 0 and writer.inflight_bytes == 0
        writer.flush(timeout=30)
    assert not (tmp_path / "r").exists()


def test_store_refuses_a_batch_with_a_zero_row_record_before_writing(tmp_path, make_record):
    good = make_record("ok", rows=5, rollout_id="r")
    bad = _unchecked_record("r", "n1", np.zeros((0, 3, 2), np.uint8))
    with LocalRoutingStore(tmp_path) as store:
        with pytest.raises(ShapeMismatchError, match=r"request 'n1' of rollout 'r'.*nothing of this batch"):
            store.commit([good, bad])
        assert not (tmp_path / "r").exists()  # no array, no index
        store.commit([good])
    # Every reader still reads the rollout: r3rdma's, and zarr's own listing of the arrays.
    np.testing.assert_array_equal(RoutingReader(tmp_path).get_numpy("r", ["ok"])["ok"], good.ids_TLK)
    group = zarr.open_group(tmp_path / "r", mode="r")
    assert [name for name, _ in group.arrays()] == ["b00000001"]
    assert group["b00000001"].shape == (5, 3, 2)


# -- 2. the writer names every failed request ------------------------------------------------------


def test_writer_reports_every_failed_request_and_commits_the_others(tmp_path, make_record):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("x", rows=4, rollout_id="r"), make_record("y", rows=4, rollout_id="r")])
        conflicting = [make_record(rid, rows=4, rollout_id="r", seed=99) for rid in ("x", "y")]
        good = [make_record(f"g{i}", rows=3, rollout_id="r") for i in range(3)]
        writer = RoutingWriter(store, flush_bytes=1 << 20, flush_interval_s=3600)
        for record in (good[0], conflicting[0], good[1], conflicting[1], good[2]):
            writer.submit(record)
        with pytest.raises(DuplicateRequestError) as info:
            writer.flush(timeout=30)
        assert info.value.failed_request_ids == [("r", "x"), ("r", "y")]
        assert len(info.value.errors) == 2
        assert writer.failed_requests() == [("r", "x"), ("r", "y")]
        assert writer.commit_failures == 2 and writer.requests_committed == 3
        writer.close(timeout=30)
    got = RoutingReader(tmp_path).get_numpy("r", ["g0", "g1", "g2"])
    for record in good:
        np.testing.assert_array_equal(got[record.request_id], record.ids_TLK)


def test_writer_reports_the_requests_of_every_failed_batch(make_record):
    gate = threading.Event()

    class BrokenDisk:
        def commit(self, records):
            gate.wait(30)  # the first batch fails only once all three were submitted
            raise OSError("disk gone")

    writer = RoutingWriter(BrokenDisk(), flush_bytes=1)  # one record per batch
    for i in range(3):
        writer.submit(make_record(f"q{i}", rows=2, rollout_id="r"))
    gate.set()
    with pytest.raises(StoreError, match="disk gone") as info:
        writer.flush(timeout=30)
    expected = [("r", "q0"), ("r", "q1"), ("r", "q2")]
    assert info.value.failed_request_ids == expected
    assert writer.failed_requests() == expected
    assert writer.commit_failures == 3
    assert "3 requests failed to commit" in "".join(getattr(info.value, "__notes__", []))
    writer.submit(make_record("q3", rows=2, rollout_id="r"))
    with pytest.raises(StoreError) as again:
        writer.flush(timeout=30)
    assert again.value.failed_request_ids == [("r", "q3")]  # only what is new since the last raise
    assert writer.failed_requests() == expected + [("r", "q3")]
    writer.close(timeout=30)  # every error was raised already


# -- 3. multi-turn: one pushing rank per conversation; turns in any order ---------------------------


def _two_turn_ids() -> tuple[str, str]:
    for i in range(100):
        a, b = f"c.t0.{i}", f"c.t1.{i}"
        if zlib.crc32(a.encode()) % 2 != zlib.crc32(b.encode()) % 2:
            return a, b
    raise AssertionError("no pair of ids on different ranks")


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_owner_of_a_turn_follows_the_stored_id(rank):
    t0, t1 = _two_turn_ids()
    cap, sink = _capturer()
    _step(cap, t0, 0, [0, 1, 2, 3])
    _step(cap, t1, 0, [10, 11, 12, 13, 14, 15, 16])
    # A TP group of 2 (every rank sees every request finish): this capturer plays `rank`.
    cap._steps.tp_rank, cap._steps.tp_size = rank, 2
    owner = zlib.crc32(b"conv") % 2
    r0 = cap.finish_request(t0, prompt_len=3, generated_len=2, store_as="conv")  # rows 0..3
    r1 = cap.finish_request(t1, prompt_len=6, generated_len=2, start_row=4, store_as="conv")  # rows 4..6
    if rank == owner:
        assert [r.request_id for r in sink.records] == ["conv", "conv"] and r0 is not None and r1 is not None
    else:
        assert sink.records == [] and r0 is None and r1 is None
    assert cap.pushes("conv") == (rank == owner)


def _turns(make_record):
    whole = make_record("conv", rows=12, seed=7, rollout_id="r").ids_TLK
    t1 = RequestRecord("r", "conv", whole[:5], (0, 1, 2), E)
    t2 = RequestRecord("r", "conv", whole[5:9], (0, 1, 2), E, start_row=5)
    t3 = RequestRecord("r", "conv", whole[9:], (0, 1, 2), E, start_row=9)
    return whole, t1, t2, t3


@pytest.mark.parametrize("order", ["in_order", "reversed", "one_batch_reversed", "middle_last"])
def test_turns_of_a_conversation_in_any_order(tmp_path, make_record, order):
    whole, t1, t2, t3 = _turns(make_record)
    batches = {
        "in_order": [[t1], [t2], [t3]],
        "reversed": [[t3], [t2], [t1]],
        "one_batch_reversed": [[t3, t2, t1]],
        "middle_last": [[t1], [t3], [t2]],
    }[order]
    with LocalRoutingStore(tmp_path) as store:
        for i, batch in enumerate(batches):
            store.commit(batch)
            if i < len(batches) - 1 and order != "in_order":
                visible = RoutingReader(tmp_path)
                if order == "middle_last":
                    # Turn 1 is visible alone; turn 3 waits for turn 2.
                    np.testing.assert_array_equal(visible.get_numpy("r", ["conv"])["conv"], whole[:5])
                    assert store.pending("r") == ({} if i == 0 else {"conv": ((9, 12, True),)})
                else:
                    with pytest.raises(UnknownRequestError):
                        visible.get_numpy("r", ["conv"])
        assert store.pending("r") == {}
        store.require_complete("r")
    np.testing.assert_array_equal(RoutingReader(tmp_path).get_numpy("r", ["conv"])["conv"], whole)


def test_pd_turn_two_before_turn_one(tmp_path, make_record):
    """Turn 2 through prefill/decode (total_rows declared) arrives before turn 1."""
    whole = make_record("c", rows=20, seed=5, rollout_id="r").ids_TLK
    t1 = RequestRecord("r", "c", whole[:8], (0, 1, 2), E)
    part = RequestRecord("r", "c", whole[8:13], (0, 1, 2), E, start_row=8, final=False)
    decode = RequestRecord("r", "c", whole[13:], (0, 1, 2), E, start_row=13, total_rows=12)
    with LocalRoutingStore(tmp_path) as store:
        store.commit([decode])
        store.commit([part])
        assert store.pending("r") == {"c": ((8, 13, False), (13, 20, True))}
        store.commit([t1])
        assert store.pending("r") == {}
    np.testing.assert_array_equal(RoutingReader(tmp_path).get_numpy("r", ["c"])["c"], whole)


# -- 4. a crash in a rollout's first commit leaves no trace ------------------------------------------


class _Killed(BaseException):
    """Stands for SIGKILL: no except clause of the store runs."""


def test_a_crash_in_the_first_commit_leaves_no_listed_rollout(tmp_path, make_record, monkeypatch):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("a", rows=4, rollout_id="kept")])

        def killed(*args, **kwargs):
            raise _Killed

        monkeypatch.setattr(publishing_module, "write_json_atomic", killed)
        with pytest.raises(_Killed):
            store.commit([make_record("b", rows=4, rollout_id="fresh")])
        # The array is on disk, but the rollout has no group: nothing lists it.
        assert (tmp_path / "fresh" / "b00000001" / "zarr.json").exists()
        assert not (tmp_path / "fresh" / "zarr.json").exists()
        assert set(store.rollouts()) == {"kept"}
    monkeypatch.undo()
    with LocalRoutingStore(tmp_path) as store:
        assert not (tmp_path / "fresh").exists()
        assert set(store.rollouts()) == {"kept"}


def test_opening_a_root_removes_what_crashed_commits_left(tmp_path, make_record):
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record("a", rows=4, rollout_id="kept")])
    data = np.zeros((3, 3, 2), np.uint8)
    # What the old code left after a SIGKILL in a rollout's first commit: zarr's bare parent
    # group next to an array no index lists.
    zarr.create_array(zarr.storage.LocalStore(tmp_path / "crashed"), name="b00000001", data=data)
    assert (tmp_path / "crashed" / "zarr.json").exists()
    # ... and in a later commit of an indexed rollout: an array and an index part the entry
    # point does not count, and index temp files.
    zarr.create_array(zarr.storage.LocalStore(tmp_path / "kept" / "b00000002"), data=data)
    (tmp_path / "kept" / "i00000002").mkdir()
    (tmp_path / "kept" / "i00000002" / ".zarr.json.tmp-12345").write_bytes(b"{")
    (tmp_path / "kept" / ".zarr.json.tmp-12345").write_bytes(b"{")
    # A directory with files r3rdma never writes is left alone.
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with LocalRoutingStore(tmp_path) as store:
        assert set(store.rollouts()) == {"kept"}
    assert not (tmp_path / "crashed").exists()
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["b00000001", "i00000001", "zarr.json"]
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"
    root = zarr.open_group(tmp_path, mode="r")
    assert [name for name, _ in root.groups()] == ["kept"]
    assert [name for name, _ in root["kept"].arrays()] == ["b00000001"]
    assert [name for name, _ in root["kept"].groups()] == ["i00000001"]
    np.testing.assert_array_equal(
        RoutingReader(tmp_path).get_numpy("kept", ["a"])["a"], make_record("a", rows=4, rollout_id="kept").ids_TLK
    )


# -- 5. router ids the storage dtype cannot hold ----------------------------------------------------


def test_out_of_range_router_ids_are_refused_naming_the_layer():
    cap, sink = _capturer()
    ids = (np.arange(3 * len(LAYERS) * K).reshape(3, len(LAYERS), K)) % E
    ids[1, 1, 0] = 300  # e.g. an EPLB physical id, no expert_map: would wrap to 44 in uint8
    _step(cap, "a", 0, [0, 1, 2], ids=ids)
    with pytest.raises(ShapeMismatchError, match=r"layer 2 \(MoE layer 1\) recorded router id 300, expected 0\.\.15"):
        cap.finish_request("a", prompt_len=3, generated_len=1)
    assert sink.records == []
    # Reported once: later requests are checked afresh.
    _step(cap, "b", 0, [3, 4])
    assert cap.finish_request("b", prompt_len=2, generated_len=1) is not None


def test_negative_ids_and_physical_ids_past_the_expert_map_are_refused():
    cap, _ = _capturer(expert_map=torch.as_tensor([0, 1, 2, 3, 4, 5, 6, 7] * 2 + [8]))  # 17 physical slots
    ids = (np.arange(2 * len(LAYERS) * K).reshape(2, len(LAYERS), K)) % 17
    ids[0, 2, 1] = -1
    _step(cap, "a", 0, [0, 1], ids=ids)
    with pytest.raises(ShapeMismatchError, match=r"layer 5 \(MoE layer 2\) recorded router id -1, expected 0\.\.16: physical ids \(expert_map has 17"):
        cap.finish_request("a", prompt_len=2, generated_len=1)


def test_check_ids_off_stores_what_the_dtype_makes_of_them():
    cap, _ = _capturer(check_ids=False)
    ids = np.zeros((1, len(LAYERS), K), np.int64)
    ids[0, 0, 0] = 257
    _step(cap, "a", 0, [0], ids=ids)
    record = cap.finish_request("a", prompt_len=1, generated_len=1)
    assert record.ids_TLK[0, 0, 0] == 1  # wrapped: what check_ids=True catches


@pytest.mark.gpu
def test_out_of_range_ids_on_cuda_surface_without_a_sync_in_finish():
    """On CUDA the id range is read from an asynchronous pinned copy: at a later finish once it
    has landed, at the latest at flush (which synchronises anyway)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sink = ListSink()
    cap = RoutingCapturer(layer_map=LAYERS, top_k=K, num_experts=E, num_slots=64, sink=sink, rollout_id="r",
                          device="cuda", check_ids=True)
    ids = (np.arange(2 * len(LAYERS) * K).reshape(2, len(LAYERS), K)) % E
    ids[1, 2, 1] = 200
    cap.begin_step(["a"], [0], [2], [0, 1])
    for l, layer in enumerate(LAYERS):
        cap.record(layer, torch.as_tensor(ids[:, l], device="cuda"))
    cap.end_step()
    try:
        cap.finish_request("a", prompt_len=2, generated_len=1)  # issues the copy, never waits
        with pytest.raises(ShapeMismatchError, match=r"layer 5 \(MoE layer 2\) recorded router id 200"):
            cap.flush(timeout=30)
    finally:
        cap.close(timeout=30)


def test_out_of_range_ids_in_a_chunked_moe_layer_are_refused():
    cap, _ = _capturer()
    cap.begin_step(["a"], [0], [3], [0, 1, 2])
    for l, layer in enumerate(LAYERS):
        first = torch.full((2, K), l, dtype=torch.int64)
        second = torch.full((1, K), 99 if layer == 2 else l, dtype=torch.int64)
        cap.record(layer, first, token_offset=0)
        cap.record(layer, second, token_offset=2)
    cap.end_step()
    with pytest.raises(ShapeMismatchError, match=r"layer 2 \(MoE layer 1\) recorded router id 99, expected 0\.\.15"):
        cap.finish_request("a", prompt_len=3, generated_len=1)
