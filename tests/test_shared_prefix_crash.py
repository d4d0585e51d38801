"""SIGKILL at every commit point of batches holding shared-prefix records (issue #35): a GRPO
group in one batch (source, samples, a sample of a sample) and samples referencing requests of
an earlier commit. After the kill the batch is visible whole or not at all, everything
acknowledged reads back whole (CRC-32C checked), nothing is pending; a reopened store removes
what the kill left and resolves later references against what survived (refusing those whose
source did not, SharedRowsMissingError), and the killed batch commits again.

A child process commits one batch per commit and prints each acknowledged batch; ``kill_at``
makes it SIGKILL itself at one point of its ``nth`` commit (tests/test_index_snapshots.py does
the same for snapshots), or the parent kills it at a random moment ("random")."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from r3rdma.errors import SharedRowsMissingError
from r3rdma.read.reader import RoutingReader
from r3rdma.records import RequestRecord
from r3rdma.store.local_store import LocalRoutingStore
from r3rdma.testing.harness import _orphans, _pending, _visible, expected_rows, make_record, make_sample

ROLLOUT = "grpo-crash"


def _batch(k: int) -> list[RequestRecord]:
    """Commit ``k``'s records (the same in the child and here). Even: a GRPO group in one batch,
    the source first. Odd: samples of batch ``k - 1``'s requests, cuts inside segments of an
    earlier commit (their CRC-32C hashed from the stored rows)."""
    src = make_record(ROLLOUT, f"b{k}-src")
    if k % 2 == 0:
        cut = make_sample(ROLLOUT, src.request_id, 0, max(1, src.num_rows // 2))
        whole = make_sample(ROLLOUT, src.request_id, 1, src.num_rows)
        chained = make_sample(ROLLOUT, cut.request_id, 0, cut.end_row - 1)  # into cut's own segment
        return [src, cut, whole, chained, make_record(ROLLOUT, f"b{k}-plain")]
    prev = make_record(ROLLOUT, f"b{k - 1}-src")
    prev_cut = make_sample(ROLLOUT, prev.request_id, 0, max(1, prev.num_rows // 2))
    return [
        make_record(ROLLOUT, f"b{k}-plain"),
        make_sample(ROLLOUT, prev.request_id, 2, max(1, prev.num_rows - 3)),
        make_sample(ROLLOUT, prev_cut.request_id, 1, prev_cut.end_row - 2),  # prefix + part of its own rows
    ]


# The child runs _batch's own source (importing this module would cost it ~2 s: pytest, readers).
_CHILD = r"""
from __future__ import annotations
import os, signal, sys
from pathlib import Path
import r3rdma.store.layout as layout
import r3rdma.store.local_store as ls
from r3rdma.records import RequestRecord
from r3rdma.testing.harness import make_record, make_sample
ROLLOUT = {rollout!r}
{batch}
root, first, kill_at, nth = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
calls = {}

def due(point):
    calls[point] = calls.get(point, 0) + 1
    return kill_at == point and calls[point] == nth

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def entry_tmp(paths):  # the rollout's entry point being replaced (not the root's, nor a snapshot)
    return any(Path(p).name.startswith(".zarr.json.tmp") and Path(p).parent.name == ROLLOUT for p in paths)

write_array, write_json, fsync_paths, replace = ls.write_array, ls.write_json, layout.fsync_paths, os.replace
def write_array_hook(*a, **k):
    out = write_array(*a, **k)
    if due("array-written"):
        die()
    return out
def write_json_hook(path, document):
    write_json(path, document)
    if due("part-written"):
        die()
    if due("part-torn"):
        p = Path(path); p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
        die()
def fsync_hook(paths):
    if entry_tmp(paths) and due("entry-before-fsync"):
        p = Path(paths[0]); p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])  # torn, never synced
        die()
    fsync_paths(paths)
    if entry_tmp(paths) and due("entry-fsynced"):
        die()
def replace_hook(src, dst, *a, **k):
    replace(src, dst, *a, **k)
    if Path(dst).name == "zarr.json" and Path(dst).parent.name == ROLLOUT and due("entry-renamed"):
        die()  # before the directory's fsync: visible after a restart (no power loss here)
ls.write_array, ls.write_json, layout.fsync_paths, os.replace = write_array_hook, write_json_hook, fsync_hook, replace_hook
store = ls.LocalRoutingStore(root, snapshot_parts=10**6, snapshot_idle_s=3600)
for k in range(first, first + 400):
    store.commit(_batch(k))
    print(k, flush=True)
print("END", flush=True)
store.close()
"""


def _run_child(root: Path, first: int, kill_at: str, nth: int, kill_after_acks: int | None) -> list[int]:
    """Acknowledged batches of one child run (killed at ``kill_at`` of its ``nth`` commit)."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = _CHILD.replace("{rollout!r}", repr(ROLLOUT)).replace("{batch}", inspect.getsource(_batch))
    proc = subprocess.Popen(
        [sys.executable, "-c", child, str(root), str(first), kill_at, str(nth)], stdout=subprocess.PIPE, text=True, env=env
    )
    acked: list[int] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "END":
            break
        acked.append(int(line))
        if kill_after_acks is not None and len(acked) == kill_after_acks:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    return acked


def _read_whole(root: Path, request_ids: list[str]) -> None:
    """Every request reads back whole: a sample's source rows 0..P-1 then its own (CRC-32C checked)."""
    if not request_ids:
        return
    with RoutingReader(root) as reader:
        got = reader.get_numpy(ROLLOUT, request_ids)
    for rid in request_ids:
        np.testing.assert_array_equal(got[rid], expected_rows(ROLLOUT, rid), err_msg=rid)


# Where each kill point leaves the batch it interrupts: the entry point's rename is what
# publishes a commit, so everything before it leaves nothing visible, and after it all.
_OUTCOME = {
    "array-written": "none",
    "part-written": "none",
    "part-torn": "none",
    "entry-before-fsync": "none",
    "entry-fsynced": "none",
    "entry-renamed": "all",
    "random": "either",
}


@pytest.mark.parametrize("kill_at", list(_OUTCOME))
def test_sigkill_at_every_commit_point_of_shared_prefix_batches(tmp_path, kill_at):
    rng = np.random.default_rng(len(kill_at))
    acked: set[str] = set()  # acknowledged request ids, over every cycle
    # nth commit killed: the rollout's first (a GRPO group in one batch), then an odd one
    # (references into an earlier commit), then an even one (a group after other commits).
    for cycle, nth in enumerate((1, 4, 3)):
        first = 1000 * cycle
        kill_after = int(rng.integers(1, 12)) if kill_at == "random" else None
        got = _run_child(tmp_path, first, kill_at, nth, kill_after)
        killed = first + len(got)  # the batch in flight when the child died
        assert kill_at == "random" or killed == first + nth - 1, (got, nth)
        for k in got:
            acked |= {r.request_id for r in _batch(k)}
        # Before any writer reopens the root: the acknowledged batches whole, the killed one
        # whole or absent, nothing else, nothing pending.
        visible = set(_visible([tmp_path]).get(ROLLOUT, {}))
        in_flight = {r.request_id for r in _batch(killed)}
        assert acked <= visible
        assert visible - acked <= in_flight
        shown = in_flight & visible
        assert shown in (set(), in_flight), f"batch {killed} partly visible: {sorted(shown)}"
        assert _OUTCOME[kill_at] == "either" or (shown == in_flight) == (_OUTCOME[kill_at] == "all")
        assert _pending([tmp_path]) == 0
        _read_whole(tmp_path, sorted(visible))
        acked |= shown
        # A reopened store removes the kill's leftovers and resolves references against what
        # survived: a sample of each request of this cycle, refused where its source is absent.
        with LocalRoutingStore(tmp_path) as store:
            assert _orphans(tmp_path) == 0
            for k in range(first, killed + 1):
                for record in _batch(k):
                    rows = expected_rows(ROLLOUT, record.request_id).shape[0]
                    later = make_sample(ROLLOUT, record.request_id, 9, max(1, rows - 1))
                    if record.request_id in acked:
                        assert store.commit([later]).committed == 1
                        acked.add(later.request_id)
                    else:
                        with pytest.raises(SharedRowsMissingError, match=record.request_id):
                            store.commit([later])
            # The killed batch commits again: new, or duplicates of what the kill published.
            result = store.commit(_batch(killed))
            assert (result.committed, result.duplicates) == ((0, len(in_flight)) if shown else (len(in_flight), 0))
            acked |= in_flight
        assert set(_visible([tmp_path])[ROLLOUT]) == acked and _pending([tmp_path]) == 0
    _read_whole(tmp_path, sorted(acked))
