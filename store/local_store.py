"""The embedded store: commits batches of finished requests to a Zarr v3 root on local disk.

One writer owns a root (an exclusive ``flock`` on ``<root>/.r3rdma.lock`` refuses a second);
any number of readers may read it concurrently, and see a request only once its batch is
committed (see :mod:`r3rdma.store.layout` for the format and the commit protocol).

Segments: a request may arrive in several records (later turns of a conversation, the prefill
and decode engines of a disaggregated deployment). Records that do not yet complete their
request are stored durably but listed under the index's ``pending`` key, which readers
ignore; the request becomes visible, in one atomic index replace, once its segments cover
every row of its span exactly once (docs/ENGINE_SEMANTICS.md states the rules).
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from r3rdma.errors import (
    ConfigError,
    InvalidIdError,
    R3Error,
    SegmentError,
    SegmentGapError,
    SegmentOverlapError,
    ShapeMismatchError,
    StoreError,
    UnknownRequestError,
    UnknownRolloutError,
)
from r3rdma.ids import validate_id
from r3rdma.records import RequestRecord
from r3rdma.store.layout import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_KEY,
    array_name,
    fsync_dir,
    fsync_paths,
    tree_paths,
    group_document,
    parse_array_name,
    read_group_attrs,
    write_json,
    write_json_atomic,
)
from r3rdma.store.shard_writer import write_batch_array, zarr_codecs
from r3rdma.store.rollout_index import (
    GEOMETRY_KEYS,
    RolloutIndex,
    check_entry,
    load_index,
    new_uid,
    parse_part_name,
    parse_snapshot_name,
    part_name,
    read_file,
    snapshot_name,
)

__all__ = ["LocalRoutingStore", "CommitResult", "zarr_codecs", "check_rollout_dir_name"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a commit did: records newly stored, records already stored with the same bytes.

    ``pending``: requests of this batch still incomplete after it (parts held invisible until
    their other segments arrive).
    """

    committed: int
    duplicates: int
    bytes_written: int
    pending: int = 0


class LocalRoutingStore:
    """Writer of one store root. Thread-safe; ``commit`` returns once the data is durable."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        zstd_level: int = 3,
        chunk_rows: int = 1024,
        min_chunk_rows: int = 64,
        only_last_turn: bool = False,
        snapshot_parts: int = 64,
        snapshot_idle_s: float = 0.25,
    ) -> None:
        """``only_last_turn`` (FastDeploy's key): a request keeps only the rows of its latest
        turn's full view; a complete record set that starts where the stored request starts and
        ends beyond it *replaces* it (without it, such a record is a conflict and refused).

        ``chunk_rows`` / ``min_chunk_rows``: a batch array's inner chunks hold the power of two
        at or above its median request length, clamped to this range (:meth:`_batch_chunk_rows`).

        ``snapshot_parts`` / ``snapshot_idle_s``: a background thread merges a rollout's index
        parts into a snapshot (:mod:`r3rdma.store.rollout_index`, "Snapshots") once
        ``snapshot_parts`` parts follow the last one, or once the rollout has had no commit for
        ``snapshot_idle_s`` seconds (its rollout has ended: the moment fresh readers open it)
        and ``snapshot_parts // 8`` (at least 2) parts follow the last one."""
        if isinstance(snapshot_parts, bool) or not isinstance(snapshot_parts, int) or snapshot_parts < 1:
            raise ConfigError(f"snapshot_parts must be an int >= 1, got {snapshot_parts!r}")
        if isinstance(snapshot_idle_s, bool) or not isinstance(snapshot_idle_s, (int, float)) or not snapshot_idle_s > 0:
            raise ConfigError(f"snapshot_idle_s must be a number of seconds > 0, got {snapshot_idle_s!r}")
        self.root = Path(root)
        self.snapshot_parts = snapshot_parts
        self.snapshot_idle_s = float(snapshot_idle_s)
        self._last_commit: dict[str, float] = {}  # rollout -> time.monotonic() of its last part
        self._snapshot_wake = threading.Event()
        self._snapshotter: threading.Thread | None = None
        self._closing = False
        self.only_last_turn = only_last_turn
        self.zstd_level = zstd_level
        self.chunk_rows = chunk_rows
        self.min_chunk_rows = min(min_chunk_rows, chunk_rows)
        self._lock = threading.Lock()
        self._indexes: dict[str, dict[str, Any]] = {}
        # Commits written but not yet durable, published in order by one thread (_publish_loop).
        self._published = threading.Condition()
        self._to_publish: collections.deque[_Publish] = collections.deque()
        self._publisher: threading.Thread | None = None
        self._broken: BaseException | None = None  # a publish failed: in-memory indexes are ahead of the disk
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.root / ".r3rdma.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreError(f"cannot open store root {self.root}: {e}") from e
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(self._lock_fd)
            raise StoreError(f"store root {self.root} is owned by another writer process (lock held)") from e
        try:
            self._check_format()
            self._recover()
        except BaseException:
            self.close()
            raise

    def _check_format(self) -> None:
        """Write the root's format marker, or refuse a root of another format version.

        A format-1 root (one index document per rollout, rewritten by every commit) is read by
        :class:`~r3rdma.read.reader.RoutingReader` but not appended to: its rollouts would need
        their index rewritten in format 2. An empty format-1 root is simply marked format 2.
        """
        try:
            attrs = read_group_attrs(self.root / "zarr.json")
        except ValueError as e:
            raise StoreError(f"store root {self.root}: zarr.json is not JSON: {e}") from e
        marker = (attrs or {}).get(INDEX_KEY) or {}
        version = marker.get("format_version", FORMAT_VERSION) if isinstance(marker, dict) else None
        if attrs is not None and version != FORMAT_VERSION:
            if self.rollouts():
                raise StoreError(
                    f"store root {self.root} holds r3rdma format version {version!r}; this r3rdma writes format "
                    f"version {FORMAT_VERSION} (an index that grows by parts). RoutingReader still reads it: start the "
                    "store on a new root, or delete its rollouts (r3rdma delete) before writing here"
                )
        if attrs is None or version != FORMAT_VERSION:
            write_json_atomic(
                self.root / "zarr.json",
                group_document({INDEX_KEY: {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}}),
            )

    def _recover(self) -> None:
        """Remove every trace of commits a crash interrupted (this process now owns the root).

        A commit writes its batch array and index part, then replaces the rollout's entry
        point; a crash before that leaves an array and a part the entry point does not count,
        which readers never see (a rollout's first commit leaves no entry point at all: the
        array and part are written without a parent group document, so nothing lists the
        rollout meanwhile). Left alone, a plain Zarr listing would show them and the next
        commit would reuse their names. So, on opening: arrays and parts numbered above the
        entry point's count are deleted, index temp files too, a bare group ``zarr.json``
        without an index, and a rollout directory left empty. Anything else (files r3rdma did
        not write) is left in place. Costs one directory listing per rollout.
        """
        for child in self.root.iterdir():
            try:
                check_rollout_dir_name(child.name)
            except InvalidIdError:
                continue
            if not child.is_dir():
                continue
            index_path = child / "zarr.json"
            try:
                attrs = read_group_attrs(index_path)
            except ValueError:  # a bare group document zarr wrote in place, torn by the crash
                attrs = {}
            entry = check_entry(child.name, attrs, str(self.root)) if attrs else None
            if entry is not None and entry.get("format_version", 1) != 2:
                continue  # not this format's (refused by _check_format unless the root says otherwise)
            if entry is None and attrs is not None:
                index_path.unlink()  # a bare parent group zarr wrote before the array
            self._remove_orphans(child, entry["parts"] if entry is not None else 0,
                                 entry.get("snapshot", 0) if entry is not None else 0)
            for tmp in child.glob("**/.zarr.json.tmp-*"):
                tmp.unlink(missing_ok=True)
            if entry is None:
                try:
                    child.rmdir()  # only when nothing else is left
                except OSError:
                    pass
                else:
                    fsync_dir(self.root)

    # -- public API -------------------------------------------------------------------------

    def commit_async(self, records: Sequence[RequestRecord]) -> Future:
        """Write ``records`` (any mix of rollouts; all or nothing per rollout) and return a
        future of the :class:`CommitResult` that resolves once they are durable and visible.

        Why a future: a commit's flush to disk (its array, index part and entry point fsynced,
        ~20-30% of a commit on the VM's and the GPU hosts' disks) runs on a publisher thread while the caller
        writes the next batch; batches are published in the order they were written. Refusals
        of the data (below) raise here, before anything is written. If a flush fails, that
        commit's future and those of every commit written after it (planned on top of it)
        raise :class:`StoreError`; none of them becomes visible, and the next call starts
        again from what is on disk.

        A record without rows (or with 0 layers / top-k) refuses the whole batch before
        anything is written (:class:`ShapeMismatchError` naming the request): storing it would
        make its rollout unreadable, and refusing all of it keeps the rule simple for a caller,
        which retries the other records (a :class:`~r3rdma.write.writer.RoutingWriter` does so
        record by record).

        A request already committed with the same bytes is skipped (retries are idempotent);
        with different bytes it raises :class:`DuplicateRequestError`. A record whose
        ``start_row`` continues a committed request exactly where it ends is appended to it as a
        new segment (a later turn of a multi-turn conversation).
        """
        by_rollout: dict[str, list[RequestRecord]] = {}
        for record in records:
            # Before anything is written: one record without rows refuses the whole batch (zarr
            # cannot open a batch array of 0 rows, so storing it would break every read of its
            # rollout). The engine learns the bad request's id and may push the others again.
            ids = getattr(record, "ids_TLK", None)
            if not isinstance(ids, np.ndarray) or ids.ndim != 3 or 0 in ids.shape:
                raise ShapeMismatchError(
                    f"request {record.request_id!r} of rollout {record.rollout_id!r}: expected rows of shape "
                    f"[rows >= 1, layers >= 1, top_k >= 1], got {getattr(ids, 'shape', None)}; nothing of this "
                    f"batch of {len(records)} records was stored"
                )
            by_rollout.setdefault(record.rollout_id, []).append(record)
        for rollout_id in by_rollout:
            check_rollout_dir_name(rollout_id)
        with self._lock:
            self._settle()
            publishes: list[_Publish] = []
            try:
                for rollout_id, group in by_rollout.items():
                    publishes.append(self._write_rollout(rollout_id, group))
            except BaseException:
                # Rollouts of this batch written before the refusal are stored, as they would
                # be one by one: made durable before the error reaches the caller.
                for item in publishes:
                    self._enqueue(item)
                for item in publishes:
                    item.done.exception()
                raise
            for item in publishes:
                self._enqueue(item)
        return _combined(publishes)

    def commit(self, records: Sequence[RequestRecord]) -> CommitResult:
        """:meth:`commit_async` and wait: returns once ``records`` are durable."""
        return self.commit_async(records).result()

    def pending(self, rollout_id: str) -> dict[str, tuple[tuple[int, int, bool], ...]]:
        """Incomplete requests of a rollout: ``(start_row, end_row, final)`` of each stored part."""
        check_rollout_dir_name(rollout_id)
        with self._lock:
            self._settle(drain=True)
            index = self._index(rollout_id)
            return {
                rid: tuple((seg["start_row"], seg["start_row"] + seg["rows"], seg["final"]) for seg in segs)
                for rid, segs in index.pending.items()
            }

    def require_complete(self, rollout_id: str) -> None:
        """Raise :class:`SegmentGapError` if any request of the rollout is still incomplete.

        Call when no more segments can arrive (the rollout's engines are done): a request
        whose prefill part was stored but whose decode never pushed is an error then.
        """
        pending = self.pending(rollout_id)
        if pending:
            shown = "; ".join(
                f"{rid!r} has rows " + ", ".join(f"{a}..{b - 1}" + (" (final)" if f else "") for a, b, f in parts)
                for rid, parts in list(pending.items())[:5]
            )
            raise SegmentGapError(
                f"rollout {rollout_id!r}: {len(pending)} requests are incomplete (segments do not cover every row): {shown}"
            )

    def discard_pending(self, rollout_id: str, request_id: str) -> None:
        """Forget the stored parts of an incomplete request (e.g. its decode was aborted)."""
        check_rollout_dir_name(rollout_id)
        validate_id(request_id, "request_id")
        with self._lock:
            self._settle(drain=True)
            index = self._index(rollout_id)
            if request_id not in index.pending:
                raise UnknownRequestError(f"rollout {rollout_id!r} has no pending request {request_id!r}")
            item = self._write_part(rollout_id, index, {"arrays": [], "requests": {}, "pending": {request_id: []}})
            self._enqueue(item)
        item.done.result()

    def delete_rollout(self, rollout_id: str) -> None:
        """Remove a rollout: its index first (readers stop seeing it at once), then its arrays."""
        check_rollout_dir_name(rollout_id)
        with self._lock:
            self._settle(drain=True)
            self._delete_locked(rollout_id)

    def rollouts(self) -> dict[str, float]:
        """Rollouts of this root and the time (``time.time()``) of each one's last commit."""
        out = {}
        for child in self.root.iterdir():
            try:
                check_rollout_dir_name(child.name)
                out[child.name] = (child / "zarr.json").stat().st_mtime
            except (InvalidIdError, FileNotFoundError, NotADirectoryError):
                continue  # the root's own files, or a directory without an index
        return out

    def delete_older_than(self, age_s: float, *, now: float | None = None) -> list[str]:
        """Delete every rollout whose last commit is more than ``age_s`` seconds old; return their ids.

        Age counts from the rollout's last commit (its index's mtime), so a rollout still
        being written is never deleted under its writer.
        """
        if not age_s >= 0:
            raise ConfigError(f"age_s must be a number >= 0, got {age_s!r}")
        cutoff = (time.time() if now is None else now) - age_s
        deleted = []
        with self._lock:
            self._settle(drain=True)
            for rollout_id, mtime in sorted(self.rollouts().items()):
                if mtime < cutoff:
                    try:
                        self._delete_locked(rollout_id)
                    except UnknownRolloutError:
                        continue
                    deleted.append(rollout_id)
        return deleted

    def _delete_locked(self, rollout_id: str) -> None:
        path = self.root / rollout_id
        if not (path / "zarr.json").exists():
            raise UnknownRolloutError(f"rollout {rollout_id!r} not found under {self.root}")
        try:
            os.unlink(path / "zarr.json")
            # Durable before the arrays go: a crash now leaves arrays no index points at, which
            # readers never see and the next commit to this id removes as orphans.
            fsync_dir(path)
        except OSError as e:
            raise StoreError(f"deleting the index of rollout {rollout_id!r} failed: {e}") from e
        self._indexes.pop(rollout_id, None)
        self._last_commit.pop(rollout_id, None)
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Wait for commits still being published, then release the root."""
        self._closing = True
        self._snapshot_wake.set()
        snapshotter, self._snapshotter = self._snapshotter, None
        if snapshotter is not None and snapshotter is not threading.current_thread():
            snapshotter.join()
        with self._published:
            while self._to_publish:
                self._published.wait()
            publisher, self._publisher = self._publisher, None
            self._published.notify_all()
        if publisher is not None:
            publisher.join()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def __enter__(self) -> "LocalRoutingStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _enqueue(self, item: "_Publish") -> None:
        with self._published:
            if self._publisher is None:
                self._publisher = threading.Thread(target=self._publish_loop, name="r3rdma-publish", daemon=True)
                self._publisher.start()
            self._to_publish.append(item)
            self._published.notify_all()

    def _publish_loop(self) -> None:
        """Make each written commit durable and visible, in order (see :meth:`commit_async`)."""
        me = threading.current_thread()
        while True:
            with self._published:
                while not self._to_publish and self._publisher is me:
                    self._published.wait()
                if not self._to_publish:
                    return
                item = self._to_publish[0]
                broken = self._broken
            if broken is not None:
                item.fail(StoreError(f"rollout {item.rollout_id!r}: not stored, an earlier commit written before it "
                                     f"failed to reach the disk: {broken}"))
            else:
                try:
                    item.publish()
                except BaseException as e:
                    with self._published:
                        self._broken = e
                    item.fail(e)
            with self._published:
                self._to_publish.popleft()
                self._published.notify_all()

    def _settle(self, drain: bool = False) -> None:
        """Under ``self._lock``: after a failed publish, wait until nothing is in flight and
        forget the in-memory indexes (ahead of the disk; :meth:`_index` reloads them and
        removes the arrays and parts the failed commits left). ``drain``: also wait for every
        commit in flight (before a delete, or answering what is pending)."""
        with self._published:
            if not (drain or self._broken is not None):
                return
            while self._to_publish:
                self._published.wait()
            if self._broken is not None:
                self._indexes.clear()
                self._broken = None

    def _index(self, rollout_id: str) -> RolloutIndex:
        index = self._indexes.get(rollout_id)
        if index is None:
            path = self.root / rollout_id
            try:
                index = load_index(rollout_id, read_file(path), str(self.root))
            except R3Error as e:
                raise StoreError(f"the index of rollout {rollout_id!r} under {self.root} cannot be read: {e}") from e
            if index is None:
                index = RolloutIndex(uid=new_uid())
            self._remove_orphans(path, index.parts, index.snapshot)
            self._indexes[rollout_id] = index
        return index

    @staticmethod
    def _remove_orphans(path: Path, parts: int, snapshot: int) -> None:
        # Arrays and parts numbered above the entry point's count are leftovers of a crash
        # before its replace; only this writer (it holds the root lock) creates them, so they
        # are safe to drop, and the next commit reuses their numbers. Snapshots other than the
        # one the entry point names: a crash's, or older ones (a reader that read an older
        # entry point and finds its snapshot gone reads the entry point again).
        if not path.is_dir():
            return
        for child in path.iterdir():
            seq = parse_array_name(child.name) or parse_part_name(child.name)
            old_snapshot = parse_snapshot_name(child.name)
            if (seq is not None and seq > parts) or (old_snapshot is not None and old_snapshot != snapshot):
                shutil.rmtree(child, ignore_errors=True)

    def _write_part(self, rollout_id: str, index: RolloutIndex, changes: dict[str, Any],
                    new_paths: Sequence[Path] = ()) -> "_Publish":
        """Write ``changes`` as the next index part and apply it to the in-memory index; return
        what publishes it (:class:`_Publish`: everything fsynced at once, then the entry point).

        ``new_paths``: what this commit wrote that the part names (a batch array's files and
        directories), not yet durable. On a failure here nothing changed for readers and the
        part's directory is removed.
        """
        seq = index.parts + 1
        part = {"part": seq, "uid": index.uid, **changes}
        path = self.root / rollout_id
        part_dir = path / part_name(seq)
        try:
            part_dir.mkdir(parents=True, exist_ok=True)
            # No temp file: nothing names the part until the entry point counts it, and opening
            # the root removes a part numbered past that count (a crash's, torn or not).
            write_json(part_dir / "zarr.json", group_document({INDEX_KEY: part}))
        except OSError as e:
            shutil.rmtree(part_dir, ignore_errors=True)
            raise StoreError(f"committing index part {seq} of rollout {rollout_id!r} failed: {e}") from e
        index.apply(part)
        self._note_commit(rollout_id, index)
        # The rollout directory holds the new entries (array, part); the root holds the
        # rollout directory's own entry, new with the rollout's first part.
        durable = [*new_paths, part_dir / "zarr.json", part_dir, path] + ([self.root] if seq == 1 else [])
        return _Publish(rollout_id, seq, path / "zarr.json", group_document({INDEX_KEY: index.entry_document()}),
                        durable)

    # -- index snapshots (rollout_index.py, "Snapshots") --------------------------------------

    def _note_commit(self, rollout_id: str, index: RolloutIndex) -> None:
        """Under ``self._lock``: a part was added; wake the snapshot thread if enough piled up."""
        self._last_commit[rollout_id] = time.monotonic()
        if self._snapshotter is None and not self._closing:
            self._snapshotter = threading.Thread(target=self._snapshot_loop, name="r3rdma-snapshot", daemon=True)
            self._snapshotter.start()
        if index.parts - index.snapshot >= self.snapshot_parts:
            self._snapshot_wake.set()

    def _snapshot_loop(self) -> None:
        """Snapshot rollouts whose parts piled up, or that went idle (a finished rollout)."""
        while not self._closing:
            self._snapshot_wake.wait(self.snapshot_idle_s)
            self._snapshot_wake.clear()
            if self._closing:
                return
            now = time.monotonic()
            # Idle: a few parts suffice (a fresh reader then fetches the snapshot and at most
            # that many parts), but not one: a rollout trickling one commit per pause would
            # rewrite its whole index after every commit.
            idle_parts = max(2, self.snapshot_parts // 8)
            with self._lock:
                due = [rid for rid, index in self._indexes.items()
                       if index.parts - index.snapshot >= self.snapshot_parts
                       or (index.parts - index.snapshot >= idle_parts
                           and now - self._last_commit.get(rid, 0.0) >= self.snapshot_idle_s)]
            for rollout_id in due:
                if self._closing:
                    return
                try:
                    self._snapshot(rollout_id)
                except Exception as e:  # the parts still hold the index: readers lose nothing
                    _log.warning("snapshot of the index of rollout %r failed: %s", rollout_id, e)

    def _snapshot(self, rollout_id: str) -> None:
        """Write the rollout's index as a snapshot and name it in the entry point.

        Off the commit path: the merge, its JSON and its fsync run on this thread with the lock
        released (commits go on meanwhile and land in later parts); only the entry point's
        replace goes through the publisher, in order after the commits the snapshot covers.
        """
        with self._lock:
            index = self._indexes.get(rollout_id)
            if index is None or index.parts <= index.snapshot or index.version != 2:
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
            item = _Publish(rollout_id, index.parts, path / "zarr.json",
                            group_document({INDEX_KEY: index.entry_document()}), [path])
            self._enqueue(item)
        item.done.result()
        # Keep the snapshot the previous entry point named: a reader may be fetching it now.
        for child in path.iterdir() if path.is_dir() else []:
            older = parse_snapshot_name(child.name)
            if older is not None and older < previous:
                shutil.rmtree(child, ignore_errors=True)

    def _write_rollout(self, rollout_id: str, records: list[RequestRecord]) -> "_Publish":
        index = self._index(rollout_id)
        geometry = _geometry(records[0])
        if index.geometry and index.geometry != geometry:
            raise ShapeMismatchError(
                f"rollout {rollout_id!r} stores routing with {index.geometry}; request "
                f"{records[0].request_id!r} arrived with {geometry}"
            )
        name = array_name(index.parts + 1)
        # Records are applied in order to an overlay of the index (a batch may hold several
        # segments of one request: a prefill part and its decode, two turns); nothing is
        # written unless every record of the batch is accepted. The overlay holds only what
        # this batch changes, so a commit costs O(batch) however large the rollout.
        state = _Assembly(rollout_id, index.requests, index.pending, self.only_last_turn)
        new: list[tuple[int, RequestRecord]] = []
        duplicates = 0
        end = 0
        chunk = self._batch_chunk_rows(records)
        for record in records:
            if _geometry(record) != geometry:
                raise ShapeMismatchError(
                    f"request {record.request_id!r} has geometry {_geometry(record)}, "
                    f"but {records[0].request_id!r} in the same batch has {geometry}"
                )
            offset = self._aligned(end, record.num_rows, chunk)
            if state.add(record, name, offset):
                new.append((offset, record))
                end = offset + record.num_rows
            else:
                duplicates += 1
        if not new:
            return _Publish.nothing(rollout_id, duplicates)
        if end == sum(r.num_rows for _, r in new):
            data = np.concatenate([r.ids_TLK for _, r in new]) if len(new) > 1 else new[0][1].ids_TLK
        else:
            data = np.zeros((end, *new[0][1].ids_TLK.shape[1:]), dtype=new[0][1].ids_TLK.dtype)  # gaps: fill value
            for offset, r in new:
                data[offset : offset + r.num_rows] = r.ids_TLK
        rollout_path = self.root / rollout_id
        try:
            shards, written = self._write_array(rollout_path, name, data, chunk)
        except R3Error:
            raise
        except OSError as e:
            shutil.rmtree(rollout_path / name, ignore_errors=True)
            raise StoreError(f"writing {len(new)} requests ({data.nbytes} bytes) to {rollout_path / name} failed: {e}") from e
        if not index.geometry:
            index.geometry = geometry
        try:
            item = self._write_part(rollout_id, index, {"arrays": [name], "shards": {name: shards},
                                                        "requests": state.requests, "pending": state.pending}, written)
        except StoreError:
            shutil.rmtree(rollout_path / name, ignore_errors=True)
            if index.parts == 0:
                index.geometry = {}
            raise
        still_pending = len({r.request_id for _, r in new} & set(index.pending))
        item.counts = (len(new), duplicates, sum(r.nbytes for _, r in new), still_pending)
        return item

    def _batch_chunk_rows(self, records: list[RequestRecord]) -> int:
        """Rows per inner chunk of a batch's array: the power of two at or above the batch's
        median request length, from ``min_chunk_rows`` (64) up to ``chunk_rows`` (1024).

        Why: a reader decodes whole chunks, and a data-parallel rank's requests sit between
        other ranks' requests. With 1024-row chunks, short requests (~100 rows) shared a chunk
        with ~8 others, so a rank decoded ~8x the rows it asked for, and scattered reads of
        short requests ran at 0.33-0.49 of a contiguous read. A chunk about one request long
        holds one or two of them (:meth:`_aligned` starts a request that does not fit at the
        next chunk). Each batch array states its own chunk shape; readers need nothing new.
        """
        lengths = sorted(r.num_rows for r in records)
        median = lengths[len(lengths) // 2]
        return max(self.min_chunk_rows, min(self.chunk_rows, 1 << max(0, (median - 1).bit_length())))

    def _aligned(self, end: int, rows: int, chunk_rows: int) -> int:
        """Where a request of ``rows`` rows goes in a batch array whose rows so far end at ``end``.

        A request that does not fit in what is left of the current chunk starts at the next
        chunk boundary (the rows skipped hold the fill value, belong to no request, and
        compress to almost nothing). Why: a reader fetches and decodes whole chunks, and a
        data-parallel rank reads requests whose neighbours belong to other ranks. Packed back
        to back, a request of 500-3000 rows straddled chunks it shared with its neighbours and
        a rank's share cost ~1.5x its bytes on the wire and in zstd (measured: 1.51x at 1024-row
        chunks); aligned, it touches ceil(rows / chunk_rows) chunks of its own. Requests that
        fit in a chunk's remainder still share it, so short requests add no padding.
        """
        room = -end % chunk_rows
        return end + room if rows > room > 0 else end

    def _write_array(self, rollout_path: Path, name: str, data: np.ndarray, chunk_rows: int) -> tuple[dict[str, Any], list[Path]]:
        """Write a batch array (:mod:`r3rdma.store.shard_writer`: zarr's bytes, chunks
        compressed in parallel); return its shard layout for the index part and the files and
        directories written (fsynced with the part, :meth:`_write_part`)."""
        rows = data.shape[0]
        rollout_path.mkdir(parents=True, exist_ok=True)
        # The array's own store, not the rollout's with name=: zarr would first write a bare
        # group zarr.json for the parent, and a crash before the index rename would leave a
        # rollout that lists but has no index.
        places = write_batch_array(rollout_path / name, data, chunk_rows=chunk_rows, zstd_level=self.zstd_level)
        # The shard's chunk index, copied into the index part: a reader of a few requests from
        # every array (a data-parallel rank's share) then needs one ranged GET per request,
        # not two more per array (its zarr.json and shard index). zarr.json stays the truth.
        # Every chunk is written (placement, :meth:`_aligned`, leaves less than a chunk of
        # fill rows between requests, so no chunk is all fill value).
        chunk = max(1, min(chunk_rows, rows))
        return {"rows": rows, "chunk_rows": chunk, "zstd": self.zstd_level > 0, "chunks": places}, tree_paths(rollout_path / name)


@dataclass(eq=False)
class _Publish:
    """One rollout's commit, written and applied to the in-memory index: :meth:`publish` makes
    it durable (``durable`` and the entry point's temp file fsynced at once) and visible (the
    entry point renamed into place). ``done`` resolves to its counts."""

    rollout_id: str
    seq: int
    entry: Path | None
    document: dict[str, Any] | None
    durable: list[Path]
    counts: tuple[int, int, int, int] = (0, 0, 0, 0)  # committed, duplicates, bytes, pending
    done: Future = field(default_factory=Future)

    @classmethod
    def nothing(cls, rollout_id: str, duplicates: int) -> "_Publish":
        """A batch of duplicates only: durable once the commits before it are."""
        return cls(rollout_id, 0, None, None, [], (0, duplicates, 0, 0))

    def publish(self) -> None:
        if self.entry is not None:
            try:
                write_json_atomic(self.entry, self.document, sync_with=self.durable)
            except OSError as e:
                raise StoreError(f"committing index part {self.seq} of rollout {self.rollout_id!r} failed: {e}") from e
        self.done.set_result(self.counts)

    def fail(self, error: BaseException) -> None:
        self.done.set_exception(error)


def _combined(items: list[_Publish]) -> Future:
    """A future of the :class:`CommitResult` of ``items``: their counts summed once all are
    durable, or the first error (in the batch's order) if any failed."""
    out: Future = Future()
    left = [len(items)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [item.done.exception() for item in items if item.done.exception() is not None]
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result(CommitResult(*(sum(c) for c in zip(*(item.done.result() for item in items)))))

    if not items:
        out.set_result(CommitResult(0, 0, 0, 0))
    for item in items:
        item.done.add_done_callback(one_done)
    return out


def check_rollout_dir_name(rollout_id: str) -> str:
    """Validate ``rollout_id`` and refuse ids that collide with the root's own files.

    A rollout id is a directory under the root: a valid id starting with ``.`` (``.r3rdma.lock``,
    an index temp file) or named ``zarr.json`` would write into the store's own files (seen as
    a NotADirectoryError that reached clients as an internal error), and hidden names are never
    served over HTTP, so such data could not be read back.
    """
    validate_id(rollout_id, "rollout_id")
    if rollout_id.startswith(".") or rollout_id == "zarr.json":
        raise InvalidIdError(
            f"rollout_id {rollout_id!r} is reserved: rollout ids must not start with '.' or be 'zarr.json'"
        )
    return rollout_id


def _geometry(record: RequestRecord) -> dict[str, Any]:
    geometry = {
        "num_layers": len(record.layer_map),
        "top_k": record.top_k,
        "num_experts": record.num_experts,
        "dtype": record.ids_TLK.dtype.name,
        "layer_map": list(record.layer_map),
    }
    assert tuple(geometry) == GEOMETRY_KEYS
    return geometry


class _Assembly:
    """Applies records to a rollout's ``requests`` (visible) and ``pending`` (incomplete) maps.

    Rules (docs/ENGINE_SEMANTICS.md): a record identical to a stored segment is a duplicate;
    rows a record shares with another segment of its request are a conflict
    (:class:`SegmentOverlapError`); a request becomes visible once a final segment exists and
    its segments tile the span ``[start, end)`` exactly, where ``end`` is the final segment's
    end and ``start`` is ``end - total_rows`` when declared, else the end of the rows already
    visible (a continuation), else row 0.

    Several final segments are several turns of a conversation; they become visible turn by
    turn, in row order, each once the rows before it are visible. A request is never made
    visible from a row other than 0 (a later turn that arrived first waits, pending, for the
    earlier turns instead of becoming visible with only its rows, which would then refuse
    them); a later turn that leaves a gap after the visible rows waits for the gap likewise.
    Two finals whose declared spans share rows conflict (:class:`SegmentOverlapError`).
    """

    def __init__(self, rollout_id: str, requests: dict[str, Any], pending: dict[str, list[dict[str, Any]]],
                 only_last_turn: bool) -> None:
        self.rollout_id = rollout_id
        self.only_last_turn = only_last_turn
        self._in_batch: set[str] = set()
        # What this batch changes, over the stored maps (read, never written here): the new
        # whole entry of each request it makes visible or extends, and the new pending list
        # of each request whose pending parts change ([] once none are left).
        self._stored_requests = requests
        self._stored_pending = pending
        self.requests: dict[str, Any] = {}
        self.pending: dict[str, list[dict[str, Any]]] = {}

    def add(self, record: RequestRecord, array: str, offset: int) -> bool:
        """Apply one record; False if it duplicates a stored segment. Raises on conflicts."""
        rid = record.request_id
        entry = self.requests.get(rid) or self._stored_requests.get(rid)
        parts = list(self.pending[rid] if rid in self.pending else self._stored_pending.get(rid, []))
        known = (entry["segments"] if entry else []) + parts
        if any(_same(seg, record) for seg in known):
            return False
        where = f"request {rid!r} of rollout {self.rollout_id!r}"
        desc = f"start_row {record.start_row}, {record.num_rows} rows, crc32c {record.crc32c:#010x}"
        in_batch = rid in self._in_batch
        self._in_batch.add(rid)
        start, end = record.start_row, record.end_row
        if entry is not None:
            cs = entry["start_row"]
            ce = cs + entry["rows"]
            if start < ce and end > cs and not self.only_last_turn:
                raise SegmentOverlapError(
                    f"{where} " + ("appears twice in one batch with different rows" if in_batch else "is already stored")
                    + f" (rows {cs}..{ce - 1}, crc32c {entry['segments'][-1]['crc32c']:#010x}); a record with different "
                    f"bytes arrived ({desc}); only start_row {ce} would extend it"
                )
            if end <= cs and not self.only_last_turn:
                raise SegmentError(
                    f"{where} is visible from row {cs}; rows before it cannot be added ({desc}): push a request's "
                    "earlier segments first, or declare total_rows on its final segment"
                )
        for seg in parts:
            a, b = seg["start_row"], seg["start_row"] + seg["rows"]
            if start < b and end > a:
                raise SegmentOverlapError(
                    f"{where}: a record ({desc}) overlaps its pending segment rows {a}..{b - 1} with different bytes"
                )
        if record.final:
            # Several finals are several turns of one conversation (a later turn may arrive
            # first); they conflict when the spans they declare share rows.
            lo = start if record.total_rows is None else end - record.total_rows
            for f in (x for x in parts if x["final"]):
                f_end = f["start_row"] + f["rows"]
                f_lo = f["start_row"] if f["total_rows"] is None else f_end - f["total_rows"]
                if lo < f_end and f_lo < end:
                    raise SegmentOverlapError(
                        f"{where}: two final segments, rows ending at {f_end - 1} (pending) and at "
                        f"{end - 1} ({desc}), declare spans {f_lo}..{f_end - 1} and {lo}..{end - 1} that overlap"
                    )
        seg = {
            "array": array,
            "offset": offset,
            "rows": record.num_rows,
            "start_row": start,
            "crc32c": record.crc32c,
            "final": record.final,
            "total_rows": record.total_rows,
        }
        group = sorted(parts + [seg], key=lambda x: x["start_row"])
        finals = [x for x in group if x["final"]]
        if finals:
            last = max(x["start_row"] + x["rows"] for x in finals)
            beyond = [x for x in group if x["start_row"] + x["rows"] > last]
            if beyond:
                x = beyond[0]
                raise SegmentOverlapError(
                    f"{where}: segment rows {x['start_row']}..{x['start_row'] + x['rows'] - 1} extend past the request's "
                    f"last row {last - 1} (declared by its final segment)"
                )
        # Promote turn by turn: the earliest-ending final and the segments before it become
        # visible once they tile its span from where the visible rows end (row 0 for a request
        # not visible yet). A later turn that arrived first waits, pending, for the earlier ones.
        while True:
            final = min((x for x in group if x["final"]), key=lambda x: x["start_row"], default=None)
            if final is None:
                break
            last = final["start_row"] + final["rows"]
            sub = [x for x in group if x["start_row"] < last]
            lowest = sub[0]["start_row"]
            if final["total_rows"] is not None:
                first = last - final["total_rows"]
            elif entry is not None and lowest >= entry["start_row"] + entry["rows"]:
                first = entry["start_row"] + entry["rows"]
            elif entry is not None:
                first = lowest
            else:
                first = 0  # a request's rows start at row 0: wait for earlier turns
            if lowest < first:
                raise SegmentOverlapError(
                    f"{where}: segment rows from {lowest} lie before row {first}, where its final segment "
                    f"(total_rows {final['total_rows']}) says the request starts"
                )
            mode = "new"
            if entry is not None:
                cs = entry["start_row"]
                ce = cs + entry["rows"]
                if first == ce:
                    mode = "extend"
                elif self.only_last_turn and first == cs and last > ce:
                    mode = "replace"
                elif first < ce:
                    raise SegmentOverlapError(
                        f"{where} is already stored (rows {cs}..{ce - 1}); segments ending at row {last - 1} would cover "
                        f"rows {first}..{ce - 1} again; only start_row {ce} would extend it"
                        + ("" if not self.only_last_turn else f", or a later turn's full view starting at row {cs}")
                    )
                else:
                    break  # rows ce..first-1 (an earlier turn) have not arrived yet: pending
            elif first > 0:
                break  # rows 0..first-1 (earlier turns) have not arrived yet: pending
            covered = first
            for x in sub:
                if x["start_row"] != covered:
                    break
                covered += x["rows"]
            if covered != last:
                break  # a gap another part may still fill
            segments = [{k: x[k] for k in ("array", "offset", "rows", "start_row", "crc32c")} for x in sub]
            if mode == "extend":
                entry = {"rows": entry["rows"] + last - first, "start_row": entry["start_row"],
                         "segments": entry["segments"] + segments}
            else:
                entry = {"rows": last - first, "start_row": first, "segments": segments}
            self.requests[rid] = entry
            group = group[len(sub):]
        if group or rid in self._stored_pending:
            self.pending[rid] = group
        else:
            self.pending.pop(rid, None)
        return True


def _same(seg: dict[str, Any], record: RequestRecord) -> bool:
    return seg["start_row"] == record.start_row and seg["rows"] == record.num_rows and seg["crc32c"] == record.crc32c
