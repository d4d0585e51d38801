"""The embedded store: commits batches of finished requests to a Zarr v3 root on local disk.

One writer owns a root (an exclusive ``flock`` on ``<root>/.r3rdma.lock`` refuses a second);
any number of readers may read it concurrently, and see a request only once its batch is
committed (see :mod:`r3rdma.store.layout` for the format and the commit protocol).

A commit is: its batch array encoded (:mod:`r3rdma.store.batch_array`: compressed, before the
writer's lock, as if every record were new), then under the lock its records applied to the
rollout's index (:mod:`r3rdma.store.assembly`: segments, pending requests, duplicates), its
batch array and index part written, then made durable and visible in order on a publisher
thread (:mod:`r3rdma.store.publishing`). Index snapshots are merged in the background
(:mod:`r3rdma.store.snapshots`); opening a root removes what crashed commits left
(:mod:`r3rdma.store.recovery`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from r3rdma.errors import (
    ConfigError,
    InvalidIdError,
    R3Error,
    SegmentGapError,
    ShapeMismatchError,
    StoreError,
    UnknownRequestError,
    UnknownRolloutError,
)
from r3rdma.ids import validate_id
from r3rdma.records import RequestRecord, checksum
from r3rdma.store.assembly import Assembly
from r3rdma.store.batch_array import (
    batch_chunk_rows,
    encode_array,
    place_records,
    placed_offsets,
    record_geometry,
    write_array,
)
from r3rdma.store.index_entries import PendingSegment, RequestEntry
from r3rdma.store.layout import (
    INDEX_KEY,
    array_name,
    check_rollout_dir_name,
    fsync_dir,
    group_document,
    write_json,
)
from r3rdma.store.publishing import CommitResult, Publish, Publisher, combined
from r3rdma.store.recovery import check_format, recover_root, remove_orphans
from r3rdma.store.rollout_index import (
    IndexPart,
    RolloutIndex,
    load_index,
    new_uid,
    part_name,
    read_file,
)
from r3rdma.store.shard_writer import EncodedArray, zarr_codecs
from r3rdma.store.snapshots import Snapshotter

#: Cut checksums a store remembers (:meth:`LocalRoutingStore._stored_checksum`): a few per
#: prompt of the rollouts being written.
_CUT_CHECKSUMS = 4096

__all__ = ["LocalRoutingStore", "PreparedBatch", "CommitResult", "zarr_codecs", "check_rollout_dir_name"]


@dataclass(frozen=True, slots=True)
class _Draft:
    """A rollout's batch array encoded before the lock, as if every record were new: valid
    for the commit if :func:`place_records` placed every record at ``offsets``."""

    chunk: int
    offsets: list[int]
    encoded: EncodedArray


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    """A batch checked and encoded by :meth:`LocalRoutingStore.prepare`, for
    :meth:`LocalRoutingStore.commit_async`: its records by rollout, and each rollout's
    draft array (None where the batch mixes geometries: the commit refuses it)."""

    by_rollout: dict[str, list[RequestRecord]]
    drafts: dict[str, _Draft | None]


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
        layers_per_chunk: int | None = None,
        slice_layout: bool = True,
    ) -> None:
        """``only_last_turn`` (FastDeploy's key): a request keeps only the rows of its latest
        turn's full view; a complete record set that starts where the stored request starts and
        ends beyond it *replaces* it (without it, such a record is a conflict and refused).

        ``chunk_rows`` / ``min_chunk_rows``: a batch array's inner chunks hold the power of two
        at or above its median request length, or with ``slice_layout`` for long requests a
        sixteenth of it (their array then lies layer group major, format 4), clamped to this
        range (:func:`~r3rdma.store.batch_array.batch_chunk_rows`).

        ``slice_layout`` (the default): lay out batch arrays of long requests for trainers that
        read by slice (context-parallel pieces and pipeline stages, ``prefetch_routing(layout=...)``):
        such a rank fetches about what it replays, at ~8% more stored bytes. False: the whole-request
        layout (chunks about one request long, in the shard index's order), for a store read only
        by whole requests, which it reads about twice as fast (docs/FORMAT.md, "Chunk order").

        ``layers_per_chunk``: MoE layers per inner chunk of a batch array (format 3). None (the
        default): the store's rule, a power-of-two count of equal groups of at least 64 KiB,
        16 KiB layer group major (:func:`~r3rdma.store.batch_array.layers_per_chunk`). Set it to
        the trainers' pipeline stage size (or a divisor of it) so each stage fetches only its
        own layers' chunks; a value that does not divide the layer count pads the last group
        (readable, slower to encode).

        ``snapshot_parts`` / ``snapshot_idle_s``: a background thread merges a rollout's index
        parts into a snapshot (:mod:`r3rdma.store.rollout_index`, "Snapshots") once
        ``snapshot_parts`` parts follow the last one, or once the rollout has had no commit for
        ``snapshot_idle_s`` seconds (its rollout has ended: the moment fresh readers open it)
        and ``snapshot_parts // 8`` (at least 2) parts follow the last one."""
        if isinstance(snapshot_parts, bool) or not isinstance(snapshot_parts, int) or snapshot_parts < 1:
            raise ConfigError(f"snapshot_parts must be an int >= 1, got {snapshot_parts!r}")
        if isinstance(snapshot_idle_s, bool) or not isinstance(snapshot_idle_s, (int, float)) or not snapshot_idle_s > 0:
            raise ConfigError(f"snapshot_idle_s must be a number of seconds > 0, got {snapshot_idle_s!r}")
        if layers_per_chunk is not None and (
            isinstance(layers_per_chunk, bool) or not isinstance(layers_per_chunk, int) or layers_per_chunk < 1
        ):
            raise ConfigError(f"layers_per_chunk must be an int >= 1 or None, got {layers_per_chunk!r}")
        self.layers_per_chunk = layers_per_chunk
        if not isinstance(slice_layout, bool):
            raise ConfigError(f"slice_layout must be True or False, got {slice_layout!r}")
        self.slice_layout = slice_layout
        self.root = Path(root)
        self.snapshot_parts = snapshot_parts
        self.snapshot_idle_s = float(snapshot_idle_s)
        self.only_last_turn = only_last_turn
        self.zstd_level = zstd_level
        self.chunk_rows = chunk_rows
        self.min_chunk_rows = min(min_chunk_rows, chunk_rows)
        self._lock = threading.Lock()
        self._indexes: dict[str, RolloutIndex] = {}
        self._cut_checksums: dict[tuple[str, str, str, int, int], int] = {}  # see _stored_checksum
        # Commits written but not yet durable, published in order by one thread.
        self._publisher = Publisher()
        self._snapshots = Snapshotter(self.root, self._lock, self._indexes, self._publisher, snapshot_parts, self.snapshot_idle_s)
        self._lock_fd = -1
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
            check_format(self.root, bool(self.rollouts()))
            recover_root(self.root)
        except BaseException:
            self.close()
            raise

    # -- public API -------------------------------------------------------------------------

    def prepare(self, records: Sequence[RequestRecord]) -> PreparedBatch:
        """The part of a commit that needs no lock: the batch checked (:func:`_by_rollout`'s
        refusals), each rollout's batch array encoded (compressed) as if every record were new.
        :meth:`commit_async` does this itself when given records; a caller committing batches
        in turn (a store node) prepares the next batch while the previous one is written.

        Why before the lock: compressing a batch is most of a commit, and under the lock it
        kept every other commit (and a node's next group) waiting. Whether a record is new
        is known only under the lock; a batch with a duplicate (a retry) is encoded again
        there, which costs only that rarer commit.
        """
        by_rollout = _by_rollout(records)
        drafts: dict[str, _Draft | None] = {}
        for rollout_id, group in by_rollout.items():
            geometry = record_geometry(group[0])
            if any(record_geometry(r) != geometry for r in group[1:]):
                drafts[rollout_id] = None  # refused under the lock, with the message it always had
                continue
            chunk = batch_chunk_rows(group, self.min_chunk_rows, self.chunk_rows, self.slice_layout)
            offsets, end = placed_offsets(group, chunk)
            drafts[rollout_id] = _Draft(
                chunk,
                offsets,
                encode_array(list(zip(offsets, group)), end, chunk, self.zstd_level, self.layers_per_chunk, self.slice_layout),
            )
        return PreparedBatch(by_rollout, drafts)

    def commit_async(self, records: Sequence[RequestRecord] | PreparedBatch) -> Future:
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
        new segment (a later turn of a multi-turn conversation). A record with a
        ``shared_prefix`` gets the segments of its source's rows ``0 .. P - 1`` (its source
        stored here, or earlier in the batch) before its own; without them it raises
        :class:`~r3rdma.errors.SharedRowsMissingError` (:class:`Assembly`).

        ``records`` may be a :class:`PreparedBatch` (:meth:`prepare`): its arrays are already
        encoded, and only the index decisions and the writes run here, under the lock.
        """
        prepared = records if isinstance(records, PreparedBatch) else self.prepare(records)
        with self._lock:
            self._settle()
            publishes: list[Publish] = []
            try:
                for rollout_id, group in prepared.by_rollout.items():
                    publishes.append(self._write_rollout(rollout_id, group, prepared.drafts[rollout_id]))
            except BaseException:
                # Rollouts of this batch written before the refusal are stored, as they would
                # be one by one: made durable before the error reaches the caller.
                for item in publishes:
                    self._publisher.enqueue(item)
                for item in publishes:
                    item.done.exception()
                raise
            for item in publishes:
                self._publisher.enqueue(item)
        return combined(publishes)

    def commit(self, records: Sequence[RequestRecord]) -> CommitResult:
        """:meth:`commit_async` and wait: returns once ``records`` are durable."""
        return self.commit_async(records).result()

    def pending(self, rollout_id: str) -> dict[str, tuple[tuple[int, int, bool], ...]]:
        """Incomplete requests of a rollout: ``(start_row, end_row, final)`` of each stored part."""
        check_rollout_dir_name(rollout_id)
        with self._lock:
            self._settle(drain=True)
            index = self._index(rollout_id)
            return {rid: tuple((seg.start_row, seg.end_row, seg.final) for seg in segs) for rid, segs in index.pending.items()}

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
            item = self._write_part(rollout_id, index, [], {}, {}, {request_id: ()})
            self._publisher.enqueue(item)
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
        self._snapshots.forget(rollout_id)
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Wait for commits still being published, then release the root."""
        self._snapshots.close()
        self._publisher.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def __enter__(self) -> LocalRoutingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _settle(self, drain: bool = False) -> None:
        """Under ``self._lock``: after a failed publish, wait until nothing is in flight and
        forget the in-memory indexes (ahead of the disk; :meth:`_index` reloads them and
        removes the arrays and parts the failed commits left). ``drain``: also wait for every
        commit in flight (before a delete, or answering what is pending)."""
        if self._publisher.settle(drain):
            self._indexes.clear()
            # The failed commits' arrays are removed and their names given to later batches
            # with other rows: a checksum read from one of them would describe rows that are gone.
            self._cut_checksums.clear()

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
            remove_orphans(path, index.parts, index.snapshot)
            self._indexes[rollout_id] = index
        return index

    def _stored_checksum(self, rollout_id: str, uid: str, array: str, offset: int, rows: int) -> int:
        """Under ``self._lock``: the CRC-32C of stored rows ``array[offset : offset + rows]`` of a
        rollout (a shared prefix cut inside a segment of an earlier commit; :class:`Assembly`).

        Read back with zarr (the array is written, if not yet durable: a commit is written
        before the next one is planned). Remembered per (rollout uid, array, offset, rows):
        the n samples of one prompt share the same cut, and batch arrays are never rewritten
        (a failed publish removes the arrays it wrote: :meth:`_settle` forgets these then).
        """
        key = (rollout_id, uid, array, offset, rows)
        crc = self._cut_checksums.get(key)
        if crc is None:
            crc = checksum(self._stored_rows(rollout_id, array, offset, rows, "a shared prefix"))
            if len(self._cut_checksums) >= _CUT_CHECKSUMS:
                del self._cut_checksums[next(iter(self._cut_checksums))]  # oldest first
            self._cut_checksums[key] = crc
        return crc

    def _stored_rows(self, rollout_id: str, array: str, offset: int, rows: int, why: str = "rows compared") -> np.ndarray:
        """Under ``self._lock``: stored rows ``array[offset : offset + rows]`` of a rollout, read
        back with zarr (a shared prefix's cut; a record's rows compared with the stored ones when
        they are split otherwise, :class:`Assembly`)."""
        path = self.root / rollout_id / array
        try:
            return np.asarray(zarr.open_array(str(path), mode="r", zarr_format=3)[offset : offset + rows])
        except Exception as e:  # zarr raises many types for a missing or damaged array
            raise StoreError(f"reading rows {offset}..{offset + rows - 1} of {path} ({why}) failed: {e!r}") from e

    def _write_part(
        self,
        rollout_id: str,
        index: RolloutIndex,
        arrays: list[str],
        shards: dict[str, dict[str, Any]],
        requests: dict[str, RequestEntry],
        pending: dict[str, tuple[PendingSegment, ...]],
        new_paths: Sequence[Path] = (),
    ) -> Publish:
        """Write the next index part (:class:`IndexPart`: the arrays this commit added, the
        requests and pending lists it changed) and apply it to the in-memory index; return what
        publishes it (:class:`Publish`: everything fsynced at once, then the entry point).

        ``new_paths``: what this commit wrote that the part names (a batch array's files and
        directories), not yet durable. On a failure here nothing changed for readers and the
        part's directory is removed.
        """
        seq = index.parts + 1
        part = IndexPart(seq, index.uid, arrays, shards, requests, pending)
        path = self.root / rollout_id
        part_dir = path / part_name(seq)
        try:
            part_dir.mkdir(parents=True, exist_ok=True)
            # No temp file: nothing names the part until the entry point counts it, and opening
            # the root removes a part numbered past that count (a crash's, torn or not).
            write_json(part_dir / "zarr.json", group_document({INDEX_KEY: part.document()}))
        except OSError as e:
            shutil.rmtree(part_dir, ignore_errors=True)
            raise StoreError(f"committing index part {seq} of rollout {rollout_id!r} failed: {e}") from e
        index.apply(part)
        self._snapshots.note_commit(rollout_id, index)
        # The rollout directory holds the new entries (array, part); the root holds the
        # rollout directory's own entry, new with the rollout's first part.
        durable = [*new_paths, part_dir / "zarr.json", part_dir, path] + ([self.root] if seq == 1 else [])
        return Publish(rollout_id, seq, (path / "zarr.json", group_document({INDEX_KEY: index.entry_document()})), durable)

    def _write_rollout(self, rollout_id: str, records: list[RequestRecord], draft: _Draft | None) -> Publish:
        index = self._index(rollout_id)
        geometry = record_geometry(records[0])
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
        state = Assembly(
            rollout_id,
            index.requests,
            index.pending,
            self.only_last_turn,
            lambda array, offset, rows: self._stored_checksum(rollout_id, index.uid, array, offset, rows),
            lambda array, offset, rows: self._stored_rows(rollout_id, array, offset, rows),
        )
        chunk = batch_chunk_rows(records, self.min_chunk_rows, self.chunk_rows, self.slice_layout)
        new, duplicates, end = place_records(records, state, name, chunk, geometry)
        if not new:
            return Publish.nothing(rollout_id, duplicates)
        if draft is not None and draft.chunk == chunk and len(new) == len(records) and [o for o, _ in new] == draft.offsets:
            encoded = draft.encoded
        else:  # duplicates skipped: the records left sit elsewhere in the array
            encoded = encode_array(new, end, chunk, self.zstd_level, self.layers_per_chunk, self.slice_layout)
        rollout_path = self.root / rollout_id
        try:
            shards, written = write_array(rollout_path, name, encoded, self.zstd_level)
        except R3Error:
            raise
        except OSError as e:
            shutil.rmtree(rollout_path / name, ignore_errors=True)
            nbytes = encoded.rows * new[0][1].ids_TLK[0].nbytes  # the array's, fill rows included
            raise StoreError(f"writing {len(new)} requests ({nbytes} bytes) to {rollout_path / name} failed: {e}") from e
        if not index.geometry:
            index.geometry = geometry
        try:
            item = self._write_part(rollout_id, index, [name], {name: shards}, state.requests, state.pending, written)
        except StoreError:
            shutil.rmtree(rollout_path / name, ignore_errors=True)
            if index.parts == 0:
                index.geometry = {}
            raise
        still_pending = len({r.request_id for _, r in new} & set(index.pending))
        item.counts = (len(new), duplicates, sum(r.nbytes for _, r in new), still_pending)
        return item


def _by_rollout(records: Sequence[RequestRecord]) -> dict[str, list[RequestRecord]]:
    """A batch's records by rollout, each record's rows and each rollout id checked.

    Before anything is written: one record without rows refuses the whole batch (zarr cannot
    open a batch array of 0 rows, so storing it would break every read of its rollout). The
    engine learns the bad request's id and may push the others again.
    """
    by_rollout: dict[str, list[RequestRecord]] = {}
    for record in records:
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
    return by_rollout
