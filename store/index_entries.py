"""The rollout index's entries as types: where a request's rows live.

On disk (docs/FORMAT.md) an index part maps request ids to JSON objects: a visible request's
``{"rows", "start_row", "segments": [{"array", "offset", "rows", "start_row", "crc32c"}]}``,
and an incomplete request's pending segments, which add ``"final"`` and ``"total_rows"``. In
memory the writer, the assembly rules and the reader use the classes below; JSON is met only
at the boundary: :func:`parse_requests` / :func:`parse_pending` (checked, for documents read)
and ``to_json`` (for documents written).

An entry is shared between the writer's index, the copy a snapshot encodes, and readers on
other threads, so it is never changed in place: a change is a new entry (a later part replaces
it). Not ``frozen=True`` for speed: a frozen dataclass's ``__init__`` sets each field through
``object.__setattr__``, ~4x a plain slot write, and a fresh reader builds ~37k entries and
segments from an index part of 16k requests: frozen, that parse took ~1.4x as long as with the
dict entries these replaced; slotted, the same (the round-3 report has the numbers).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from r3rdma.errors import CorruptDataError

__all__ = [
    "Segment",
    "PendingSegment",
    "RequestEntry",
    "parse_requests",
    "parse_pending",
    "malformed",
    "shard_entry",
    "chunk_sizes_of",
    "is_group_major",
    "shard_entry_ok",
    "C_ORDER_SIZES",
    "GROUP_MAJOR_SIZES",
]


@dataclass(slots=True)
class Segment:
    """Rows ``start_row .. start_row + rows - 1`` of a request, stored as ``array[offset :
    offset + rows]``; ``crc32c`` is the CRC-32C of those rows in C order, in the stored dtype."""

    array: str
    offset: int
    rows: int
    start_row: int
    crc32c: int

    @property
    def end_row(self) -> int:
        """The row after the segment's last."""
        return self.start_row + self.rows

    def to_json(self) -> dict[str, Any]:
        """The segment as stored in an index document (docs/FORMAT.md)."""
        return {"array": self.array, "offset": self.offset, "rows": self.rows, "start_row": self.start_row, "crc32c": self.crc32c}


@dataclass(slots=True)
class PendingSegment(Segment):
    """A stored segment of a request that is not complete yet (readers ignore it).

    ``final``: the engine's last segment of the request (or of a turn); ``total_rows``: the
    request's whole row count, when that engine declared it (disaggregated decode), else None.
    """

    final: bool
    total_rows: int | None

    @property
    def span_start(self) -> int:
        """The first row of the span a final segment declares: ``end_row - total_rows``, or
        its own first row when it declares none."""
        return self.start_row if self.total_rows is None else self.end_row - self.total_rows

    def visible(self) -> Segment:
        """This segment as a visible request lists it (without ``final`` / ``total_rows``)."""
        return Segment(self.array, self.offset, self.rows, self.start_row, self.crc32c)

    def to_json(self) -> dict[str, Any]:
        """The pending segment as stored in an index document's ``pending`` (with ``final`` and
        ``total_rows``)."""
        return {
            "array": self.array,
            "offset": self.offset,
            "rows": self.rows,
            "start_row": self.start_row,
            "crc32c": self.crc32c,
            "final": self.final,
            "total_rows": self.total_rows,
        }


@dataclass(slots=True)
class RequestEntry:
    """A visible request: rows ``start_row .. start_row + rows - 1``, the concatenation of its
    ``segments`` in row order (several after later turns of a conversation)."""

    rows: int
    start_row: int
    segments: tuple[Segment, ...]

    @property
    def end_row(self) -> int:
        """The row after the request's last."""
        return self.start_row + self.rows

    def to_json(self) -> dict[str, Any]:
        """The entry as stored in an index document's ``requests``."""
        return {"rows": self.rows, "start_row": self.start_row, "segments": [s.to_json() for s in self.segments]}


# -- parsing (documents read from disk or HTTP) ------------------------------------------------


Problem = Callable[[str], Exception]  # why -> the error to raise (names the rollout and document)


def malformed(rollout_id: str, where: str, what: str, why: str) -> CorruptDataError:
    """The error for index document ``what`` of a rollout on ``where`` that is malformed."""
    return CorruptDataError(f"{what} of rollout {rollout_id!r} on {where} is malformed: {why}")


def parse_requests(raw: dict[str, Any], array_ok: Callable[[str], bool], problem: Problem) -> dict[str, RequestEntry]:
    """A part's ``requests`` map as entries, each value checked (``problem(why)`` raised for the
    first malformed one). ``array_ok``: whether a segment may name that array.

    One pass checks and builds, the checks inlined: at 16k requests a part holds ~20k
    segments, which a fresh reader parses on opening the rollout (compare.py in the round-3
    notes: a check per value through helper functions made the parse ~1.6x as slow).
    """
    out: dict[str, RequestEntry] = {}
    for rid, entry in raw.items():
        segments = entry.get("segments") if entry.__class__ is dict else None
        rows = entry.get("rows") if segments else None
        start = entry.get("start_row") if segments else None
        if segments.__class__ is not list or rows.__class__ is not int or rows < 0 or start.__class__ is not int or start < 0:
            raise problem(f"request {rid!r} needs rows, start_row and a non-empty segment list")
        parsed = []
        total = 0
        for seg in segments:
            one = _segment(seg, array_ok)
            if one is None:
                raise problem(f"request {rid!r} has a segment {str(seg)[:200]}")
            parsed.append(one)
            total += one.rows
        if total != rows:
            raise problem(f"request {rid!r}: segments hold {total} rows, entry says {rows}")
        out[rid] = RequestEntry(rows, start, tuple(parsed))
    return out


def parse_pending(
    raw: dict[str, Any], array_ok: Callable[[str], bool], problem: Problem
) -> dict[str, tuple[PendingSegment, ...]]:
    """A part's ``pending`` map (request id -> its whole list of pending segments) as
    :class:`PendingSegment` tuples, checked as :func:`parse_requests` checks segments.

    ``final`` and ``total_rows`` are read as written (``False`` / None when absent): readers
    ignore pending segments, and the writer wrote both.
    """
    out: dict[str, tuple[PendingSegment, ...]] = {}
    for rid, segments in raw.items():
        parsed = []
        for seg in segments:
            one = _segment(seg, array_ok)
            if one is None:
                raise problem(f"pending request {rid!r} has a segment {str(seg)[:200]}")
            parsed.append(
                PendingSegment(
                    one.array, one.offset, one.rows, one.start_row, one.crc32c, seg.get("final", False), seg.get("total_rows")
                )
            )
        out[rid] = tuple(parsed)
    return out


def _segment(seg: Any, array_ok: Callable[[str], bool]) -> Segment | None:
    """``seg`` (a segment's JSON object) as a :class:`Segment`, or None when it is malformed.

    Values are parsed JSON, so an int is exactly ``int`` (``bool`` is another class: refused)."""
    if seg.__class__ is not dict:
        return None
    get = seg.get
    array, offset, rows, start, crc = get("array"), get("offset"), get("rows"), get("start_row"), get("crc32c")
    if (
        array.__class__ is str
        and offset.__class__ is int
        and rows.__class__ is int
        and start.__class__ is int
        and crc.__class__ is int
        and offset >= 0
        and rows >= 1
        and start >= 0
        and 0 <= crc < 1 << 32
        and array_ok(array)
    ):
        return Segment(array, offset, rows, start, crc)
    return None


# -- a batch array's shard, as an index part copies it -------------------------------------------


# The key of a ``shards`` entry's chunk sizes names their order: the shard index's (row chunk,
# then layer group; format 3), or layer group major (layer group, then row chunk; format 4).
# A new key, not a flag beside the old one: a reader of format 3 knows only ``chunk_sizes`` (or
# format 2's ``chunks``), so an entry of the other order is malformed to it and refused, never
# read as index order (its offsets would be wrong).
C_ORDER_SIZES = "chunk_sizes"
GROUP_MAJOR_SIZES = "chunk_sizes_group_major"


def shard_entry(
    rows: int, chunk_rows: int, layers_per_chunk: int, zstd: bool, sizes: np.ndarray, group_major: bool = False
) -> dict[str, Any]:
    """An index part's ``shards[array]`` (format 3 and 4): the array's rows, its inner chunk
    shape (``chunk_rows`` x ``layers_per_chunk``), whether chunks are zstd-compressed, and each
    inner chunk's stored bytes in the order the chunks lie in the shard, as base64 of
    little-endian uint32: under ``chunk_sizes`` in the shard index's order, under
    ``chunk_sizes_group_major`` layer group by layer group (``group_major``: how the writer laid
    the shard out, :func:`r3rdma.store.shard_writer.encode_batch_array`). The chunks lie back to
    back after the shard index, so offsets follow.

    Why base64 and no offsets: layer groups multiply the chunks (x6-12 at the default), and
    format 2's ``chunks`` list of JSON ints (offset and size of each) was already the larger
    half of an index part's bytes for short requests; JSON parses a list of 300k ints at
    ~30 ms on the CPU VM, a 1.6 MB string in under 2 ms.
    """
    raw = np.ascontiguousarray(sizes, dtype="<u4").tobytes()
    return {
        "rows": rows,
        "chunk_rows": chunk_rows,
        "layers_per_chunk": layers_per_chunk,
        "zstd": zstd,
        GROUP_MAJOR_SIZES if group_major else C_ORDER_SIZES: base64.b64encode(raw).decode("ascii"),
    }


def is_group_major(shard: dict[str, Any]) -> bool:
    """Whether a ``shards`` entry's chunks lie layer group major in the shard (format 4)."""
    return GROUP_MAJOR_SIZES in shard


def chunk_sizes_of(shard: dict[str, Any]) -> np.ndarray:
    """The chunk sizes of a format-3 or format-4 ``shards`` entry, decoded (uint32 per inner
    chunk, in the order the chunks lie in the shard: :func:`is_group_major` says which);
    :class:`CorruptDataError` when they are not base64 of whole uint32s."""
    try:
        raw = base64.b64decode(shard[GROUP_MAJOR_SIZES if is_group_major(shard) else C_ORDER_SIZES], validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise CorruptDataError(f"a shard entry's chunk sizes are not base64: {e}") from e
    if not raw or len(raw) % 4:
        raise CorruptDataError(f"a shard entry's chunk sizes hold {len(raw)} bytes, not whole uint32 sizes")
    return np.frombuffer(raw, dtype="<u4")


def shard_entry_ok(info: Any) -> bool:
    """Whether ``info`` is a well-formed ``shards`` entry: format 3 or 4 (:func:`shard_entry`:
    one size key, its list's length a multiple of the row chunks; checked against the layer
    groups when the array is read) or format 2 (``"chunks"``: ``[offset, nbytes, ...]`` per
    row chunk, -1 for a chunk zarr left out)."""
    if not isinstance(info, dict) or not _int_at_least(info.get("rows"), 1) or not _int_at_least(info.get("chunk_rows"), 1):
        return False
    if not isinstance(info.get("zstd"), bool):
        return False
    row_chunks = -(-info["rows"] // info["chunk_rows"])
    keys = [key for key in (C_ORDER_SIZES, GROUP_MAJOR_SIZES) if key in info]
    if keys:
        text = info[keys[0]]
        if len(keys) > 1 or not isinstance(text, str) or len(text) % 4 or not _int_at_least(info.get("layers_per_chunk"), 1):
            return False
        nbytes = len(text) // 4 * 3 - text[-2:].count("=")
        return nbytes > 0 and nbytes % (4 * row_chunks) == 0
    chunks = info.get("chunks")
    return (
        isinstance(chunks, list)
        and len(chunks) == 2 * row_chunks
        and (not chunks or (set(map(type, chunks)) == {int} and min(chunks) >= -1))
    )  # C loops: bool is not int here


def _int_at_least(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
