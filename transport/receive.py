"""Where a store node receives batch payloads: reusable buffers, hashed as frames land.

Two costs dominated receiving a MB-sized batch besides the wire itself (2-core VM, 64 MiB):
a fresh buffer per batch (~8 ms of page faults) and CRC-32C over the payload after the last
frame (~4-8 ms, on the event loop). Buffers are therefore pooled, and each request is hashed
in a worker thread as soon as the frames holding it have arrived, while later frames are
still on the wire (the ``crc32c`` package releases the GIL).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from r3rdma.records import buffer_checksum

from .batch import RecordMeta

__all__ = ["ReceiveBuffers", "FrameHasher"]

#: Requests are hashed in jobs of about this many bytes: one job per tiny request would
#: cost more in executor round trips than the hashing itself.
HASH_JOB_BYTES = 1 << 20
#: Smaller jobs are hashed right on the event loop: ~20 us of CRC, less than a thread hand-off.
INLINE_HASH_BYTES = 256 << 10

_pool: ThreadPoolExecutor | None = None


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="r3rdma-crc")
    return _pool


def _refcount(obj: object) -> int:
    return sys.getrefcount(obj)


def _through_one_call(obj: object) -> int:
    return _refcount(obj)


def _calibrate() -> int:
    # The references an array has when only its caller's variable holds it, counted through
    # the same call depth as ReceiveBuffers.give_back: interpreters differ in how many
    # references a call's arguments hold (3.14 borrows some), so this is measured, not assumed.
    probe = np.empty(1, dtype=np.uint8)
    return _through_one_call(probe)


_UNSHARED_REFS = _calibrate()


class ReceiveBuffers:
    """A small pool of payload buffers shared by a server's connections.

    A buffer goes back to the pool only if no view of it survived the batch (a handler may
    keep records: they stay valid, the pool just allocates another buffer). Reused buffers
    hold earlier batches' bytes; every request carries the sender's CRC-32C, which is what
    refuses a frame that arrived short. New buffers are ``np.empty`` and never filled here,
    so their pages become resident only as payload bytes land: a batch announced and never
    sent costs address space and budget, not memory.
    """

    def __init__(self, *, max_cached_bytes: int, max_buffers: int = 8) -> None:
        self._free: list[np.ndarray] = []
        self.max_cached_bytes = max_cached_bytes
        self.max_buffers = max_buffers
        self.reused = 0  # buffers handed out again (tests read it)

    @property
    def cached_bytes(self) -> int:
        """Bytes held by the pooled buffers now."""
        return sum(b.nbytes for b in self._free)

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array owning at least ``nbytes`` of memory (contents undefined)."""
        fits = [b for b in self._free if nbytes <= b.nbytes <= 2 * nbytes + (1 << 20)]
        if fits:
            best = min(fits, key=lambda b: b.nbytes)
            self._free = [b for b in self._free if b is not best]
            self.reused += 1
            return best
        return np.empty(nbytes, dtype=np.uint8)

    def give_back(self, base: np.ndarray) -> None:
        """Return a buffer from :meth:`take` once its batch is done (the caller drops it)."""
        if _refcount(base) > _UNSHARED_REFS:  # a record (any numpy view) still refers to it
            return
        if base.nbytes > self.max_cached_bytes:
            return
        self._free.append(base)
        # Keep the most recent buffers within both bounds.
        while len(self._free) > self.max_buffers or self.cached_bytes > self.max_cached_bytes:
            self._free.pop(0)


class FrameHasher:
    """Hashes each request of a batch in a worker thread once its frames have all landed.

    Call :meth:`frame_done` (on the event loop) as each frame's receive completes, in any
    order; :meth:`results` returns one CRC-32C per request, in table order.
    """

    def __init__(self, metas: Sequence[RecordMeta], frame_sizes: Sequence[int], payload: np.ndarray) -> None:
        self._metas = metas
        self._payload = payload
        self._sizes = list(frame_sizes)
        self._done = [False] * len(self._sizes)
        self._next_frame = 0  # frames [0, _next_frame) have all landed
        self._landed = 0  # bytes covered by those frames
        self._next_record = 0  # requests [0, _next_record) are submitted for hashing
        self._jobs: list[tuple[int, asyncio.Future[list[int]]]] = []
        self._loop = asyncio.get_running_loop()
        self._advance()  # zero-byte requests at the start need no frame

    def frame_done(self, index: int) -> None:
        """Frame ``index`` landed: hash, in the background, every request whose frames have now
        all landed (call on the event loop)."""
        self._done[index] = True
        while self._next_frame < len(self._sizes) and self._done[self._next_frame]:
            self._landed += self._sizes[self._next_frame]
            self._next_frame += 1
        self._advance()

    def _advance(self) -> None:
        metas, first = self._metas, self._next_record
        end = first
        while end < len(metas) and metas[end].offset + metas[end].nbytes <= self._landed:
            end += 1
        # Split the newly complete requests into jobs of about HASH_JOB_BYTES each.
        start, size = first, 0
        for i in range(first, end):
            size += metas[i].nbytes
            if size >= HASH_JOB_BYTES or i == end - 1:
                views = [self._payload[m.offset : m.offset + m.nbytes] for m in metas[start : i + 1]]
                if size < INLINE_HASH_BYTES:
                    job = self._loop.create_future()
                    job.set_result(_hash_all(views))
                else:
                    job = self._loop.run_in_executor(_hash_pool(), _hash_all, views)
                self._jobs.append((start, job))
                start, size = i + 1, 0
        self._next_record = end

    async def results(self) -> list[int]:
        """Every request's CRC-32C; all frames must have been reported done."""
        if self._next_record != len(self._metas):
            raise AssertionError(f"hashed {self._next_record} of {len(self._metas)} requests: frames missing")
        crcs: list[int] = []
        for _, job in self._jobs:
            crcs.extend(await job)
        return crcs

    async def settle(self) -> None:
        """Wait for hashing jobs in flight (before the payload buffer is reused)."""
        if self._jobs:
            await asyncio.gather(*(job for _, job in self._jobs), return_exceptions=True)


def _hash_all(views: list[np.ndarray]) -> list[int]:
    return [buffer_checksum(v) for v in views]
