"""Reads shaped like training, and an index whose commits cost O(batch) (format 2).

- commits write one immutable index part and a constant-size entry point, however large the
  rollout; a reader fetches only the parts it has not seen;
- a data-parallel rank's scattered share comes back bit-exact, in the asked order, from one
  call that plans every range first; ``prefetch`` yields micro-batches in order;
- bad id lists (100k names, repeats, unknown ids) fail with a clear error and no partial result;
- a reader refreshing while commits land sees only whole requests.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from r3rdma import RoutingReader, UnknownRequestError
from r3rdma.errors import CorruptDataError, InvalidIdError
from r3rdma.errors import ConfigError
from r3rdma.store.local_store import LocalRoutingStore


def _commit(root, make_record, n, batch, *, rows=lambda i: 3 + i % 17):
    recs = [make_record(f"q{i:05d}", rows=rows(i)) for i in range(n)]
    with LocalRoutingStore(root, chunk_rows=8) as store:
        for b in range(0, n, batch):
            store.commit(recs[b : b + batch])
    return recs


def test_commit_writes_a_part_and_an_entry_point_of_constant_size(tmp_path, make_record):
    recs = [make_record(f"q{i:04d}", rows=4) for i in range(400)]
    sizes = []
    # No snapshot (its name in the entry point would add bytes): commits alone are measured here.
    with LocalRoutingStore(tmp_path, snapshot_parts=10**6, snapshot_idle_s=3600) as store:
        for b in range(0, 400, 4):
            store.commit(recs[b : b + 4])
            sizes.append(((tmp_path / "roll-0" / "zarr.json").stat().st_size,
                          (tmp_path / "roll-0" / f"i{b // 4 + 1:08d}" / "zarr.json").stat().st_size))
    entry_sizes = {s for s, _ in sizes}
    assert max(entry_sizes) - min(entry_sizes) <= 2  # the part count grows by digits only
    assert max(p for _, p in sizes) <= 1.1 * min(p for _, p in sizes)  # each part lists its batch only
    entry = json.loads((tmp_path / "roll-0" / "zarr.json").read_text())["attributes"]["r3rdma"]
    assert entry["parts"] == 100 and entry["format_version"] == 4 and "requests" not in entry


def test_reader_fetches_only_new_parts(tmp_path, make_record):
    recs = _commit(tmp_path, make_record, 40, 4)
    reader = RoutingReader(tmp_path)
    assert len(reader.info("roll-0").request_ids) == 40
    fetched = []
    store = reader._sources[0].store
    original = store.get

    async def counting_get(key, *args, **kwargs):
        fetched.append(key)
        return await original(key, *args, **kwargs)

    store.get = counting_get
    more = [make_record(f"z{i}", rows=5) for i in range(6)]
    with LocalRoutingStore(tmp_path, chunk_rows=8) as writer:
        writer.commit(more[:3])
        writer.commit(more[3:])
    got = reader.get_numpy("roll-0", ["z5", "q00001"])
    index_keys = [k for k in fetched if k.endswith("zarr.json") and "/b" not in k]
    assert sorted(index_keys) == ["roll-0/i00000011/zarr.json", "roll-0/i00000012/zarr.json", "roll-0/zarr.json"]
    np.testing.assert_array_equal(got["z5"], more[5].ids_TLK)
    np.testing.assert_array_equal(got["q00001"], recs[1].ids_TLK)


def test_scattered_share_is_bit_exact_in_the_asked_order(tmp_path, make_record):
    recs = _commit(tmp_path, make_record, 300, 7)
    ranks = 8
    with RoutingReader(tmp_path) as reader:
        for rank in range(ranks):
            share = [recs[i] for i in range(rank, 300, ranks)][::-1]  # any order
            packed = reader.get_packed("roll-0", [r.request_id for r in share])
            want = np.concatenate([r.ids_TLK for r in share])
            assert torch.equal(packed.ids_TLK, torch.from_numpy(want))
            assert packed.cu_seqlens.tolist() == np.concatenate([[0], np.cumsum([r.num_rows for r in share])]).tolist()


def test_prefetch_yields_micro_batches_in_order(tmp_path, make_record):
    recs = _commit(tmp_path, make_record, 90, 5)
    batches = [[recs[i].request_id for i in range(j, 90, 9)] for j in range(9)]
    with RoutingReader(tmp_path) as reader:
        with reader.prefetch("roll-0", batches, depth=2) as it:
            assert len(it) == 9
            got = list(it)
        assert [p.request_ids for p in got] == [tuple(b) for b in batches]
        for packed, batch in zip(got, batches):
            want = np.concatenate([recs[int(rid[1:])].ids_TLK for rid in batch])
            assert torch.equal(packed.ids_TLK, torch.from_numpy(want))
        # Stopping early is fine; later batches are dropped.
        it = reader.prefetch("roll-0", batches, depth=3)
        assert next(it).request_ids == tuple(batches[0])
        it.close()
        with pytest.raises(StopIteration):
            next(it)
        with pytest.raises(ConfigError, match="depth"):
            reader.prefetch("roll-0", batches, depth=0)


def test_prefetch_loads_depth_batches_at_once_and_still_yields_in_order(tmp_path, make_record, monkeypatch):
    """A scattered micro-batch waits on its slowest GET: one load at a time left the readers
    idle. Each load here waits until ``depth`` loads are under way (a barrier): loads one after
    another would break it. Batches still come out in the asked order."""
    recs = _commit(tmp_path, make_record, 40, 5)
    batches = [[recs[i].request_id for i in range(j, 40, 8)] for j in range(8)]
    reader = RoutingReader(tmp_path)
    together = threading.Barrier(2, timeout=20)
    plain = reader.get_packed
    calls = []

    def meet_first_two(rollout_id, ids):
        calls.append(ids)
        if len(calls) <= 2:
            together.wait()  # both of the first two loads are running
        return plain(rollout_id, ids)

    monkeypatch.setattr(reader, "get_packed", meet_first_two)
    with reader.prefetch("roll-0", batches, depth=2) as it:
        got = [p.request_ids for p in it]
    assert got == [tuple(b) for b in batches]
    reader.close()


def test_bad_id_lists_fail_clearly_with_no_partial_result(tmp_path, make_record):
    recs = _commit(tmp_path, make_record, 50, 10)
    ids = [r.request_id for r in recs]
    with RoutingReader(tmp_path) as reader:
        huge = [f"n{i}" for i in range(100_000)]
        with pytest.raises(UnknownRequestError, match=r"'n0', 'n1', 'n2', 'n3', 'n4' and 99995 more \(100000 of the 100000") as info:
            reader.get_packed("roll-0", huge)
        assert len(str(info.value)) < 600  # says how many, names a few
        with pytest.raises(InvalidIdError, match=r"repeat: 'q00003' x2.*nothing was read"):
            reader.get_packed("roll-0", ids[:5] + ["q00003"])
        with pytest.raises(InvalidIdError, match="repeat"):
            reader.get_numpy("roll-0", ["q00001", "q00001"])
        with pytest.raises(UnknownRequestError, match=r"'nope'.*1 of the 3"):
            reader.get_packed("roll-0", ["q00001", "nope", "q00002"])
        with pytest.raises(InvalidIdError, match="one string"):
            reader.get_packed("roll-0", "q00001")
        # The whole prefetch plan is checked before anything is read or yielded.
        with pytest.raises(UnknownRequestError, match="'nope'"):
            reader.prefetch("roll-0", [ids[:3], ids[3:6] + ["nope"]])
        with pytest.raises(InvalidIdError, match="repeat"):
            reader.prefetch("roll-0", [ids[:3] + ids[:1]])


def test_reader_refreshing_while_commits_land_sees_only_whole_requests(tmp_path, make_record):
    """A reader re-reading the index while a writer commits: every request it sees is whole
    and bit-exact, and it sees all of them at the end."""
    recs = [make_record(f"q{i:04d}", rows=2 + i % 29) for i in range(600)]
    first = recs[:6]
    with LocalRoutingStore(tmp_path, chunk_rows=8) as store:
        store.commit(first)
    done = threading.Event()
    errors: list[BaseException] = []

    def write():
        try:
            with LocalRoutingStore(tmp_path, chunk_rows=8) as store:
                for b in range(6, 600, 6):
                    store.commit(recs[b : b + 6])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            done.set()

    writer = threading.Thread(target=write)
    writer.start()
    seen_counts = []
    with RoutingReader(tmp_path) as reader:
        while True:
            finished = done.is_set()
            visible = reader.info("roll-0").request_ids
            seen_counts.append(len(visible))
            sample = list(visible[-12:])
            got = reader.get_numpy("roll-0", sample)
            for rid in sample:
                np.testing.assert_array_equal(got[rid], recs[int(rid[1:])].ids_TLK)
            if finished:
                break
    writer.join()
    assert not errors
    assert seen_counts[-1] == 600 and seen_counts == sorted(seen_counts)


def test_two_writers_to_one_root_refuse_each_other(tmp_path):
    from r3rdma.errors import StoreError

    with LocalRoutingStore(tmp_path):
        with pytest.raises(StoreError, match="another writer"):
            LocalRoutingStore(tmp_path)


@pytest.mark.gpu
def test_prefetch_pins_memory_for_non_blocking_copies(tmp_path, make_record):
    recs = _commit(tmp_path, make_record, 20, 5)
    batches = [[r.request_id for r in recs[i : i + 4]] for i in range(0, 20, 4)]
    with RoutingReader(tmp_path) as reader, reader.prefetch("roll-0", batches, pin_memory=True) as it:
        for packed, batch in zip(it, batches):
            assert packed.ids_TLK.is_pinned()
            on_gpu = packed.ids_TLK.to("cuda", non_blocking=True)
            want = np.concatenate([recs[int(rid[1:])].ids_TLK for rid in batch])
            assert torch.equal(on_gpu.cpu(), torch.from_numpy(want))


@pytest.mark.parametrize("another_writer", [False, True])
def test_a_rollout_deleted_and_created_again_is_read_afresh(tmp_path, make_record, another_writer):
    """Same rollout id, same array names, new rows: a reader that cached the old index parts,
    chunk places and shard indexes reads the new rollout, not a mix (the entry point's uid
    changed). ``another_writer``: arrays without chunk places in the index (read via zarr.json
    and the shard index, which the reader also caches)."""
    old = [make_record(f"q{i}", rows=20 + i, seed=i) for i in range(4)]
    new = [make_record(f"q{i}", rows=20 + i, seed=100 + i) for i in range(4)]

    def commit(records):
        with LocalRoutingStore(tmp_path, chunk_rows=8) as store:
            store.commit(records)
        if another_writer:
            path = tmp_path / "roll-0" / "i00000001" / "zarr.json"
            doc = json.loads(path.read_text())
            del doc["attributes"]["r3rdma"]["shards"]
            path.write_text(json.dumps(doc))

    commit(old)
    with RoutingReader(tmp_path) as reader:
        np.testing.assert_array_equal(reader.get_numpy("roll-0", ["q1"])["q1"], old[1].ids_TLK)
        with LocalRoutingStore(tmp_path) as store:
            store.delete_rollout("roll-0")
        commit(new)
        reader.info("roll-0")  # refresh: the uid changed
        got = reader.get_numpy("roll-0", ["q1", "q3"])
        np.testing.assert_array_equal(got["q1"], new[1].ids_TLK)
        np.testing.assert_array_equal(got["q3"], new[3].ids_TLK)


def _zero_records():
    from r3rdma.records import RequestRecord

    zeros = RequestRecord("roll-0", "z", np.zeros((40, 3, 2), np.uint8), (0, 1, 2), 16)
    part = np.zeros((40, 3, 2), np.uint8)
    part[30:] = 5  # chunks of rows 0..23 all zero
    return zeros, RequestRecord("roll-0", "m", part, (0, 1, 2), 16)


def test_all_zero_rows_read_back(tmp_path):
    """Every chunk is written, all-zero ones too (the store skips zarr's empty-chunk scan)."""
    zeros, mixed = _zero_records()
    with LocalRoutingStore(tmp_path, chunk_rows=8) as store:
        store.commit([zeros])
        store.commit([mixed])
    for name in ("b00000001", "b00000002"):
        part = json.loads((tmp_path / "roll-0" / f"i0000000{name[-1]}" / "zarr.json").read_text())
        from r3rdma.store.index_entries import chunk_sizes_of

        assert chunk_sizes_of(part["attributes"]["r3rdma"]["shards"][name]).min() > 0
    with RoutingReader(tmp_path) as reader:
        got = reader.get_numpy("roll-0", ["z", "m"])
    np.testing.assert_array_equal(got["z"], zeros.ids_TLK)
    np.testing.assert_array_equal(got["m"], mixed.ids_TLK)


def test_chunks_left_out_by_earlier_stores_read_back(tmp_path):
    """Stores written before 18d897c (2026-11-23) let zarr leave all-zero chunks out of a shard (index
    places -1, -1) and wrote no shard file when every row was 0: both still read back."""
    import shutil

    import zarr
    from zarr.storage import LocalStore

    from r3rdma.store.local_store import zarr_codecs

    zeros, mixed = _zero_records()
    with LocalRoutingStore(tmp_path, chunk_rows=8) as store:
        store.commit([zeros])
        store.commit([mixed])
    # Rewrite both arrays as zarr's defaults write them, and their index parts' chunk places.
    for seq, record in ((1, zeros), (2, mixed)):
        name, part_path = f"b0000000{seq}", tmp_path / "roll-0" / f"i0000000{seq}" / "zarr.json"
        shutil.rmtree(tmp_path / "roll-0" / name)
        zarr.create_array(LocalStore(tmp_path / "roll-0" / name), data=record.ids_TLK, chunks=(8, 3, 2),
                          shards={"shape": (40, 3, 2), "index_location": "start"}, fill_value=0,
                          compressors=zarr_codecs(3), dimension_names=("token", "layer", "k"))
        shard = tmp_path / "roll-0" / name / "c" / "0" / "0" / "0"
        places = np.frombuffer(shard.read_bytes()[: 16 * 5], "<u8").astype(np.int64).tolist() if shard.exists() else [-1] * 10
        doc = json.loads(part_path.read_text())
        shard_doc = doc["attributes"]["r3rdma"]["shards"][name]
        del shard_doc["chunk_sizes"], shard_doc["layers_per_chunk"]  # as format 2 wrote it
        shard_doc["chunks"] = places
        part_path.write_text(json.dumps(doc))
    assert not (tmp_path / "roll-0" / "b00000001" / "c").exists()
    assert doc["attributes"]["r3rdma"]["shards"]["b00000002"]["chunks"][:6] == [-1] * 6  # chunks 0..2 left out
    with RoutingReader(tmp_path) as reader:
        got = reader.get_numpy("roll-0", ["z", "m"])
    np.testing.assert_array_equal(got["z"], zeros.ids_TLK)
    np.testing.assert_array_equal(got["m"], mixed.ids_TLK)


def test_replicas_that_disagree_fail_the_read_of_that_request_naming_both(tmp_path, make_record):
    """Copies are compared when read (not on index open: that cost ~40% of a fresh open at 16k
    requests): the disagreeing request fails naming both roots, the others read fine."""
    a, b = tmp_path / "a", tmp_path / "b"
    with LocalRoutingStore(a) as store:
        store.commit([make_record("same", rows=5, seed=1), make_record("twin", rows=5, seed=2)])
    with LocalRoutingStore(b) as store:
        store.commit([make_record("same", rows=5, seed=1), make_record("twin", rows=5, seed=3)])
    with RoutingReader([a, b]) as reader:
        assert sorted(reader.info("roll-0").request_ids) == ["same", "twin"]
        assert reader.get_numpy("roll-0", ["same"])["same"].shape[0] == 5
        with pytest.raises(CorruptDataError, match=rf"'twin'.*different rows on {a}.*and {b}"):
            reader.get_numpy("roll-0", ["twin"])
