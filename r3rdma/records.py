"""Values that cross process boundaries: one request's routing, and the dtype rule."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

import crc32c
import numpy as np

from r3rdma.errors import InvalidIdError, ShapeMismatchError
from r3rdma.ids import validate_id

__all__ = ["RequestRecord", "SharedPrefix", "routing_dtype", "checksum", "buffer_checksum", "batches_by_size"]


def routing_dtype(num_experts: int) -> np.dtype:
    """Narrowest dtype that holds every expert id ``0 .. num_experts - 1``.

    ``num_experts`` counts every id a router can emit, shared experts included.
    uint8 up to 256 experts, uint16 up to 65536, int32 beyond.
    """
    if num_experts < 1:
        raise ShapeMismatchError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 1 << 8:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def checksum(ids_TLK: np.ndarray) -> int:
    """CRC-32C of the C-order bytes of a routing array; stored in the rollout index."""
    # Hashes the array's buffer in place: a tobytes() copy cost 4x the CRC itself.
    return buffer_checksum(np.ascontiguousarray(ids_TLK).reshape(-1).view(np.uint8))


def buffer_checksum(buf) -> int:
    """CRC-32C of a contiguous buffer (same value as zarr's crc32c codec, google_crc32c).

    The ``crc32c`` package, not google_crc32c: it is ~1.3x faster here (SSE4.2, 3-way) and
    releases the GIL, so a store node hashes a batch in worker threads while UCX and its
    event loop keep receiving the next frames (google_crc32c holds the GIL throughout).
    """
    return int(crc32c.crc32c(buf))


@dataclass(frozen=True, slots=True, eq=False)
class SharedPrefix:
    """A request's first ``rows`` routing rows are rows ``0 .. rows - 1`` of request
    ``request_id`` of the same rollout (GRPO: the engine computes a prompt's prefill once and
    forks n samples from it; docs/ENGINE_SEMANTICS.md, "Shared prefixes").

    The store resolves the reference into index segments pointing at the source's stored
    bytes, so those rows are stored (and sent) once. ``ids_TLK`` is an optional copy of the
    rows, kept on the client only: it is never sent while the reference resolves, and is used
    only when a store refuses the reference (:class:`~r3rdma.errors.SharedRowsMissingError`),
    to store the request with its rows inline instead (:meth:`RequestRecord.prefix_inlined`).
    """

    request_id: str
    rows: int
    ids_TLK: np.ndarray | None = None

    def __post_init__(self) -> None:
        validate_id(self.request_id, "shared_prefix.request_id")
        if isinstance(self.rows, bool) or not isinstance(self.rows, (int, np.integer)) or self.rows < 1:
            raise ShapeMismatchError(
                f"shared_prefix.rows must be an int >= 1 (rows shared with {self.request_id!r}), got {self.rows!r}"
            )
        object.__setattr__(self, "rows", int(self.rows))
        ids = self.ids_TLK
        if ids is None:
            return
        if not isinstance(ids, np.ndarray) or ids.ndim != 3 or ids.shape[0] != self.rows:
            raise ShapeMismatchError(
                f"shared_prefix.ids_TLK must be a 3-D numpy array of {self.rows} rows [rows, layers, top_k] (the rows "
                f"shared with {self.request_id!r}), got {type(ids).__name__} with shape {getattr(ids, 'shape', None)}"
            )
        if not ids.flags.c_contiguous:
            object.__setattr__(self, "ids_TLK", np.ascontiguousarray(ids))


@dataclass(frozen=True, slots=True, eq=False)
class RequestRecord:
    """The routing of one finished request (or one segment of it).

    ``ids_TLK[t]`` is the routing row of position ``start_row + t``: the experts chosen when
    that token was the *input* of a forward, for each MoE layer in ``layer_map`` order.

    Segments (multi-turn, prefill/decode disaggregation; docs/ENGINE_SEMANTICS.md):

    - ``final`` (default True): this record holds the request's last rows, so the request ends
      at row ``start_row + num_rows - 1``. A prefill engine whose decode engine pushes the
      rest sends ``final=False``: the store holds such a part invisible until the final
      record arrives and the parts cover every row exactly once.
    - ``total_rows`` (final records only): rows of the whole stored request, i.e. its rows
      span ``start_row + num_rows - total_rows .. start_row + num_rows - 1``. A decode engine
      sets it so the store waits for the prefill part even when the decode's record arrives
      first. None: the request spans this record plus, when ``start_row > 0``, the rows
      already stored for it (a later turn appending to a conversation) or its pending parts.

    Shared prefixes: ``shared_prefix`` (:class:`SharedPrefix`) says rows ``0 .. P - 1`` of this
    request are rows ``0 .. P - 1`` of another request of the same rollout, and ``ids_TLK``
    holds only the rows from ``start_row == P`` on; the record is ``final`` and the request has
    ``start_row + num_rows`` rows. ``nbytes`` and ``crc32c`` cover this record's own rows.
    """

    rollout_id: str
    request_id: str
    ids_TLK: np.ndarray
    layer_map: tuple[int, ...]
    num_experts: int
    start_row: int = 0
    crc32c: int = field(default=-1)
    final: bool = True
    total_rows: int | None = None
    #: The caller already hashed exactly these bytes and ``crc32c`` is the result (a store node
    #: verifies batches frame by frame off its event loop); skips hashing them again here.
    checksum_verified: InitVar[bool] = False
    #: Rows ``0 .. shared_prefix.rows - 1`` are another request's (see the class docstring).
    shared_prefix: SharedPrefix | None = None

    def __post_init__(self, checksum_verified: bool = False) -> None:
        validate_id(self.rollout_id, "rollout_id")
        validate_id(self.request_id, "request_id")
        ids = self.ids_TLK
        if not isinstance(ids, np.ndarray) or ids.ndim != 3:
            raise ShapeMismatchError(
                f"ids_TLK must be a 3-D numpy array [rows, layers, top_k], got "
                f"{type(ids).__name__} with shape {getattr(ids, 'shape', None)}"
            )
        if ids.shape[0] < 1:
            # A 0-row record has nothing to store, and a batch array of 0 rows cannot be
            # opened by zarr/tensorstore (chunk shape [0, L, K]): refuse it here, not in a reader.
            raise ShapeMismatchError(
                f"request {self.request_id}: a record holds at least 1 routing row, got 0 rows "
                f"(ids_TLK shape {tuple(ids.shape)}, start_row {self.start_row})"
            )
        if ids.shape[1] != len(self.layer_map):
            raise ShapeMismatchError(f"ids_TLK has {ids.shape[1]} layers but layer_map lists {len(self.layer_map)}")
        expected = routing_dtype(self.num_experts)
        if ids.dtype != expected:
            raise ShapeMismatchError(f"ids_TLK dtype must be {expected} for {self.num_experts} experts, got {ids.dtype}")
        if self.start_row < 0:
            raise ShapeMismatchError(f"start_row must be >= 0, got {self.start_row}")
        object.__setattr__(self, "final", bool(self.final))
        if self.total_rows is not None:
            if not self.final:
                raise ShapeMismatchError(
                    f"request {self.request_id}: total_rows is declared by the final record only, got "
                    f"total_rows={self.total_rows} on a part (final=False)"
                )
            if not ids.shape[0] <= self.total_rows <= self.start_row + ids.shape[0]:
                raise ShapeMismatchError(
                    f"request {self.request_id}: total_rows must be in {ids.shape[0]}..{self.start_row + ids.shape[0]} "
                    f"(this record's rows .. every row up to its end), got {self.total_rows}"
                )
        if self.shared_prefix is not None:
            self._check_shared_prefix()
        if not ids.flags.c_contiguous:
            object.__setattr__(self, "ids_TLK", np.ascontiguousarray(ids))
        object.__setattr__(self, "layer_map", tuple(int(x) for x in self.layer_map))
        if checksum_verified and self.crc32c != -1:
            return
        crc = checksum(self.ids_TLK)
        if self.crc32c not in (-1, crc):
            raise ShapeMismatchError(f"request {self.request_id}: checksum {self.crc32c:#010x} given, bytes hash to {crc:#010x}")
        object.__setattr__(self, "crc32c", crc)

    def _check_shared_prefix(self) -> None:
        shared = self.shared_prefix
        where = f"request {self.request_id!r} of rollout {self.rollout_id!r}"
        if not isinstance(shared, SharedPrefix):
            raise ShapeMismatchError(f"{where}: shared_prefix must be a SharedPrefix, got {type(shared).__name__}")
        if shared.request_id == self.request_id:
            raise InvalidIdError(
                f"{where}: shared_prefix names another request of the rollout, got its own id {shared.request_id!r}"
            )
        if self.start_row != shared.rows:
            raise ShapeMismatchError(
                f"{where}: with shared_prefix (rows 0..{shared.rows - 1} of {shared.request_id!r}) ids_TLK holds the rows "
                f"from start_row {shared.rows} on; expected start_row {shared.rows}, got {self.start_row}"
            )
        if not self.final:
            raise ShapeMismatchError(
                f"{where}: a record with shared_prefix holds the request's last rows; expected final=True, got False"
            )
        if self.total_rows is not None and self.total_rows != self.end_row:
            raise ShapeMismatchError(
                f"{where}: with shared_prefix the request has start_row + rows = {self.end_row} rows; expected total_rows "
                f"None or {self.end_row}, got {self.total_rows}"
            )
        copy = shared.ids_TLK
        if copy is not None and (copy.shape[1:] != self.ids_TLK.shape[1:] or copy.dtype != self.ids_TLK.dtype):
            raise ShapeMismatchError(
                f"{where}: shared_prefix.ids_TLK must be [{shared.rows}, {self.ids_TLK.shape[1]}, {self.ids_TLK.shape[2]}] "
                f"{self.ids_TLK.dtype} like ids_TLK, got {list(copy.shape)} {copy.dtype}"
            )

    def prefix_inlined(self) -> list[RequestRecord] | None:
        """This request with its shared rows inline, from ``shared_prefix.ids_TLK`` (None when
        the record has no shared prefix or no copy of its rows): what a writer stores when a
        store refuses the reference (:class:`~r3rdma.errors.SharedRowsMissingError`).

        Two records, committed together: the shared rows as a part (``final=False``, rows
        ``0 .. P - 1``) and this record's own rows as the final segment (``total_rows`` the
        whole request). The store makes them one request of two segments, the same rows and
        CRC-32C list a resolved reference gives when the source's rows ``0 .. P - 1`` lie in one
        segment (the usual case). Why not one record of every row: with replicas a request may
        be stored by reference on one node and inline on another (failover), and readers
        compare the copies' segment checksums; a node that already holds the request by
        reference takes both records as duplicates instead of refusing a conflicting one.
        """
        shared = self.shared_prefix
        if shared is None or shared.ids_TLK is None:
            return None
        prefix = RequestRecord(self.rollout_id, self.request_id, shared.ids_TLK, self.layer_map, self.num_experts, 0, final=False)
        rest = RequestRecord(
            self.rollout_id,
            self.request_id,
            self.ids_TLK,
            self.layer_map,
            self.num_experts,
            self.start_row,
            self.crc32c,
            total_rows=self.end_row,
            checksum_verified=True,
        )
        return [prefix, rest]

    @property
    def num_rows(self) -> int:
        """Rows (positions) this record holds."""
        return int(self.ids_TLK.shape[0])

    @property
    def end_row(self) -> int:
        """One past this record's last row."""
        return self.start_row + int(self.ids_TLK.shape[0])

    @property
    def top_k(self) -> int:
        """Experts chosen per token and layer (``K`` of ``ids_TLK``)."""
        return int(self.ids_TLK.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of the routing rows (``ids_TLK``), the unit of batching and back-pressure."""
        return int(self.ids_TLK.nbytes)


def batches_by_size(items, max_bytes: int, max_items: int | None = None):
    """Split ``items`` (anything with ``nbytes``) into consecutive runs of at most ``max_bytes``
    (and ``max_items``); an item larger than ``max_bytes`` forms a batch of its own."""
    batch: list = []
    size = 0
    for item in items:
        if batch and (size + item.nbytes > max_bytes or (max_items is not None and len(batch) >= max_items)):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item.nbytes
    if batch:
        yield batch
