"""RoutingReader reads with ``expected_rows``: a request whose stored row count is not its
sample's (tokens - 1) is refused from the index, before anything is read, instead of handing a
trainer another request's routing (a vLLM server reused a request id, the store refused the
second commit, and the reader returned the first request's 45 rows for a 7-token sample).
The verl and slime hand-offs pass it for every sample whose exact count they know."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from r3rdma import LocalRoutingStore, R3Error, RoutingReader, UnknownRequestError
from r3rdma.errors import (
    ConfigError,
    DuplicateRequestError,
    MissingRowsError,
    RowCountMismatchError,
    ShapeMismatchError,
)
from r3rdma.integrations.rl_frameworks import (
    slime_rollout_routed_experts,
    verl_routed_experts,
    verl_routed_experts_unpadded,
)
from r3rdma.read.fetching import RowFetcher
from r3rdma.read.request_ids import check_expected_rows
from r3rdma.store.index_entries import RequestEntry

LAYERS = 3


@pytest.fixture
def reused(tmp_path, make_record):
    """Rollout "roll-0": "srv-1" holds an old request's 45 rows; the new 7-token request under
    the same id was refused by the store. "a" (20 rows) and "b" (9 rows) are sound."""
    old = make_record("srv-1", rows=45, layers=LAYERS, seed=1)
    a, b = make_record("a", rows=20, layers=LAYERS, seed=2), make_record("b", rows=9, layers=LAYERS, seed=3)
    with LocalRoutingStore(tmp_path, chunk_rows=8) as store:
        store.commit([old, a, b])
        with pytest.raises(DuplicateRequestError):
            store.commit([make_record("srv-1", rows=6, layers=LAYERS, seed=4)])  # 7 tokens: 6 rows
    return tmp_path, {"srv-1": old, "a": a, "b": b}


@pytest.fixture
def reads(monkeypatch):
    """Every read of rows (RowFetcher.read, under every RoutingReader read), as the request
    ids it was asked for."""
    seen: list[list[str]] = []
    original = RowFetcher.read

    def spy(self, rollout_id, merged, request_ids, *args, **kwargs):
        seen.append(list(request_ids))
        return original(self, rollout_id, merged, request_ids, *args, **kwargs)

    monkeypatch.setattr(RowFetcher, "read", spy)
    return seen


def test_matching_counts_return_the_rows_unchanged(reused):
    """Counts that match: the same rows as a read without the check, in every read form."""
    root, recs = reused
    with RoutingReader(root) as reader:
        expected = {"a": 20, "b": 9}
        got = reader.get_numpy("roll-0", ["b", "a"], expected_rows=expected)
        assert list(got) == ["b", "a"]
        for rid in ("a", "b"):
            np.testing.assert_array_equal(got[rid], recs[rid].ids_TLK)
        tensors = reader.get("roll-0", ["a", "b"], expected_rows=expected)
        np.testing.assert_array_equal(tensors["a"].numpy(), recs["a"].ids_TLK)
        packed = reader.get_packed("roll-0", ["a", "b"], expected_rows=expected)
        plain = reader.get_packed("roll-0", ["a", "b"])
        assert torch.equal(packed.ids_TLK, plain.ids_TLK) and torch.equal(packed.cu_seqlens, plain.cu_seqlens)
        assert packed.cu_seqlens.tolist() == [0, 20, 29]
        # A partial mapping checks the requests it names only.
        got = reader.get_numpy("roll-0", ["srv-1", "a"], expected_rows={"a": 20})
        assert got["srv-1"].shape[0] == 45


def test_reused_request_id_is_refused_before_reading(reused, reads):
    """The reported defect: 45 stored rows for a 7-token sample are refused, naming both counts."""
    root, _ = reused
    with RoutingReader(root) as reader:
        for call in (reader.get, reader.get_numpy, reader.get_packed):
            with pytest.raises(RowCountMismatchError) as info:
                call("roll-0", ["a", "srv-1"], expected_rows={"a": 20, "srv-1": 6})
            e = info.value
            text = str(e)
            assert "'roll-0'" in text and "'srv-1'" in text and "stores 45 routing rows" in text and "expects 6" in text
            assert "another request's routing stored under this id" in text and "commit that failed" in text
            assert (e.rollout_id, e.request_id, e.expected, e.stored) == ("roll-0", "srv-1", 6, 45)
            assert isinstance(e, R3Error) and isinstance(e, ValueError) and isinstance(e, ShapeMismatchError)
    assert reads == []  # refused from the index: no row was fetched


def test_several_mismatches_are_counted(reused):
    """The first request that differs is named, the others counted."""
    root, _ = reused
    with RoutingReader(root) as reader:
        with pytest.raises(
            RowCountMismatchError,
            match=r"'srv-1' stores 45 .*1 more of the 3 requests checked differ: 'b' \(stores 9, expected 8\)",
        ):
            reader.get_numpy("roll-0", ["srv-1", "a", "b"], expected_rows={"srv-1": 6, "a": 20, "b": 8})


def test_row_and_layer_selections_check_the_whole_length(reused, reads):
    """``rows=`` / ``layers=`` select what is read; ``expected_rows`` is the whole stored length."""
    root, recs = reused
    with RoutingReader(root) as reader:
        rows = {"a": [(2, 5), (10, 12)]}
        got = reader.get_numpy("roll-0", ["a"], rows=rows, layers=[2, 0], expected_rows={"a": 20})
        want = np.concatenate([recs["a"].ids_TLK[2:5], recs["a"].ids_TLK[10:12]])[:, [2, 0]]
        np.testing.assert_array_equal(got["a"], want)
        packed = reader.get_packed("roll-0", ["a"], rows=rows, layers=[1], expected_rows={"a": 20})
        assert packed.cu_seqlens.tolist() == [0, 5]
        reads.clear()
        # 5 rows selected: still the whole stored length (20) is what is checked.
        for call in (reader.get_numpy, reader.get_packed, reader.get):
            with pytest.raises(RowCountMismatchError, match="'a' stores 20 routing rows, the caller expects 5"):
                call("roll-0", ["a"], rows=rows, layers=[1], expected_rows={"a": 5})
        with pytest.raises(RowCountMismatchError, match="'srv-1' stores 45 routing rows, the caller expects 6"):
            reader.get_numpy("roll-0", ["srv-1"], rows={"srv-1": [(0, 6)]}, expected_rows={"srv-1": 6})
    assert reads == []


def test_bad_expected_rows_are_caller_errors(reused, reads):
    """Keys not read and counts that are not ints >= 0: ConfigError (a ValueError), nothing read."""
    root, _ = reused
    with RoutingReader(root) as reader:
        with pytest.raises(ConfigError, match=r"expected_rows names requests not read: \['b'\]") as info:
            reader.get_numpy("roll-0", ["a"], expected_rows={"a": 20, "b": 9})
        assert isinstance(info.value, ValueError)
        with pytest.raises(ValueError, match=r"expected_rows names requests not read: \['zz'\]"):
            reader.get_packed("roll-0", ["a"], expected_rows={"zz": 1})
        for bad in (-1, True, "20", 2.0):
            with pytest.raises(ConfigError, match=r"expected_rows\['a'\] must be an int >= 0"):
                reader.get("roll-0", ["a"], expected_rows={"a": bad})
        with pytest.raises(ConfigError, match="must map request ids"):
            reader.get_numpy("roll-0", ["a"], expected_rows=[("a", 20)])  # type: ignore[arg-type]
        assert reader.get_numpy("roll-0", ["a"], expected_rows={"a": np.int64(20)})["a"].shape[0] == 20
        # A request not committed stays an UnknownRequestError.
        with pytest.raises(UnknownRequestError, match="'nope'"):
            reader.get_numpy("roll-0", ["a", "nope"], expected_rows={"nope": 6})
    assert reads == [["a"]]  # the np.int64 count's read alone


def test_a_request_stored_from_a_later_row_is_refused():
    """Only later turns stored (rows 6..9): the count from row 0 is the expected 10, but rows
    0..5 have none (MissingRowsError); another end is a RowCountMismatchError."""
    late = SimpleNamespace(entry=lambda rid: RequestEntry(rows=4, start_row=6, segments=()))
    with pytest.raises(MissingRowsError, match=r"'late' is stored from row 6 on \(rows 6..9\): rows 0..5 of the 10 expected"):
        check_expected_rows("r", {"late": 10}, late)  # type: ignore[arg-type]
    with pytest.raises(
        RowCountMismatchError, match=r"'late' stores 4 routing rows \(rows 6..9, none for rows 0..5\), the caller expects 4"
    ):
        check_expected_rows("r", {"late": 4}, late)  # type: ignore[arg-type]
    whole = SimpleNamespace(entry=lambda rid: RequestEntry(rows=10, start_row=0, segments=()))
    check_expected_rows("r", {"x": 10}, whole)  # type: ignore[arg-type]


# -- the verl and slime hand-offs ---------------------------------------------------------------


def test_slime_refuses_a_wrong_request_before_reading(reused, reads):
    """slime passes len(tokens) - 1 per sample: a wrong request fails from the index."""
    root, recs = reused
    with RoutingReader(root) as reader:
        with pytest.raises(
            RowCountMismatchError, match=r"'srv-1' of rollout 'roll-0' has 45 routing rows; slime needs len\(tokens\) - 1 = 6"
        ) as info:
            slime_rollout_routed_experts(reader, "roll-0", ["a", "srv-1"], token_lens=[21, 7], num_layers=LAYERS)
        assert (info.value.request_id, info.value.expected, info.value.stored) == ("srv-1", 6, 45)
        assert isinstance(info.value.__cause__, RowCountMismatchError)  # the reader's, from its index
        with pytest.raises(RowCountMismatchError, match="'a' of rollout 'roll-0' has 20 routing rows"):
            slime_rollout_routed_experts(reader, "roll-0", ["a"], token_lens=[20], num_layers=LAYERS, layers=[1])
        assert reads == []
        got = slime_rollout_routed_experts(reader, "roll-0", ["a", "b"], token_lens=[21, 10], num_layers=LAYERS)
    np.testing.assert_array_equal(got[0], recs["a"].ids_TLK.astype(np.int32))
    np.testing.assert_array_equal(got[1], recs["b"].ids_TLK.astype(np.int32))


@pytest.mark.parametrize("fn", [verl_routed_experts, verl_routed_experts_unpadded])
def test_verl_refuses_a_wrong_request_before_reading(reused, reads, fn):
    """verl passes prompt + response - 1 where exact: a wrong request fails from the index."""
    root, recs = reused
    sizes = {"prompt_length": 8} if fn is verl_routed_experts else {}
    with RoutingReader(root) as reader:
        # The reused id: a 7-token sample (prompt 3, response 4) finds the old request's 45 rows.
        with pytest.raises(
            RowCountMismatchError,
            match=r"'srv-1' of rollout 'roll-0' has 45 routing rows, more than the prompt 3 \+ response 4 - 1 = 6",
        ) as info:
            fn(reader, "roll-0", ["b", "srv-1"], prompt_lens=[4, 3], response_lens=[6, 4], response_length=10, **sizes)
        assert (info.value.request_id, info.value.expected, info.value.stored) == ("srv-1", 6, 45)
        # Too few rows (no unrouted tail allowed): refused from the index as well.
        with pytest.raises(
            RowCountMismatchError, match="'b' of rollout 'roll-0' has 9 routing rows; prompt 4 \\+ response 7 tokens need 10"
        ):
            fn(reader, "roll-0", ["b"], prompt_lens=[4], response_lens=[7], response_length=10, **sizes)
        assert reads == []
        # Lengths that match: read and laid out as before.
        got = fn(reader, "roll-0", ["b"], prompt_lens=[4], response_lens=[6], response_length=10, **sizes)
    rows = torch.from_numpy(recs["b"].ids_TLK.astype(np.int16))
    if fn is verl_routed_experts:
        assert torch.equal(got[0, 4 : 4 + 9], rows) and not got[0, :4].any() and not got[0, 13:].any()
    else:
        assert torch.equal(got[0][:9], rows) and not got[0][9:].any()


def test_verl_bounds_only_samples_are_still_checked_on_the_rows_read(reused):
    """A response cut at response_length (more rows allowed) or an unrouted tail (fewer allowed)
    has no exact count: not passed as expected_rows, checked after the read as before."""
    root, _ = reused
    with RoutingReader(root) as reader:
        # b: 9 rows; prompt 4 + response 3 - 1 = 6 < 9, the response not cut (3 < 10), tail allowed.
        with pytest.raises(RowCountMismatchError, match="'b' of rollout 'roll-0' has 9 routing rows, more than"):
            verl_routed_experts_unpadded(
                reader, "roll-0", ["b"], prompt_lens=[4], response_lens=[3], response_length=10, allow_unrouted_tail=True
            )
        # Cut at response_length: verl keeps the first prompt + response_length rows.
        got = verl_routed_experts_unpadded(reader, "roll-0", ["a"], prompt_lens=[4], response_lens=[5], response_length=5)
        assert got[0].shape[0] == 9
