"""Publishing commits: each written commit made durable and visible, in order, on one thread.

A commit's batch array and index part are written by the caller of
:meth:`~r3rdma.store.local_store.LocalRoutingStore.commit_async`; its flush to disk (array, part
and the entry point's temp file fsynced at once, ~20-30% of a commit on the VM's and the GPU
hosts' disks) and the entry point's rename run here while the caller writes the next batch.
"""

from __future__ import annotations

import collections
import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from r3rdma.errors import StoreError
from r3rdma.store.layout import write_json_atomic

__all__ = ["CommitResult", "Publish", "Publisher", "combined", "publish_group"]


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


@dataclass(eq=False)
class Publish:
    """One rollout's commit, written and applied to the in-memory index: :func:`publish_group`
    makes it durable (``durable`` and the entry point's temp file fsynced at once) and visible
    (the entry point renamed into place). ``done`` resolves to its counts."""

    rollout_id: str
    seq: int
    entry: tuple[Path, dict[str, Any]] | None  # the entry point's path and its new document; None: nothing to publish
    durable: list[Path]
    counts: tuple[int, int, int, int] = (0, 0, 0, 0)  # committed, duplicates, bytes, pending
    done: Future = field(default_factory=Future)

    @classmethod
    def nothing(cls, rollout_id: str, duplicates: int) -> Publish:
        """A batch of duplicates only: durable once the commits before it are."""
        return cls(rollout_id, 0, None, [], (0, duplicates, 0, 0))

    def write_entry(self, sync_with: list[Path]) -> None:
        """Write the entry point, fsyncing it with ``sync_with`` (this commit's ``durable``
        and those of commits published with it) before the rename; raises
        :class:`StoreError` if the disk refuses."""
        if self.entry is not None:
            path, document = self.entry
            try:
                write_json_atomic(path, document, sync_with=sync_with)
            except OSError as e:
                raise StoreError(f"committing index part {self.seq} of rollout {self.rollout_id!r} failed: {e}") from e

    def fail(self, error: BaseException) -> None:
        """Resolve ``done`` to ``error``: this commit is not stored."""
        self.done.set_exception(error)


def combined(items: list[Publish]) -> Future:
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


class Publisher:
    """Publishes queued commits in order on one thread (started with the first).

    A failed publish leaves the writer's in-memory indexes ahead of the disk: every commit
    queued after it fails too (it was planned on top of the failed one), and :meth:`settle`
    tells the writer to reload its indexes from disk.
    """

    def __init__(self) -> None:
        self._published = threading.Condition()
        self._queue: collections.deque[Publish] = collections.deque()
        self._thread: threading.Thread | None = None
        self._broken: BaseException | None = None  # a publish failed: in-memory indexes are ahead of the disk

    def enqueue(self, item: Publish) -> None:
        """Queue ``item`` to be published after the commits queued before it (starts the thread
        with the first)."""
        with self._published:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="r3rdma-publish", daemon=True)
                self._thread.start()
            self._queue.append(item)
            self._published.notify_all()

    def settle(self, drain: bool = False) -> bool:
        """After a failed publish, wait until nothing is in flight and return True once (the
        caller forgets its in-memory indexes: :meth:`LocalRoutingStore._index` reloads them and
        removes the arrays and parts the failed commits left). ``drain``: also wait for every
        commit in flight (before a delete, or answering what is pending)."""
        with self._published:
            if not (drain or self._broken is not None):
                return False
            while self._queue:
                self._published.wait()
            broken, self._broken = self._broken, None
            return broken is not None

    def close(self) -> None:
        """Wait for the commits still queued, then stop the thread."""
        with self._published:
            while self._queue:
                self._published.wait()
            thread, self._thread = self._thread, None
            self._published.notify_all()
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        """Make the written commits durable and visible, in order (see ``commit_async``):
        every commit queued when the thread looks, at once (:func:`publish_group`)."""
        me = threading.current_thread()
        while True:
            with self._published:
                while not self._queue and self._thread is me:
                    self._published.wait()
                if not self._queue:
                    return
                items = list(itertools.islice(self._queue, _GROUP))
                broken = self._broken
            if broken is not None:
                for item in items:
                    item.fail(
                        StoreError(
                            f"rollout {item.rollout_id!r}: not stored, an earlier commit written before it "
                            f"failed to reach the disk: {broken}"
                        )
                    )
            else:
                try:
                    publish_group(items)
                except BaseException as e:
                    with self._published:
                        self._broken = e
                    for item in items:
                        if not item.done.done():
                            item.fail(e)
            with self._published:
                for _ in items:
                    self._queue.popleft()
                self._published.notify_all()


_GROUP = 32  # commits published at once, at most


def publish_group(items: list[Publish]) -> None:
    """Publish ``items`` (commits in the order written) as one: everything they wrote fsynced
    at once, then each rollout's entry point replaced by its latest commit's and that
    rollout's commits resolved; raises :class:`StoreError` if the disk refuses (the commits
    not resolved yet are left to the caller to fail).

    Why a group: a commit's flush waits for the disk (~9-10 ms per 8 MB batch on the H100
    hosts, where encoding a batch takes ~7), so commits queued behind one each waited for a
    flush of their own; one flush for all of them makes the disk's latency count once per
    group. A later commit's entry point holds everything an earlier one of the same rollout
    did (index parts are counted in order), so only the latest is written; readers see the
    group's commits become visible together, a few milliseconds later at most. A commit with
    no entry point (duplicates only, :meth:`Publish.nothing`) wrote nothing: it is durable
    once the commits of its rollout before it are.
    """
    by_rollout: dict[str, list[Publish]] = {}
    for item in items:
        by_rollout.setdefault(item.rollout_id, []).append(item)
    durable = [path for item in items for path in item.durable]
    for group in by_rollout.values():
        with_entry = [item for item in group if item.entry is not None]
        if with_entry:
            with_entry[-1].write_entry(sync_with=durable)
            durable = []  # made durable with the first entry point
        for item in group:
            item.done.set_result(item.counts)
