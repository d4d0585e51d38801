"""The rollout index (format 2): an entry point that grows by a counter, and immutable parts.

A rollout's index says which requests it holds and where their rows are. Format 1 kept it in
one document, rewritten (and fsynced) whole by every commit: at 16k requests each commit wrote
2.4 MB, so commit cost grew with the rollout and a step's commits cost O(n^2), and every reader
refresh fetched and parsed the whole of it again. Format 2 splits it::

    <rollout>/zarr.json            group; attributes.r3rdma = the entry point:
        {"format_version": 2, "uid": "<hex>", "parts": N,
         "num_layers": L, "top_k": K, "num_experts": E, "dtype": "uint8", "layer_map": [...]}
    <rollout>/i00000001/zarr.json  group; attributes.r3rdma = index part 1 (immutable)
    <rollout>/b00000001/           the batch array part 1 added (a part may add none)

Part ``n`` (``{"part": n, "uid": ..., "arrays": [...], "shards": {...}, "requests": {...},
"pending": {...}}``) says what commit ``n`` changed: ``shards`` gives each array it added its
row count, chunk rows, codec and the byte ranges of its chunks (a copy of the shard index, so a
reader of a few requests per array needs no other GET than the rows'); ``requests`` maps each request it made visible, extended (a
later turn) or replaced (``only_last_turn``) to its whole entry ``{"rows", "start_row",
"segments": [{"array", "offset", "rows", "start_row", "crc32c"}]}``; ``pending`` maps each
request whose incomplete parts changed to its whole new list of pending segments (``[]``: none
left). The index is parts ``1..N`` applied in order, later entries replacing earlier ones. A
commit writes its array and its part (each fsynced), then replaces the entry point atomically
with ``parts`` one higher: O(batch) bytes however large the rollout. Parts above ``N`` are
leftovers of a crash and never read; ``uid`` (new for each rollout created) lets a reader
that cached parts notice that a rollout was deleted and created again under the same id.

Snapshots: one part per commit made a fresh reader fetch and check ~1,700 documents per node
at 16k requests (1.9 s to open on the H100 host). So the writer merges parts ``1..S`` into an
immutable snapshot ``<rollout>/s<S>/zarr.json`` (``{"snapshot": S, "uid": ..., "arrays",
"shards", "requests", "pending"}``: the index after part ``S``), off the commit path, and the
entry point names it (``"snapshot": S``). A reader that has not seen part ``S`` fetches the
snapshot and the parts after it; one that has fetches only the parts after what it has. Parts
stay (a reader of an older r3rdma reads them all). A snapshot is durable before an entry point
names it; one no entry point names is a crash's leftover, removed when the root is opened.

Readers fetch the entry point, then only the snapshot and parts they have not seen.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import KeysView, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from r3rdma.errors import CorruptDataError
from r3rdma.store.layout import (
    INDEX_KEY,
    PART_PREFIX,
    SNAPSHOT_PREFIX,
    numbered_name,
    parse_array_name,
    parse_numbered_name,
)

__all__ = [
    "INDEX_FORMAT_VERSION",
    "GEOMETRY_KEYS",
    "RolloutIndex",
    "ColumnRequests",
    "part_name",
    "parse_part_name",
    "snapshot_name",
    "parse_snapshot_name",
    "check_snapshot",
    "encode_requests",
    "decode_requests",
    "check_entry",
    "check_part",
    "load_index",
    "new_uid",
    "parse_attrs",
    "read_file",
    "StalePartError",
]

INDEX_FORMAT_VERSION = 2
GEOMETRY_KEYS = ("num_layers", "top_k", "num_experts", "dtype", "layer_map")


def part_name(seq: int) -> str:
    return numbered_name(PART_PREFIX, seq)


def parse_part_name(name: str) -> int | None:
    return parse_numbered_name(PART_PREFIX, name)


def snapshot_name(seq: int) -> str:
    return numbered_name(SNAPSHOT_PREFIX, seq)


def parse_snapshot_name(name: str) -> int | None:
    return parse_numbered_name(SNAPSHOT_PREFIX, name)


def new_uid() -> str:
    return secrets.token_hex(8)


@dataclass
class RolloutIndex:
    """A rollout's index as parts ``1..parts`` applied in order: what readers and the writer use.

    ``requests``: visible requests; ``pending``: stored parts of incomplete requests (readers
    ignore them); ``arrays``: batch arrays in commit order. A format-1 index loads as one
    snapshot (``parts`` 0, ``version`` 1).
    """

    uid: str
    geometry: dict[str, Any] = field(default_factory=dict)
    parts: int = 0
    requests: MutableMapping[str, dict[str, Any]] = field(default_factory=dict)  # a dict, or ColumnRequests from a snapshot
    pending: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    arrays: list[str] = field(default_factory=list)
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)
    version: int = INDEX_FORMAT_VERSION
    snapshot: int = 0  # the snapshot the entry point names (0: none)

    @classmethod
    def from_format_1(cls, rollout_id: str, index: dict[str, Any], where: str) -> "RolloutIndex":
        """The one-document index of format 1 (read-only: writers refuse format-1 roots)."""
        _check_changes(rollout_id, index, set(index.get("arrays") or []), where, "index")
        geometry = {k: index[k] for k in GEOMETRY_KEYS if k in index}
        if index["requests"]:
            _check_geometry(rollout_id, geometry, where)
        return cls(uid="format-1", geometry=geometry, requests=dict(index["requests"]),
                   pending={k: v for k, v in index.get("pending", {}).items() if v},
                   arrays=list(index["arrays"]), version=1)

    @classmethod
    def from_snapshot(cls, doc: dict[str, Any], geometry: dict[str, Any]) -> "RolloutIndex":
        """The index after part ``doc["snapshot"]`` (a snapshot checked with :func:`check_snapshot`:
        its ``requests`` already decoded from columns)."""
        return cls(uid=doc["uid"], geometry=geometry, parts=doc["snapshot"], requests=doc["requests"],
                   pending={k: v for k, v in doc.get("pending", {}).items() if v}, arrays=list(doc["arrays"]),
                   shards=dict(doc.get("shards", {})), snapshot=doc["snapshot"])

    def copy(self) -> "RolloutIndex":
        """A copy later commits do not change (entries themselves are never changed in place)."""
        return RolloutIndex(uid=self.uid, geometry=self.geometry, parts=self.parts, requests=self.requests.copy(),
                            pending=dict(self.pending), arrays=list(self.arrays), shards=dict(self.shards),
                            version=self.version, snapshot=self.snapshot)

    def snapshot_document(self) -> dict[str, Any]:
        """This index as a snapshot of its parts, requests in columns (:func:`encode_requests`)."""
        return {"snapshot": self.parts, "uid": self.uid, "arrays": self.arrays, "shards": self.shards,
                "requests": encode_requests(self.requests, self.arrays), "pending": self.pending}

    def apply(self, part: dict[str, Any]) -> None:
        """Apply the next part (already checked with :func:`check_part`)."""
        assert part["part"] == self.parts + 1, (part["part"], self.parts)
        self.requests.update(part["requests"])
        for rid, segments in part.get("pending", {}).items():
            if segments:
                self.pending[rid] = segments
            else:
                self.pending.pop(rid, None)
        self.arrays.extend(part["arrays"])
        self.shards.update(part.get("shards", {}))
        self.parts = part["part"]

    def entry_document(self) -> dict[str, Any]:
        """The entry point's attributes (``attributes.r3rdma`` of the rollout's ``zarr.json``)."""
        doc = {"format_version": INDEX_FORMAT_VERSION, "uid": self.uid, "parts": self.parts, **self.geometry}
        if self.snapshot:
            doc["snapshot"] = self.snapshot
        return doc

    def as_format_1(self) -> dict[str, Any]:
        """The merged index in format 1's one-document shape (``GET /v1/rollouts/{id}``)."""
        out = {"format_version": self.version, **self.geometry, "arrays": self.arrays, "requests": dict(self.requests)}
        if self.pending:
            out["pending"] = self.pending
        return out


def check_entry(rollout_id: str, attrs: Any, where: str) -> dict[str, Any] | None:
    """The index entry of a rollout group's attributes, checked; None when it has none.

    Returns the format-2 entry point, or a format-1 whole index (``format_version`` 1). A
    version this code does not know raises :class:`CorruptDataError` naming it.
    """
    index = attrs.get(INDEX_KEY) if isinstance(attrs, dict) else None
    if index is None:
        return None
    if not isinstance(index, dict):
        raise _bad(rollout_id, where, "index", "the index must be a map")
    version = index.get("format_version", 1)
    if version == 1:
        if "requests" not in index:
            return None
        return index
    if version != INDEX_FORMAT_VERSION:
        raise CorruptDataError(
            f"rollout {rollout_id!r} on {where} has index format version {version!r}; this r3rdma reads "
            f"versions 1 and {INDEX_FORMAT_VERSION}: upgrade r3rdma to read it"
        )
    if not _is_int(index.get("parts"), 1) or not isinstance(index.get("uid"), str):
        raise _bad(rollout_id, where, "entry point", f"needs 'parts' >= 1 and a 'uid', got {str(index)[:200]}")
    if "snapshot" in index and not (_is_int(index["snapshot"], 1) and index["snapshot"] <= index["parts"]):
        raise _bad(rollout_id, where, "entry point", f"'snapshot' must be a part number 1..{index['parts']}, "
                                                     f"got {index['snapshot']!r}")
    _check_geometry(rollout_id, index, where)
    return index


def check_part(rollout_id: str, seq: int, uid: str, attrs: Any, where: str, *, key: str = "part") -> dict[str, Any]:
    """Index part ``seq`` from its group's attributes, checked against the entry point's uid
    (``key="snapshot"``: the snapshot of parts ``1..seq``, :func:`check_snapshot`)."""
    part = attrs.get(INDEX_KEY) if isinstance(attrs, dict) else None
    what = f"index {key} {(part_name if key == 'part' else snapshot_name)(seq)}"
    if not isinstance(part, dict):
        raise _bad(rollout_id, where, what, "has no r3rdma attributes")
    if part.get(key) != seq:
        raise _bad(rollout_id, where, what, f"says it is {key} {part.get(key)!r}")
    if part.get("uid") != uid:
        # Written for another rollout of the same id (deleted and created again): the caller
        # re-reads the entry point.
        raise StalePartError(rollout_id, where, seq)
    arrays = part.get("arrays")
    if not isinstance(arrays, list) or not all(isinstance(a, str) and parse_array_name(a) is not None for a in arrays):
        raise _bad(rollout_id, where, what, f"'arrays' must list batch array names, got {str(arrays)[:100]}")
    shards = part.get("shards", {})
    listed = set(arrays)  # a snapshot lists every array: a list lookup per shard was O(n^2)
    if not isinstance(shards, dict) or not all(name in listed and _shard_ok(info) for name, info in shards.items()):
        raise _bad(rollout_id, where, what, f"'shards' must describe arrays it adds, got {str(shards)[:200]}")
    return _check_changes(rollout_id, part, None, where, what)


def check_snapshot(rollout_id: str, seq: int, uid: str, attrs: Any, where: str) -> dict[str, Any]:
    """Index snapshot ``seq`` (parts ``1..seq`` merged) from its group's attributes, checked, its
    ``requests`` decoded from columns into the parts' ``{id: entry}`` shape."""
    doc = attrs.get(INDEX_KEY) if isinstance(attrs, dict) else None
    columns = doc.get("requests") if isinstance(doc, dict) else None
    # Checked as a part with no requests (geometry, arrays, shards, pending), then the columns.
    checked = check_part(rollout_id, seq, uid, {INDEX_KEY: {**doc, "requests": {}}} if isinstance(doc, dict) else attrs,
                         where, key="snapshot")
    return {**checked, "requests": decode_requests(columns, checked["arrays"], rollout_id, where,
                                                   f"index snapshot {snapshot_name(seq)}")}


_COLUMNS = ("ids", "rows", "start_row", "segments")
_SEGMENT_COLUMNS = ("seg_array", "seg_offset", "seg_rows", "seg_start_row", "seg_crc32c")


def encode_requests(requests: dict[str, dict[str, Any]], arrays: list[str]) -> dict[str, list]:
    """Request entries as columns: a snapshot's ``requests``.

    Why columns: at 16k requests the ``{id: {"rows", "start_row", "segments": [{...}]}}`` form
    is ~50k small JSON objects, which took a fresh reader ~90 ms to parse and ~130 ms to check
    one by one on the CPU VM. Columns are flat lists of ints (``segments``: each request's
    segment count; ``seg_array``: an index into ``arrays``), parsed fast and checked with
    numpy at once.
    """
    where = {name: i for i, name in enumerate(arrays)}
    out: dict[str, list] = {key: [] for key in (*_COLUMNS, *_SEGMENT_COLUMNS)}
    ids, rows, start, count = out["ids"], out["rows"], out["start_row"], out["segments"]
    s_array, s_offset, s_rows, s_start, s_crc = (out[k] for k in _SEGMENT_COLUMNS)
    for rid, entry in requests.items():
        ids.append(rid)
        rows.append(entry["rows"])
        start.append(entry["start_row"])
        count.append(len(entry["segments"]))
        for seg in entry["segments"]:
            s_array.append(where[seg["array"]])
            s_offset.append(seg["offset"])
            s_rows.append(seg["rows"])
            s_start.append(seg["start_row"])
            s_crc.append(seg["crc32c"])
    return out


class ColumnRequests(MutableMapping):
    """A snapshot's request entries, kept as its columns: ``{id: {"rows", "start_row",
    "segments": [...]}}`` to whoever looks an id up, each entry built when it is looked up.

    Why: decoding a snapshot into entry dicts (one dict and one list per request, one dict per
    segment) was half of a fresh reader's index open at 16k requests (~13 ms per 8k-request
    node on the CPU VM), and those objects were walked again by the cyclic GC; a reader looks up
    only the requests it reads. Ids map to their column row (an int) until an entry replaces
    them (a later part); ``keys()`` is a plain dict's, so set operations on ids stay C-level.
    """

    def __init__(self, keys: dict[str, Any], columns: tuple[list, ...]) -> None:
        self._keys = keys  # request id -> its row in the columns, or an entry set since
        self._columns = columns  # rows, start_row, first segment, segments, then the segment columns

    def __getitem__(self, rid: str) -> dict[str, Any]:
        at = self._keys[rid]
        if at.__class__ is not int:
            return at
        rows, start, first, count, s_array, s_offset, s_rows, s_start, s_crc = self._columns
        k = first[at]
        entry = {"rows": rows[at], "start_row": start[at],
                 "segments": [{"array": s_array[j], "offset": s_offset[j], "rows": s_rows[j],
                               "start_row": s_start[j], "crc32c": s_crc[j]} for j in range(k, k + count[at])]}
        # Kept: a read looks a request up several times (plan, replicas, packing). The same
        # entry either way, so readers on other threads see no change (a race builds it twice).
        self._keys[rid] = entry
        return entry

    def rows(self, rid: str) -> int:
        """``self[rid]["rows"]`` without building the entry."""
        at = self._keys[rid]
        return self._columns[0][at] if at.__class__ is int else at["rows"]

    def __setitem__(self, rid: str, entry: dict[str, Any]) -> None:
        self._keys[rid] = entry

    def __delitem__(self, rid: str) -> None:
        del self._keys[rid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, rid: object) -> bool:
        return rid in self._keys

    def keys(self) -> KeysView[str]:
        return self._keys.keys()

    def copy(self) -> "ColumnRequests":
        """A copy later updates do not change (the columns are never changed)."""
        return ColumnRequests(dict(self._keys), self._columns)

    def __repr__(self) -> str:
        return f"ColumnRequests({len(self._keys)} requests)"


def decode_requests(columns: Any, arrays: list[str], rollout_id: str, where: str, what: str) -> ColumnRequests:
    """:func:`encode_requests`'s columns back to a mapping of entries (:class:`ColumnRequests`),
    every value checked first (a damaged snapshot raises :class:`CorruptDataError`, never a
    TypeError deep in a read)."""
    if not isinstance(columns, dict) or not all(isinstance(columns.get(k), list) for k in (*_COLUMNS, *_SEGMENT_COLUMNS)):
        raise _bad(rollout_id, where, what, f"'requests' must be columns {', '.join(_COLUMNS + _SEGMENT_COLUMNS)}")
    ids = columns["ids"]
    n = len(ids)
    if not all(isinstance(rid, str) for rid in ids) or len(set(ids)) != n:
        raise _bad(rollout_id, where, what, "'ids' must list distinct request ids")
    ints: dict[str, np.ndarray] = {}
    for key in (*_COLUMNS[1:], *_SEGMENT_COLUMNS):
        try:
            col = np.asarray(columns[key]) if columns[key] else np.zeros(0, np.int64)
        except (ValueError, OverflowError):
            col = np.zeros(0, object)
        if col.ndim != 1 or col.dtype.kind not in "iu" or (col.size and col.min() < 0):
            raise _bad(rollout_id, where, what, f"{key!r} must list ints >= 0")
        ints[key] = col
    count = ints["segments"]
    if any(ints[k].size != n for k in _COLUMNS[1:]) or (n and count.min() < 1):
        raise _bad(rollout_id, where, what, f"'rows', 'start_row' and 'segments' must each list {n} values, segments >= 1")
    total = int(count.sum())
    if any(ints[k].size != total for k in _SEGMENT_COLUMNS):
        raise _bad(rollout_id, where, what, f"each segment column must list {total} values")
    if total and (ints["seg_array"].max() >= len(arrays) or ints["seg_rows"].min() < 1
                  or ints["seg_crc32c"].max() >= 1 << 32):
        raise _bad(rollout_id, where, what, "a segment names no listed array, has no rows, or a crc32c past 32 bits")
    if n and not np.array_equal(np.add.reduceat(ints["seg_rows"], np.cumsum(count) - count), ints["rows"]):
        raise _bad(rollout_id, where, what, "a request's segments do not hold its rows")
    first = (np.cumsum(count) - count).tolist() if n else []
    s_array = [arrays[i] for i in ints["seg_array"].tolist()]
    return ColumnRequests(
        dict(zip(ids, range(n))),
        (ints["rows"].tolist(), ints["start_row"].tolist(), first, count.tolist(), s_array,
         *(ints[k].tolist() for k in _SEGMENT_COLUMNS[1:])),
    )


def _shard_ok(info: Any) -> bool:
    """``{"rows", "chunk_rows", "zstd", "chunks": [offset, nbytes, ...]}`` of one batch array's
    single shard (offset and nbytes -1 for a chunk zarr left out as all fill value)."""
    if not isinstance(info, dict) or not _is_int(info.get("rows"), 1) or not _is_int(info.get("chunk_rows"), 1):
        return False
    chunks = info.get("chunks")
    return (isinstance(info.get("zstd"), bool) and isinstance(chunks, list)
            and len(chunks) == 2 * -(-info["rows"] // info["chunk_rows"])
            and (not chunks or (set(map(type, chunks)) == {int} and min(chunks) >= -1)))  # C loops: bool is not int here


class StalePartError(CorruptDataError):
    def __init__(self, rollout_id: str, where: str, seq: int) -> None:
        super().__init__(
            f"rollout {rollout_id!r} on {where}: index part {part_name(seq)} belongs to another rollout of "
            "that id (it was deleted and created again while being read)"
        )


def load_index(rollout_id: str, read: Callable[[str], bytes | None], where: str) -> RolloutIndex | None:
    """The whole index of a rollout, read with ``read(key)`` (a key under the rollout; None when
    absent), or None when the rollout has no index. For the writer and the node's index
    endpoint; readers fetch parts in parallel and keep them (:mod:`r3rdma.read.reader`)."""
    entry = check_entry(rollout_id, parse_attrs(read("zarr.json"), rollout_id, where), where)
    if entry is None:
        return None
    if entry.get("format_version", 1) == 1:
        return RolloutIndex.from_format_1(rollout_id, entry, where)
    geometry = {k: entry[k] for k in GEOMETRY_KEYS}
    index = RolloutIndex(uid=entry["uid"], geometry=geometry)
    if entry.get("snapshot"):
        raw = read(f"{snapshot_name(entry['snapshot'])}/zarr.json")
        if raw is None:
            raise CorruptDataError(f"rollout {rollout_id!r} on {where}: index snapshot "
                                   f"{snapshot_name(entry['snapshot'])} is missing")
        index = RolloutIndex.from_snapshot(
            check_snapshot(rollout_id, entry["snapshot"], entry["uid"], parse_attrs(raw, rollout_id, where), where),
            geometry)
    for seq in range(index.parts + 1, entry["parts"] + 1):
        raw = read(f"{part_name(seq)}/zarr.json")
        if raw is None:
            raise CorruptDataError(f"rollout {rollout_id!r} on {where}: index part {part_name(seq)} is missing")
        index.apply(check_part(rollout_id, seq, entry["uid"], parse_attrs(raw, rollout_id, where), where))
    return index


def read_file(root: Path) -> Callable[[str], bytes | None]:
    """``read`` for :func:`load_index` over a rollout directory on local disk."""

    def read(key: str) -> bytes | None:
        try:
            return (root / key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    return read


def parse_attrs(raw: bytes | None, rollout_id: str, where: str) -> Any:
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CorruptDataError(f"rollout {rollout_id!r} on {where}: an index document is not JSON: {e}") from e
    return doc.get("attributes") if isinstance(doc, dict) else None


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _bad(rollout_id: str, where: str, what: str, why: str) -> CorruptDataError:
    return CorruptDataError(f"{what} of rollout {rollout_id!r} on {where} is malformed: {why}")


def _check_geometry(rollout_id: str, index: dict[str, Any], where: str) -> None:
    for key in ("num_layers", "top_k", "num_experts"):
        if not _is_int(index.get(key), 1):
            raise _bad(rollout_id, where, "index", f"{key!r} must be an int >= 1, got {index.get(key)!r}")
    if index.get("dtype") not in ("uint8", "uint16", "int32"):
        raise _bad(rollout_id, where, "index", f"dtype must be uint8/uint16/int32, got {index.get('dtype')!r}")
    layer_map = index.get("layer_map")
    if not isinstance(layer_map, list) or len(layer_map) != index["num_layers"] or not all(map(_is_int, layer_map)):
        raise _bad(rollout_id, where, "index", "'layer_map' must list num_layers ints")


def _check_changes(rollout_id: str, doc: dict[str, Any], listed: set[str] | None, where: str, what: str) -> dict[str, Any]:
    """Refuse malformed request and pending maps up front (CorruptDataError), so a damaged or
    tampered document never surfaces as a TypeError/KeyError deep in a read (found by fuzzing).
    ``listed``: the arrays segments may name (None: any batch array name)."""
    if not isinstance(doc.get("requests"), dict):
        raise _bad(rollout_id, where, what, "'requests' must be a map")
    pending = doc.get("pending", {})
    if not isinstance(pending, dict) or not all(isinstance(v, list) for v in pending.values()):
        raise _bad(rollout_id, where, what, "'pending' must map request ids to lists of segments")

    def segment_ok(seg: Any) -> bool:
        return (
            isinstance(seg, dict)
            and isinstance(seg.get("array"), str)
            and (parse_array_name(seg["array"]) is not None if listed is None else seg["array"] in listed)
            and _is_int(seg.get("offset"))
            and _is_int(seg.get("rows"), 1)
            and _is_int(seg.get("start_row"))
            and _is_int(seg.get("crc32c"))
            and seg["crc32c"] < 1 << 32
        )

    for rid, entry in doc["requests"].items():
        segments = entry.get("segments") if isinstance(entry, dict) else None
        if not isinstance(segments, list) or not segments or not _is_int(entry.get("rows")) or not _is_int(entry.get("start_row")):
            raise _bad(rollout_id, where, what, f"request {rid!r} needs rows, start_row and a non-empty segment list")
        for seg in segments:
            if not segment_ok(seg):
                raise _bad(rollout_id, where, what, f"request {rid!r} has a segment {str(seg)[:200]}")
        if sum(seg["rows"] for seg in segments) != entry["rows"]:
            raise _bad(rollout_id, where, what,
                       f"request {rid!r}: segments hold {sum(seg['rows'] for seg in segments)} rows, entry says {entry['rows']}")
    for rid, segments in pending.items():
        for seg in segments:
            if not segment_ok(seg):
                raise _bad(rollout_id, where, what, f"pending request {rid!r} has a segment {str(seg)[:200]}")
    return doc
