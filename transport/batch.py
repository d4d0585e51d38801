"""Encoding and validation of a batch message: a request table plus one payload.

The payload is the concatenation of the requests' C-order ``ids_TLK`` bytes, in table
order, without gaps. Each table entry says where its bytes start and how to view them.
Encoding and decoding are shared by every transport implementation, so the loopback fake
and UCXX accept and refuse exactly the same messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from r3rdma.errors import CorruptDataError, InvalidIdError, ProtocolError, ShapeMismatchError
from r3rdma.ids import validate_id
from r3rdma.records import RequestRecord, SharedPrefix, routing_dtype

from .device import PayloadBuffer, payload_nbytes
from .limits import TransportLimits

__all__ = ["RecordMeta", "PackedBatch", "encode_records", "decode_batch", "is_probe", "ZERO_COPY_MIN_BYTES"]

#: A request at least this large is sent as its own frame, straight from its array, instead
#: of being copied into a coalesced frame with its neighbours. Measured on the 2-core VM: an
#: extra UCX message costs ~0.1 ms, a memcpy into a fresh array ~0.2 ms per MiB (page
#: faults included), so copying pays only for requests well below 1 MiB. (It was 32 MiB:
#: every MB-sized batch was copied whole, 15 ms for 64 MiB, a fifth of the transfer time.)
ZERO_COPY_MIN_BYTES = 256 << 10

_ENTRY_KEYS = frozenset(
    {
        "rollout_id",
        "request_id",
        "rows",
        "layers",
        "top_k",
        "dtype",
        "num_experts",
        "layer_map",
        "start_row",
        "crc32c",
        "offset",
        "final",
        "total_rows",
    }
)
#: Keys a request entry may carry beyond _ENTRY_KEYS, written only when set (as
#: _OPTIONAL_BATCH_KEYS): a receiver that predates one refuses the batch instead of storing a
#: shared-prefix record as a request of only its own rows.
_OPTIONAL_ENTRY_KEYS = frozenset({"shared_prefix"})
_BATCH_KEYS = frozenset({"seq", "frames", "records"})
#: Keys a batch header may carry beyond _BATCH_KEYS. A sender writes them only when they
#: differ from their default, so a receiver that predates one refuses the batch (unknown
#: key) rather than misreading it, and batches without them stay readable by every peer.
_OPTIONAL_BATCH_KEYS = frozenset({"probe"})
_DTYPES: dict[str, np.dtype] = {"uint8": np.dtype(np.uint8), "uint16": np.dtype(np.uint16), "int32": np.dtype(np.int32)}


@dataclass(frozen=True, slots=True)
class RecordMeta:
    """Everything about one request except its bytes: one row of a batch's table.

    ``crc32c`` is the sender's CRC-32C of the request's bytes, required on the wire: it is
    what makes a frame that arrived short (UCX does not report a shorter message) or a
    corrupted transfer fail as :class:`CorruptDataError` instead of being stored. ``None``
    exists only between packing device rows and hashing them (``r3rdma.write.device_push``);
    such a meta cannot be pushed. ``offset`` is the byte offset of the request in the payload.
    """

    rollout_id: str
    request_id: str
    rows: int
    layers: int
    top_k: int
    dtype: str
    num_experts: int
    layer_map: tuple[int, ...]
    start_row: int
    crc32c: int | None
    offset: int
    final: bool = True
    total_rows: int | None = None
    #: ``(source request id, rows)`` of the record's ``shared_prefix`` (its rows are not in
    #: the payload: the store resolves them), else None.
    shared_prefix: tuple[str, int] | None = None

    @property
    def nbytes(self) -> int:
        """The request's payload size in bytes (``rows * layers * top_k`` ids of ``dtype``)."""
        return self.rows * self.layers * self.top_k * _DTYPES[self.dtype].itemsize

    def to_wire(self) -> dict[str, Any]:
        """This meta as one row of a batch header's request table (msgpack-able; docs/PROTOCOL.md)."""
        entry = {
            "rollout_id": self.rollout_id,
            "request_id": self.request_id,
            "rows": self.rows,
            "layers": self.layers,
            "top_k": self.top_k,
            "dtype": self.dtype,
            "num_experts": self.num_experts,
            "layer_map": list(self.layer_map),
            "start_row": self.start_row,
            "crc32c": self.crc32c,
            "offset": self.offset,
            "final": self.final,
            "total_rows": self.total_rows,
        }
        if self.shared_prefix is not None:  # optional key: written only when set (_OPTIONAL_ENTRY_KEYS)
            entry["shared_prefix"] = {"request_id": self.shared_prefix[0], "rows": self.shared_prefix[1]}
        return entry

    @classmethod
    def of(cls, record: RequestRecord, offset: int) -> RecordMeta:
        """The meta of ``record``, its bytes at ``offset`` in the payload (its own rows only: a
        shared prefix travels as its reference, never its rows)."""
        ids = record.ids_TLK
        shared = record.shared_prefix
        return cls(
            record.rollout_id,
            record.request_id,
            int(ids.shape[0]),
            int(ids.shape[1]),
            int(ids.shape[2]),
            ids.dtype.name,
            record.num_experts,
            record.layer_map,
            record.start_row,
            record.crc32c,
            offset,
            record.final,
            record.total_rows,
            None if shared is None else (shared.request_id, shared.rows),
        )


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """A batch whose payload the caller already packed, possibly in GPU memory.

    ``payload`` is one contiguous buffer: a host object with the buffer protocol (numpy)
    or a CUDA array (``__cuda_array_interface__``: cupy, torch). ``metas`` describe the
    requests in payload order (offsets contiguous from 0). The caller must synchronise the
    stream that produced a device payload before pushing: ucxx ignores CAI streams.
    """

    metas: tuple[RecordMeta, ...]
    payload: PayloadBuffer
    #: A transfer probe: the receiver checks it like any batch and acks it, but never hands
    #: it to its handler (nothing is stored). See docs/PROTOCOL.md, "Probe batches".
    probe: bool = False

    @property
    def nbytes(self) -> int:
        """The payload's size in bytes: the sum of its requests'."""
        return sum(m.nbytes for m in self.metas)


def encode_records(records: Sequence[RequestRecord], *, max_frames: int) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """Return the request table and the payload frames of ``records`` (host memory).

    Large requests become their own frame without a copy; runs of small ones are coalesced
    into one frame each, so a batch of thousands of short requests is still a few messages.
    If that would exceed ``max_frames``, everything is coalesced into one frame.
    """
    table: list[dict[str, Any]] = []
    offset = 0
    for record in records:
        if not isinstance(record, RequestRecord):
            raise ShapeMismatchError(f"push takes RequestRecord values, got {type(record).__name__}")
        table.append(RecordMeta.of(record, offset).to_wire())
        offset += record.nbytes

    views = [r.ids_TLK.reshape(-1).view(np.uint8) for r in records]
    threshold = ZERO_COPY_MIN_BYTES
    while True:
        frames = _frames(views, threshold)
        if len(frames) <= max_frames:
            break
        threshold *= 2  # fewer, larger coalesced frames; ends with one frame at worst
    return table, frames


def _frames(views: list[np.ndarray], threshold: int) -> list[np.ndarray]:
    """Requests of ``threshold`` bytes or more as their own frames; runs of smaller ones
    concatenated into one frame per run."""
    frames: list[np.ndarray] = []
    pending: list[np.ndarray] = []

    def flush() -> None:
        if pending:
            frames.append(pending[0] if len(pending) == 1 else np.concatenate(pending))
            pending.clear()

    for view in views:
        if view.nbytes >= threshold:
            flush()
            frames.append(view)
        elif view.nbytes:
            pending.append(view)
    flush()
    return frames


def batch_header(seq: int, table: list[dict[str, Any]], frames: Sequence[int], *, probe: bool = False) -> dict[str, Any]:
    header: dict[str, Any] = {"seq": seq, "frames": list(frames), "records": table}
    if probe:
        header["probe"] = True  # optional key: written only when set (see _OPTIONAL_BATCH_KEYS)
    return header


def is_probe(header: dict[str, Any]) -> bool:
    """Whether a header that passed :func:`check_batch_header` marks a probe batch."""
    return header.get("probe", False)


def check_batch_header(header: dict[str, Any], payload_len: int, limits: TransportLimits) -> list[RecordMeta]:
    """Validate a batch header against the announced payload length; return its table.

    Everything is checked before the payload is received: key sets, types, id syntax,
    dtype rule, shapes, and that the entries tile the payload exactly, in order.
    """
    keys = set(header)
    if not _BATCH_KEYS <= keys <= _BATCH_KEYS | _OPTIONAL_BATCH_KEYS:
        raise ProtocolError(
            f"batch header keys must be {sorted(_BATCH_KEYS)}, optionally with {sorted(_OPTIONAL_BATCH_KEYS)}, "
            f"got {sorted(map(str, keys))}"
        )
    _int(header["seq"], "seq", 0)
    if not isinstance(header.get("probe", False), bool):
        raise ProtocolError(f"batch probe must be a bool, got {header['probe']!r}")
    frames = _list(header["frames"], "batch frames", 0, limits.max_frames)
    for i, n in enumerate(frames):
        _int(n, f"frames[{i}]", 1)
    if sum(frames) != payload_len:
        raise ProtocolError(f"batch frames add up to {sum(frames)} bytes but the preamble announced {payload_len}")
    entries = _list(header["records"], "batch records", 1, limits.max_records)
    metas = []
    offset = 0
    for i, entry in enumerate(entries):
        meta = _check_entry(entry, i)
        if meta.offset != offset:
            raise ProtocolError(
                f"records[{i}] ({meta.request_id}) must start at payload byte {offset} "
                f"(entries tile the payload in order), got offset {meta.offset}"
            )
        offset += meta.nbytes
        if offset > payload_len:
            raise ProtocolError(f"records[{i}] ({meta.request_id}) ends at byte {offset}, past the {payload_len}-byte payload")
        metas.append(meta)
    if offset != payload_len:
        raise ProtocolError(f"records describe {offset} payload bytes but the preamble announced {payload_len}")
    return metas


def decode_batch(metas: Sequence[RecordMeta], payload: np.ndarray, hashed: Sequence[int] | None = None) -> list[RequestRecord]:
    """Rebuild RequestRecords over ``payload`` (uint8, already received); checksums re-checked.

    ``hashed[i]``, when given, is the CRC-32C the receiver computed over request i's bytes
    (a :class:`~.receive.FrameHasher` result); otherwise each request is hashed here.
    Records are views into ``payload`` where alignment allows (no copy). A checksum mismatch
    raises :class:`CorruptDataError` for the whole batch.
    """
    assert payload.dtype == np.uint8 and payload.ndim == 1
    records = []
    for i, meta in enumerate(metas):
        crc = None if hashed is None else hashed[i]
        if crc is not None and meta.crc32c is not None and crc != meta.crc32c:
            raise CorruptDataError(
                f"rollout {meta.rollout_id} request {meta.request_id}: payload bytes hash to "
                f"{crc:#010x}, the sender's crc32c is {meta.crc32c:#010x}"
            )
        dtype = _DTYPES[meta.dtype]
        raw = payload[meta.offset : meta.offset + meta.nbytes]
        if meta.offset % dtype.itemsize:
            raw = raw.copy()  # keep multi-byte ids aligned for downstream kernels
        ids_TLK = raw.view(dtype).reshape(meta.rows, meta.layers, meta.top_k)
        try:
            records.append(
                RequestRecord(
                    meta.rollout_id,
                    meta.request_id,
                    ids_TLK,
                    meta.layer_map,
                    meta.num_experts,
                    meta.start_row,
                    crc if crc is not None else (-1 if meta.crc32c is None else meta.crc32c),
                    final=meta.final,
                    total_rows=meta.total_rows,
                    checksum_verified=crc is not None,  # a copy for alignment has the same bytes
                    shared_prefix=None if meta.shared_prefix is None else SharedPrefix(*meta.shared_prefix),
                )
            )
        except ShapeMismatchError as e:
            # Shapes and dtypes were validated with the header, so what is left is the checksum.
            raise CorruptDataError(
                f"rollout {meta.rollout_id} request {meta.request_id}: payload bytes do not match the sender's crc32c ({e})"
            ) from e
    return records


def _check_entry(entry: object, i: int) -> RecordMeta:
    if not isinstance(entry, dict) or not _ENTRY_KEYS <= set(entry) <= _ENTRY_KEYS | _OPTIONAL_ENTRY_KEYS:
        got = sorted(map(str, entry)) if isinstance(entry, dict) else type(entry).__name__
        raise ProtocolError(
            f"records[{i}] must be a map with keys {sorted(_ENTRY_KEYS)}, optionally with "
            f"{sorted(_OPTIONAL_ENTRY_KEYS)}, got {got}"
        )
    try:
        rollout_id = validate_id(entry["rollout_id"], f"records[{i}].rollout_id")
        request_id = validate_id(entry["request_id"], f"records[{i}].request_id")
    except InvalidIdError as e:
        raise ProtocolError(str(e)) from e
    rows = _int(entry["rows"], f"records[{i}].rows", 1)  # a 0-row record stores nothing readable
    layers = _int(entry["layers"], f"records[{i}].layers", 1)
    top_k = _int(entry["top_k"], f"records[{i}].top_k", 1)
    num_experts = _int(entry["num_experts"], f"records[{i}].num_experts", 1)
    start_row = _int(entry["start_row"], f"records[{i}].start_row", 0)
    offset = _int(entry["offset"], f"records[{i}].offset", 0)
    dtype = entry["dtype"]
    expected = routing_dtype(num_experts) if num_experts < 1 << 31 else None
    if expected is None or dtype != expected.name:
        raise ProtocolError(
            f"records[{i}].dtype must be {expected.name if expected else 'int32 with < 2**31 experts'} "
            f"for {num_experts} experts, got {dtype!r}"
        )
    layer_map = _list(entry["layer_map"], f"records[{i}].layer_map", layers, layers)
    for j, layer in enumerate(layer_map):
        _int(layer, f"records[{i}].layer_map[{j}]", 0)
    crc = entry["crc32c"]
    # Required: the receiver cannot tell a short frame from a full one (UCX does not report
    # the length received), so only the sender's checksum proves the bytes arrived whole.
    _int(crc, f"records[{i}].crc32c (the sender's CRC-32C, required)", 0)
    if crc > 0xFFFFFFFF:
        raise ProtocolError(f"records[{i}].crc32c must fit 32 bits, got {crc}")
    final = entry["final"]
    if not isinstance(final, bool):
        raise ProtocolError(f"records[{i}].final must be a bool, got {final!r}")
    total_rows = entry["total_rows"]
    if total_rows is not None:
        _int(total_rows, f"records[{i}].total_rows", 0)
        if not final or not rows <= total_rows <= start_row + rows:
            raise ProtocolError(
                f"records[{i}].total_rows must be null on a part (final=false) and in "
                f"{rows}..{start_row + rows} on a final record, got {total_rows} (final={final})"
            )
    return RecordMeta(
        rollout_id,
        request_id,
        rows,
        layers,
        top_k,
        dtype,
        num_experts,
        tuple(layer_map),
        start_row,
        crc,
        offset,
        final,
        total_rows,
        _check_shared_prefix(entry, i, request_id, start_row, final, total_rows),
    )


def _check_shared_prefix(
    entry: dict, i: int, request_id: str, start_row: int, final: bool, total_rows: int | None
) -> tuple[str, int] | None:
    """The entry's ``shared_prefix`` as ``(source request id, rows)``, checked as
    :class:`~r3rdma.records.RequestRecord` checks it (before any payload byte is received)."""
    if "shared_prefix" not in entry:
        return None
    shared = entry["shared_prefix"]
    if not isinstance(shared, dict) or set(shared) != {"request_id", "rows"}:
        got = sorted(map(str, shared)) if isinstance(shared, dict) else type(shared).__name__
        raise ProtocolError(f"records[{i}].shared_prefix must be a map with keys ['request_id', 'rows'], got {got}")
    try:
        source = validate_id(shared["request_id"], f"records[{i}].shared_prefix.request_id")
    except InvalidIdError as e:
        raise ProtocolError(str(e)) from e
    rows = _int(shared["rows"], f"records[{i}].shared_prefix.rows", 1)
    if source == request_id or start_row != rows or not final or total_rows not in (None, start_row + entry["rows"]):
        raise ProtocolError(
            f"records[{i}] ({request_id}) with shared_prefix (rows 0..{rows - 1} of {source!r}) must name another "
            f"request and be final with start_row {rows} (total_rows null or start_row + rows), got start_row "
            f"{start_row}, final={final}, total_rows={total_rows}"
        )
    return source, rows


def _list(value: object, what: str, least: int, most: int) -> list:
    if not isinstance(value, list) or not least <= len(value) <= most:
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        size = least if least == most else f"{least}..{most}"
        raise ProtocolError(f"{what} must be a list of {size} entries, got {got}")
    return value


def _int(value: object, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ProtocolError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


def packed_table(batch: PackedBatch) -> list[dict[str, Any]]:
    """The request table of a caller-packed batch, checked against its payload size."""
    offset = 0
    for i, meta in enumerate(batch.metas):
        if meta.offset != offset:
            raise ShapeMismatchError(f"PackedBatch.metas[{i}] must start at byte {offset}, got {meta.offset}")
        if meta.crc32c is None:
            raise ProtocolError(
                f"PackedBatch.metas[{i}] ({meta.request_id}) has no crc32c: every payload needs the sender's "
                "CRC-32C (device rows: r3rdma.write.device_push.push_device_rows hashes a pinned copy)"
            )
        offset += meta.nbytes
    n = payload_nbytes(batch.payload)
    if n != offset:
        raise ShapeMismatchError(f"PackedBatch payload holds {n} bytes but its metas describe {offset}")
    return [m.to_wire() for m in batch.metas]
