"""A trainer rank's share of a rollout, read while the rollout is still running.

In an RL step the trainer knows which samples each data-parallel rank will train on before
the rollout ends (the prompts were assigned when the step began), and requests finish at
random times through the rollout. Reading a rank's share only after the last request ends
puts the whole read between rollout end and the first training step: the stall an RL team
times. :class:`ShareCollector` (``RoutingReader.collect``) names the share up front; a
background thread polls the rollout's index (the entry point per node, and the parts it has
not seen: a few small GETs) and reads each newly committed request of the share at once,
so at rollout end only the last requests' rows are still to read.

A rank that replays part of each request names that part up front too: ``layers`` (a pipeline
stage's decoder layers) and ``rows`` (a context-parallel rank's row spans,
:func:`r3rdma.read.rows.cp_row_spans`), in the forms ``RoutingReader.get_numpy`` takes; only the
chunks holding them are fetched, and the results hold what ``get_numpy`` returns for them.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from r3rdma.errors import ConfigError, R3Error, R3TimeoutError, StoreError, TransportError, UnknownRolloutError
from r3rdma.read.fetching import RowFetcher
from r3rdma.read.indexes import RolloutIndexes
from r3rdma.read.layers import layer_selection
from r3rdma.read.merged_index import MergedIndex
from r3rdma.read.packed import PackedRouting, pack
from r3rdma.read.rows import Spans, check_rows

__all__ = ["ShareCollector"]

_log = logging.getLogger(__name__)


class ShareCollector:
    """Reads ``request_ids`` of a rollout as they are committed (see the module docstring).

    :meth:`result` / :meth:`packed` wait for the whole share: each request's routing as
    ``get_numpy(request_ids, layers=layers, rows=rows)`` returns it. ``ready`` / ``total`` say how
    far it got. Unreachable store nodes (on the index or on a read) and a rollout not created
    yet are retried on every poll (a node restarting mid-rollout must not end the trainer's
    wait); any other error
    (damaged data, a refused token, a deleted rollout, a layer the rollout lacks, rows asked
    past a committed request's end) ends the collection and is raised by :meth:`result`. Use as a context manager, or :meth:`close` it.

    Made by ``RoutingReader.collect`` from the reader's parts: its ``indexes`` (polled) and
    its ``fetcher`` (the reads).
    """

    def __init__(
        self,
        rollout_id: str,
        request_ids: list[str],
        *,
        indexes: RolloutIndexes,
        fetcher: RowFetcher,
        poll_s: float,
        max_batch: int,
        layers: list[int] | None = None,
        rows: Spans | None = None,
    ) -> None:
        if isinstance(poll_s, bool) or not isinstance(poll_s, (int, float)) or not poll_s > 0:
            raise ConfigError(f"poll_s must be a number of seconds > 0, got {poll_s!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self._indexes, self._fetcher, self._rollout_id = indexes, fetcher, rollout_id
        self._order = request_ids
        self._layers = layers  # decoder layer ids wanted (None: all), checked once the geometry is known
        # Row spans wanted of some requests (None: all rows), checked for shape and against the
        # share by the caller; against each request's stored rows once it is committed.
        self._rows = rows
        self._missing = dict.fromkeys(request_ids)  # insertion-ordered set
        self._got: dict[str, np.ndarray] = {}
        self._poll_s, self._max_batch = float(poll_s), max_batch
        self._error: BaseException | None = None
        self._last_retryable: BaseException | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        #: ``time.monotonic()`` when the last request of the share was read (None before).
        self.finished_at: float | None = None
        #: Index polls made, and reads issued (each reads every newly committed request at once).
        self.polls = 0
        self.reads = 0
        self._thread = threading.Thread(target=self._run, name="r3rdma-collect", daemon=True)
        self._thread.start()

    @property
    def total(self) -> int:
        """Requests in the share."""
        return len(self._order)

    @property
    def ready(self) -> int:
        """Requests of the share read so far."""
        with self._lock:
            return len(self._got)

    def done(self) -> bool:
        """Whether the collection ended (every request read, an error, or :meth:`close`): :meth:`result` no longer waits."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        """The share's routing ``[rows, L, K]`` per request id, in the order named, once every
        request is read. Past ``timeout`` seconds: :class:`R3TimeoutError` naming what is
        missing (the collection goes on; call again to keep waiting)."""
        if not self._done.wait(timeout):
            with self._lock:
                missing = list(self._missing)
            shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            why = f"; last retryable error: {self._last_retryable}" if self._last_retryable is not None else ""
            raise R3TimeoutError(
                f"rollout {self._rollout_id!r}: {len(missing)} of the {self.total} requests of this share are not "
                f"committed after {timeout} s ({shown}){why}"
            )
        if self._error is not None:
            raise self._error
        return {rid: self._got[rid] for rid in self._order}

    def packed(self, timeout: float | None = None) -> PackedRouting:
        """:meth:`result` packed along tokens in the order named (as ``get_packed``)."""
        arrays = self.result(timeout)
        merged = self._indexes.get(self._rollout_id)
        self._fetcher.choose_copies(self._rollout_id, merged, self._order)  # the copies read: their start rows
        _, geometry = layer_selection(self._rollout_id, merged.geometry, self._layers)
        return pack(
            self._order,
            [[arrays[rid]] for rid in self._order],
            [merged.entry(rid).start_row for rid in self._order],
            geometry,
        )

    def close(self) -> None:
        """Stop polling (a read in progress finishes first)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> ShareCollector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.polls += 1
                try:
                    merged = self._indexes.get(self._rollout_id, refresh=True)
                except (UnknownRolloutError, TransportError, R3TimeoutError, StoreError) as e:
                    # Not created yet, or a node down for a moment: keep polling.
                    self._last_retryable = e
                    merged = None
                if merged is not None:
                    self._read_ready(merged)
                with self._lock:
                    if not self._missing:
                        self.finished_at = time.monotonic()
                        return
                self._stop.wait(self._poll_s)
        except BaseException as e:  # raised to the caller by result()
            _log.debug("collecting rollout %r stopped: %s", self._rollout_id, e)
            self._error = e
        else:
            self._error = R3Error(
                f"rollout {self._rollout_id!r}: collecting this share was closed with "
                f"{len(self._missing)} of its {self.total} requests not read"
            )
        finally:
            self._done.set()

    def _read_ready(self, merged: MergedIndex) -> None:
        """Read the requests of the share that ``merged`` lists and that are not read yet,
        ``max_batch`` at a time; one that every holder failed leaves the rest to the next poll."""
        positions = None
        if merged.owner:
            positions, _ = layer_selection(self._rollout_id, merged.geometry, self._layers)
        with self._lock:
            ready = [rid for rid in self._missing if rid in merged.owner]
        spans = None if self._rows is None else {rid: self._rows[rid] for rid in ready if rid in self._rows}
        try:
            # The copy each request is read from, chosen before its entry is looked at.
            self._fetcher.choose_copies(self._rollout_id, merged, ready)
        except (TransportError, R3TimeoutError, StoreError) as e:
            self._last_retryable = e  # copies compared by their rows, which could not be read: next poll
            return
        # Rows past a committed request's end: a caller's bug, raised before its read.
        check_rows(self._rollout_id, spans, ready, merged.entry)
        for start in range(0, len(ready), self._max_batch):
            batch = ready[start : start + self._max_batch]
            try:
                arrays = self._fetcher.read_arrays(
                    self._rollout_id,
                    merged,
                    batch,
                    positions,
                    None if spans is None else {rid: spans[rid] for rid in batch if rid in spans},
                )
            except (TransportError, R3TimeoutError, StoreError) as e:
                self._last_retryable = e  # every holder failed this time: next poll
                return
            self.reads += 1
            with self._lock:
                self._got.update(arrays)
                for rid in batch:
                    self._missing.pop(rid, None)
