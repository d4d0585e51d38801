"""Worker threads that check and decode fetched chunks, and how a read waits for its share.

Why not ``loop.run_in_executor`` per fetched byte span: each call makes a
``concurrent.futures.Future`` and an asyncio future chained to it, a pool submit that wakes a
thread, and a ``call_soon_threadsafe`` back that wakes the event loop. A trainer rank's slice is
one GET per inner chunk (~80 KB): on the CPU VM those hand-offs cost the event loop and the
pool more CPU than the zstd decode they carried (#34). Here the event loop puts jobs on one
C-level queue that long-lived workers drain (no future per job, no wake-up when a worker is
busy), and a read (:class:`JobBatch`) is told once, when the last of its jobs is done. A span
of one job's worth skips even that and is decoded on the event loop as it arrives
(:func:`r3rdma.read.shard_ranges.fetch_run`): only long spans come here.

The workers (one per core, daemon threads) start with the first job, not at import; a forked
child starts its own.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["JobBatch"]

_queue: queue.SimpleQueue[tuple[JobBatch, Callable[..., None], tuple[Any, ...]]] | None = None
_start_lock = threading.Lock()


def _jobs() -> queue.SimpleQueue[tuple[JobBatch, Callable[..., None], tuple[Any, ...]]]:
    global _queue
    if _queue is None:
        with _start_lock:
            if _queue is None:
                jobs: queue.SimpleQueue[tuple[JobBatch, Callable[..., None], tuple[Any, ...]]] = queue.SimpleQueue()
                for n in range(os.cpu_count() or 1):
                    threading.Thread(target=_work, args=(jobs,), name=f"r3rdma-decode-{n}", daemon=True).start()
                _queue = jobs
    return _queue


def _forget_workers() -> None:
    """In a forked child: the parent's workers do not exist here."""
    global _queue, _start_lock
    _queue = None
    _start_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_workers)


def _work(jobs: queue.SimpleQueue[tuple[JobBatch, Callable[..., None], tuple[Any, ...]]]) -> None:
    while True:
        batch, fn, args = jobs.get()
        error: BaseException | None = None
        if not batch.stopped:
            try:
                fn(*args)
            except BaseException as e:  # the read that queued it raises it
                error = e
        batch._finish(error, on_loop=False)


class JobBatch:
    """One read's jobs on the workers: ``put`` them from the event loop, then ``await
    wait()``: it returns once every job put has run, and raises the first job's exception (the
    jobs not started by then are skipped). Create it on the event loop that waits."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        self._lock = threading.Lock()
        self._left = 1  # the jobs not finished, and the read itself until it waits
        self._error: BaseException | None = None
        #: Set once the read failed or was abandoned: jobs not started yet are skipped.
        self.stopped = False

    def put(self, fn: Callable[..., None], *args: Any) -> None:
        """Queue ``fn(*args)`` to run on a worker thread."""
        with self._lock:
            self._left += 1
        _jobs().put((self, fn, args))

    async def wait(self, *, stop: bool = False) -> None:
        """Wait until every job put has run; raise the first job's exception. ``stop``: skip
        the jobs not started yet (the read failed; only jobs in flight are waited for)."""
        if stop:
            self.stopped = True
        self._finish(None, on_loop=True)
        try:
            await self._done  # a future of its own: cancelling the read cancels it, no job minds
        except asyncio.CancelledError:
            self.stopped = True  # abandoned: what is still queued is of no use to anyone
            raise
        if self._error is not None and not stop:
            raise self._error

    def _finish(self, error: BaseException | None, *, on_loop: bool) -> None:
        """A job (on a worker) or the read's own hold (on the loop) is done, with ``error`` if it failed."""
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
                self.stopped = True
            self._left -= 1
            last = self._left == 0
        if last:
            if on_loop:
                self._resolve()
            else:
                try:
                    self._loop.call_soon_threadsafe(self._resolve)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    pass

    def _resolve(self) -> None:
        if not self._done.done():
            self._done.set_result(None)
