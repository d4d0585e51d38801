"""Index snapshots: parts merged off the commit path, named by the entry point; readers open a
rollout with one snapshot and the parts after it; SIGKILL at any point of a snapshot loses
nothing acknowledged and never shows a half-written index."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from r3rdma.read.reader import RoutingReader
from r3rdma.records import checksum
from r3rdma.store.local_store import LocalRoutingStore
from r3rdma.testing.harness import make_record

ROLLOUT = "snap-0"


def _entry(root: Path) -> dict:
    return json.loads((root / ROLLOUT / "zarr.json").read_bytes())["attributes"]["r3rdma"]


def _snapshots(root: Path) -> list[str]:
    return sorted(p.name for p in (root / ROLLOUT).iterdir() if p.name.startswith("s0"))


def _wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_snapshots_follow_commits_and_fresh_readers_open_from_them(tmp_path):
    records = [make_record(ROLLOUT, f"r{i}", rows=4 + i % 7) for i in range(40)]
    with LocalRoutingStore(tmp_path, snapshot_parts=8, snapshot_idle_s=0.1) as store:
        with RoutingReader(tmp_path) as early:
            store.commit(records[:2])
            assert sorted(early.info(ROLLOUT).request_ids) == ["r0", "r1"]  # cached parts 1..2, no snapshot
            for i in range(2, 40, 2):
                store.commit(records[i : i + 2])
            _wait_for(lambda: _entry(tmp_path).get("snapshot") == 20)  # idle: parts 1..20 merged
            # A reader holding parts 1..2 takes the snapshot instead of parts 3..20.
            got = early.get_numpy(ROLLOUT, [r.request_id for r in records])
        assert all(checksum(got[r.request_id]) == checksum(r.ids_TLK) for r in records)
        assert len(_snapshots(tmp_path)) <= 2  # older ones removed, the previous one kept for readers
        # A fresh reader needs no part the snapshot covers: remove them and read everything.
        for seq in range(1, 21):
            for f in (tmp_path / ROLLOUT / f"i{seq:08d}").iterdir():
                f.unlink()
            (tmp_path / ROLLOUT / f"i{seq:08d}").rmdir()
        with RoutingReader(tmp_path) as fresh:
            assert len(fresh.info(ROLLOUT).request_ids) == 40
            store.commit([make_record(ROLLOUT, "after")])  # part 21, after the snapshot
            assert "after" in fresh.info(ROLLOUT).request_ids
    # The writer reopens from the snapshot too, and keeps committing.
    with LocalRoutingStore(tmp_path) as store:
        store.commit([make_record(ROLLOUT, "reopened")])
    with RoutingReader(tmp_path) as reader:
        assert len(reader.info(ROLLOUT).request_ids) == 42


def test_snapshot_during_commits_and_deletes(tmp_path):
    with LocalRoutingStore(tmp_path, snapshot_parts=1, snapshot_idle_s=0.01) as store:
        for i in range(30):
            store.commit([make_record(ROLLOUT, f"r{i}")])
        store.delete_rollout(ROLLOUT)
        time.sleep(0.1)
        assert not (tmp_path / ROLLOUT).exists()  # a snapshot in flight did not bring it back
        store.commit([make_record(ROLLOUT, "new")])
    with RoutingReader(tmp_path) as reader:
        assert reader.info(ROLLOUT).request_ids == ("new",)


def test_bad_snapshot_settings_are_refused(tmp_path):
    from r3rdma.errors import ConfigError

    with pytest.raises(ConfigError, match="snapshot_parts must be an int >= 1, got 0"):
        LocalRoutingStore(tmp_path, snapshot_parts=0)
    with pytest.raises(ConfigError, match="snapshot_idle_s"):
        LocalRoutingStore(tmp_path, snapshot_idle_s=-1)


# -- SIGKILL ------------------------------------------------------------------------------------

# The child commits one request per commit (snapshot after every part) and prints each
# acknowledged id; ``kill_at`` makes it SIGKILL itself at one point of a snapshot, or never
# ("random": the parent kills it at a random moment).
_CHILD = r"""
import os, shutil, signal, sys
from pathlib import Path
import store.local_store as ls
import r3rdma.store.snapshots as snapshots  # where the snapshot thread writes and fsyncs
from r3rdma.testing.harness import make_record
root, first, kill_at, nth = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
calls = {"n": 0}

def is_snapshot(paths):
    return any(Path(p).name.startswith("s0") or Path(p).parent.name.startswith("s0") for p in paths)

def due():
    calls["n"] += 1
    return calls["n"] == nth

def die():
    os.kill(os.getpid(), signal.SIGKILL)

fsync_paths, rmtree = snapshots.fsync_paths, shutil.rmtree
def fsync_hook(paths):
    if is_snapshot(paths) and kill_at == "before-fsync" and due():
        p = Path(paths[0]); p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])  # torn
        die()
    fsync_paths(paths)
    if is_snapshot(paths) and kill_at == "after-fsync" and due():
        die()
def rmtree_hook(path, *a, **k):
    if Path(path).name.startswith("s0") and kill_at == "pruning" and due():
        die()
    rmtree(path, *a, **k)
snapshots.fsync_paths = fsync_hook
ls.shutil.rmtree = rmtree_hook
store = ls.LocalRoutingStore(root, snapshot_parts=1, snapshot_idle_s=0.005)
for i in range(first, first + 400):
    store.commit([make_record("snap-0", f"r{i}")])
    print(f"r{i}", flush=True)
print("END", flush=True)
store.close()
"""


def _run_child(root: Path, first: int, kill_at: str, nth: int, kill_after_acks: int | None) -> list[str]:
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(root), str(first), kill_at, str(nth)],
                            stdout=subprocess.PIPE, text=True, env=env)
    acked = []
    for line in proc.stdout:
        if line.strip() == "END":
            break
        acked.append(line.strip())
        if kill_after_acks is not None and len(acked) == kill_after_acks:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    return acked


@pytest.mark.parametrize("kill_at,nth", [("before-fsync", 3), ("after-fsync", 5), ("pruning", 2), ("random", 0)])
def test_sigkill_during_snapshots_loses_nothing_acknowledged(tmp_path, kill_at, nth):
    rng = np.random.default_rng(nth)
    acked: list[str] = []
    for cycle in range(3):
        kill_after = int(rng.integers(5, 60)) if kill_at == "random" else None
        got = _run_child(tmp_path, 1000 * cycle, kill_at, nth + cycle, kill_after)
        assert kill_at == "random" or len(got) < 400, "the kill point was never reached"
        acked += got
        # Before any writer reopens the root: a reader sees every acknowledged request, whole.
        with RoutingReader(tmp_path) as reader:
            visible = set(reader.info(ROLLOUT).request_ids)
            assert set(acked) <= visible
            stored = reader.get_numpy(ROLLOUT, acked)
        for rid in acked:
            assert checksum(stored[rid]) == checksum(make_record(ROLLOUT, rid).ids_TLK), rid
    # Reopening removes every snapshot the entry point does not name.
    with LocalRoutingStore(tmp_path, snapshot_idle_s=60):
        named = _entry(tmp_path).get("snapshot")
        assert _snapshots(tmp_path) == ([f"s{named:08d}"] if named else [])


def test_column_requests_behave_as_the_entries_they_encode():
    """A snapshot's requests stay columns (ColumnRequests) and read as the dict of entries they
    were encoded from: lookups, iteration order, updates from later parts (which a copy does not
    see), deletion, equality, rows without building entries, JSON through as_format_1."""
    from r3rdma.store.index_entries import RequestEntry, Segment
    from r3rdma.store.rollout_index import ColumnRequests, RolloutIndex, decode_requests, encode_requests

    arrays = ["b00000001", "b00000002"]
    entries = {}
    for i in range(6):
        segments = tuple(Segment(arrays[j % 2], 10 * i + j, 1 + (j == 0) * (2 + i), i % 2 + (0 if j == 0 else 3 + i),
                                 (i * 7919 + j) % (1 << 32)) for j in range(1 + i % 2))
        entries[f"r{i}"] = RequestEntry(sum(s.rows for s in segments), i % 2, segments)  # its segments hold its rows
    cols = json.loads(json.dumps(encode_requests(entries, arrays)))
    req = decode_requests(cols, arrays, "roll", "here", "snapshot")
    assert isinstance(req, ColumnRequests) and len(req) == 6 and list(req) == list(entries)
    assert req == entries and dict(req.items()) == entries and all(req.rows(r) == entries[r].rows for r in entries)
    assert "r9" not in req and req.get("r9") is None and req.keys() & {"r1", "r9"} == {"r1"}
    before = req.copy()
    replaced = RequestEntry(1, 0, (Segment(arrays[1], 0, 1, 0, 5),))
    req.update({"r2": replaced, "r6": replaced})
    del req["r0"]
    assert req["r2"] == replaced and req.rows("r6") == 1 and "r0" not in req and list(req)[-1] == "r6"
    assert before == entries  # the copy kept the snapshot's view
    index = RolloutIndex(uid="u", geometry={}, requests=req, arrays=arrays)
    assert json.loads(json.dumps(index.as_format_1()))["requests"]["r2"] == {
        "rows": 1, "start_row": 0, "segments": [{"array": arrays[1], "offset": 0, "rows": 1, "start_row": 0, "crc32c": 5}]}
    assert encode_requests(req, arrays) == encode_requests({k: req[k] for k in req}, arrays)
