"""A trainer's micro-batches read ahead of it: :class:`Prefetcher` (``RoutingReader.prefetch``)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from r3rdma.errors import ConfigError, CorruptDataError
from r3rdma.read.fetching import RowFetcher
from r3rdma.read.indexes import RolloutIndexes
from r3rdma.read.layers import layer_list, layer_selection
from r3rdma.read.packed import PackedBuffer, PackedRouting
from r3rdma.read.request_ids import check_ids
from r3rdma.read.rows import check_rows, row_spans

__all__ = ["Prefetcher"]


class Prefetcher:
    """Yields :class:`PackedRouting` of each batch in order while the next ones load
    (:meth:`RoutingReader.prefetch`): up to ``depth`` batches ahead of the consumer, all of them
    loading at once (each load is itself concurrent). Why at once: one load at a time left a
    data-parallel rank's scattered micro-batches (a ranged GET per request, on every node)
    waiting on their slowest GET before the next batch's GETs started; on the H100 host its
    8 readers kept 8 of 16 cores busy at 0.61 of the contiguous rate.

    A load is a coroutine on the reader's event loop, started from ``__next__`` (no thread of
    its own: a thread per load in flight cost two more thread hand-offs per batch, #34); with
    ``pin_memory`` a thread per load in flight also pins the result, off the consumer's time.

    Made by ``RoutingReader.prefetch`` from the reader's parts: its ``indexes`` and
    ``fetcher``, and ``get_packed`` for the pinned loads."""

    def __init__(
        self,
        rollout_id: str,
        batches: Iterable[Iterable[str]],
        *,
        indexes: RolloutIndexes,
        fetcher: RowFetcher,
        get_packed: Callable[..., PackedRouting],
        depth: int,
        pin_memory: bool,
        layers: Iterable[int] | None = None,
        rows: Mapping[str, Iterable[Any]] | None = None,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"depth must be an int >= 1, got {depth!r}")
        if pin_memory and not _cuda_available():
            raise ConfigError("pin_memory=True needs CUDA (page-locked memory is for copies to a GPU); none is available")
        self._batches = [check_ids(batch) for batch in batches]
        every = list(dict.fromkeys(rid for batch in self._batches for rid in batch))
        merged = indexes.require(rollout_id, every)  # unknown ids fail before any read
        fetcher.choose_copies(rollout_id, merged, every)  # and copies that disagree
        self._layers = layer_list(layers)
        # So do layers the rollout lacks. Kept: a rollout's geometry does not change.
        self._selection = (merged.geometry, *layer_selection(rollout_id, merged.geometry, self._layers))
        self._rows = row_spans(rows)
        check_rows(rollout_id, self._rows, every, merged.entry)  # and rows past a request's end
        self._indexes, self._fetcher, self._get_packed = indexes, fetcher, get_packed
        self._rollout_id, self._depth, self._pin = rollout_id, depth, pin_memory
        # get_packed may run in several threads: each call's reads run as one coroutine on the
        # reader's event loop, where its caches live.
        self._thread = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="r3rdma-prefetch") if pin_memory else None
        self._queue: collections.deque[tuple[list[str], Future[Any], PackedBuffer | None]] = collections.deque()
        self._next = 0

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[PackedRouting]:
        return self

    def __next__(self) -> PackedRouting:
        try:
            while len(self._queue) < self._depth and self._next < len(self._batches):
                batch = self._batches[self._next]
                try:
                    self._queue.append(self._start(batch))
                except Exception as e:  # raised when this batch's turn comes, as a failed load would be
                    failed: Future[Any] = Future()
                    failed.set_exception(e)
                    self._queue.append((batch, failed, None))
                self._next += 1
            if not self._queue:
                self.close()
                raise StopIteration
            batch, future, load = self._queue.popleft()
            if load is None:
                return future.result()  # a pinning thread's get_packed
            try:
                future.result()
            except CorruptDataError as e:
                self._indexes.raise_if_deleted(self._rollout_id, batch, e)
                raise
            return load.result()
        except BaseException:
            self.close()
            raise

    def _start(self, batch: list[str]) -> tuple[list[str], Future[Any], PackedBuffer | None]:
        """Start loading ``batch``: its read on the reader's event loop (or, pinning, a thread's)."""
        if self._thread is not None:
            return batch, self._thread.submit(self._load_pinned, batch), None
        rollout_id = self._rollout_id
        merged = self._indexes.require(rollout_id, batch)  # a request deleted since: said here, as get_packed says it
        self._fetcher.choose_copies(rollout_id, merged, batch)  # the copies read, before their entries are looked at
        if merged.geometry is not self._selection[0]:  # the rollout was written again
            self._selection = (merged.geometry, *layer_selection(rollout_id, merged.geometry, self._layers))
        _, positions, geometry = self._selection
        spans = None if self._rows is None else {rid: self._rows[rid] for rid in batch if rid in self._rows}
        load = PackedBuffer(batch, [merged.entry(rid) for rid in batch], geometry, spans)
        coro = self._fetcher.read_later(rollout_id, merged, batch, load.outs, positions, spans)
        return batch, asyncio.run_coroutine_threadsafe(coro, _reader_loop()), load

    def _load_pinned(self, batch: list[str]) -> PackedRouting:
        kwargs: dict[str, Any] = {}
        if self._layers is not None:
            kwargs["layers"] = self._layers
        if self._rows is not None:
            kwargs["rows"] = {rid: self._rows[rid] for rid in batch if rid in self._rows}
        packed = self._get_packed(self._rollout_id, batch, **kwargs)
        return dataclasses.replace(packed, ids_TLK=packed.ids_TLK.pin_memory())

    def close(self) -> None:
        """Stop loading: batches not started are dropped, those in progress stop."""
        for _, future, _ in self._queue:
            future.cancel()
        self._queue.clear()
        self._next = len(self._batches)
        if self._thread is not None:
            self._thread.shutdown(wait=False)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reader_loop() -> asyncio.AbstractEventLoop:
    """The event loop every read runs on: zarr's (``zarr.core.sync.sync`` runs coroutines
    there), where the reader's caches and connections live."""
    from zarr.core.sync import _get_loop

    return _get_loop()


def _cuda_available() -> bool:
    import torch  # imported where used (r3rdma.read.packed says why)

    return torch.cuda.is_available()
