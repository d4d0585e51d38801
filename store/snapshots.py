"""Index snapshots of the writer's rollouts, merged on a background thread (rollout_index.py,
"Snapshots"): once enough parts pile up, or once a rollout goes idle (its rollout has ended:
the moment fresh readers open it)."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

from r3rdma.store.layout import INDEX_KEY, fsync_paths, group_document, write_json
from r3rdma.store.publishing import Publish, Publisher
from r3rdma.store.rollout_index import RolloutIndex, parse_snapshot_name, snapshot_name

__all__ = ["Snapshotter"]

_log = logging.getLogger(__name__)
_MAX_RETRY_S = 60.0  # the longest wait before a failed snapshot is tried again


class Snapshotter:
    """Snapshots the rollouts of one writer's ``indexes`` (its in-memory indexes, guarded by
    its ``lock``); the entry point naming a snapshot goes through the writer's ``publisher``,
    in order after the commits the snapshot covers.

    ``parts`` / ``idle_s``: a rollout is snapshotted once ``parts`` parts follow its last
    snapshot, or once it has had no commit for ``idle_s`` seconds and ``parts // 8`` (at least
    2) parts follow it."""

    def __init__(
        self, root: Path, lock: threading.Lock, indexes: dict[str, RolloutIndex], publisher: Publisher, parts: int, idle_s: float
    ) -> None:
        self.root = root
        self.parts = parts
        self.idle_s = idle_s
        self._lock = lock
        self._indexes = indexes
        self._publisher = publisher
        self._last_commit: dict[str, float] = {}  # rollout -> time.monotonic() of its last part
        # rollout -> (failures in a row, time.monotonic() before which it is not tried again):
        # a snapshot that keeps failing (a full disk) is retried less and less often, instead
        # of a warning every idle_s.
        self._failing: dict[str, tuple[int, float]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = False

    def note_commit(self, rollout_id: str, index: RolloutIndex) -> None:
        """Under the writer's lock: a part was added; wake the thread if enough piled up."""
        self._last_commit[rollout_id] = time.monotonic()
        if self._thread is None and not self._closing:
            self._thread = threading.Thread(target=self._loop, name="r3rdma-snapshot", daemon=True)
            self._thread.start()
        if index.parts - index.snapshot >= self.parts:
            self._wake.set()

    def forget(self, rollout_id: str) -> None:
        """Under the writer's lock: the rollout was deleted."""
        self._last_commit.pop(rollout_id, None)
        self._failing.pop(rollout_id, None)

    def close(self) -> None:
        """Stop snapshotting: wake the thread and wait for it to finish the snapshot it is writing
        (unless called from that thread)."""
        self._closing = True
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _loop(self) -> None:
        """Snapshot rollouts whose parts piled up, or that went idle (a finished rollout)."""
        while not self._closing:
            self._wake.wait(self.idle_s)
            self._wake.clear()
            if self._closing:
                return
            now = time.monotonic()
            # Idle: a few parts suffice (a fresh reader then fetches the snapshot and at most
            # that many parts), but not one: a rollout trickling one commit per pause would
            # rewrite its whole index after every commit.
            idle_parts = max(2, self.parts // 8)
            with self._lock:
                due = [
                    rid
                    for rid, index in self._indexes.items()
                    if (
                        index.parts - index.snapshot >= self.parts
                        or (index.parts - index.snapshot >= idle_parts and now - self._last_commit.get(rid, 0.0) >= self.idle_s)
                    )
                    and self._failing.get(rid, (0, 0.0))[1] <= now
                ]
            for rollout_id in due:
                if self._closing:
                    return
                try:
                    self._snapshot(rollout_id)
                    self._failing.pop(rollout_id, None)
                except Exception as e:  # the parts still hold the index: readers lose nothing
                    failures = self._failing.get(rollout_id, (0, 0.0))[0] + 1
                    delay = min(_MAX_RETRY_S, self.idle_s * 2**failures)
                    self._failing[rollout_id] = (failures, time.monotonic() + delay)
                    _log.warning(
                        "snapshot of the index of rollout %r failed (%d in a row; next try in %.1f s): %s",
                        rollout_id,
                        failures,
                        delay,
                        e,
                    )

    def _snapshot(self, rollout_id: str) -> None:
        """Write the rollout's index as a snapshot and name it in the entry point.

        Off the commit path: the merge, its JSON and its fsync run on this thread with the lock
        released (commits go on meanwhile and land in later parts); only the entry point's
        replace goes through the publisher, in order after the commits the snapshot covers.
        """
        with self._lock:
            index = self._indexes.get(rollout_id)
            # Format 1 is one whole document: no parts to merge.
            if index is None or index.parts <= index.snapshot or index.version < 2:
                return
            frozen = index.copy()  # O(requests) dict copies; the encoding runs with the lock released
        document = frozen.snapshot_document()
        seq = document["snapshot"]
        path = self.root / rollout_id
        snap_dir = path / snapshot_name(seq)
        try:
            snap_dir.mkdir(exist_ok=True)  # not parents: a rollout deleted meanwhile stays deleted
            write_json(snap_dir / "zarr.json", group_document({INDEX_KEY: document}))
            fsync_paths([snap_dir / "zarr.json", snap_dir])
        except FileNotFoundError:
            shutil.rmtree(snap_dir, ignore_errors=True)
            return
        except OSError:
            shutil.rmtree(snap_dir, ignore_errors=True)
            raise
        with self._lock:
            if self._indexes.get(rollout_id) is not index or index.snapshot >= seq:
                # Deleted, reloaded after a failed publish, or snapshotted meanwhile.
                shutil.rmtree(snap_dir, ignore_errors=True)
                return
            previous, index.snapshot = index.snapshot, seq
            # The rollout directory's new entry (the snapshot's) is made durable with the entry point.
            item = Publish(
                rollout_id, index.parts, (path / "zarr.json", group_document({INDEX_KEY: index.entry_document()})), [path]
            )
            self._publisher.enqueue(item)
        item.done.result()
        # Keep the snapshot the previous entry point named: a reader may be fetching it now.
        for child in path.iterdir() if path.is_dir() else []:
            older = parse_snapshot_name(child.name)
            if older is not None and older < previous:
                shutil.rmtree(child, ignore_errors=True)
