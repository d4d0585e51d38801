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

Readers fetch the entry point, then only the snapshot and parts they have not seen. The
entries are typed in memory (:mod:`r3rdma.store.index_entries`); a snapshot's requests stay
columns until looked up (:mod:`r3rdma.store.index_columns`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from r3rdma.errors import CorruptDataError
from r3rdma.store.index_columns import ColumnRequests, decode_requests, encode_requests
from r3rdma.store.index_entries import (
    PendingSegment,
    RequestEntry,
    parse_pending,
    parse_requests,
    shard_entry_ok,
)
from r3rdma.store.index_entries import (
    malformed as _bad,
)
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
    "IndexPart",
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

# 3: batch arrays' inner chunks hold a group of layers, and ``shards`` copies chunk sizes as
# base64 (index_entries.shard_entry). 4: arrays of long requests lie layer group major in their
# shard (``chunk_sizes_group_major``). A reader reads 1 to 4; an older one refuses a newer
# version naming it.
INDEX_FORMAT_VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
GEOMETRY_KEYS = ("num_layers", "top_k", "num_experts", "dtype", "layer_map")

Pending = dict[str, tuple[PendingSegment, ...]]  # request id -> its pending segments
Requests = dict[str, RequestEntry] | ColumnRequests  # request id -> its entry: parsed, or a snapshot's columns


def part_name(seq: int) -> str:
    """The directory name of index part ``seq``."""
    return numbered_name(PART_PREFIX, seq)


def parse_part_name(name: str) -> int | None:
    """The ``seq`` of an index part's directory name, or None if ``name`` is not one."""
    return parse_numbered_name(PART_PREFIX, name)


def snapshot_name(seq: int) -> str:
    """The directory name of the index snapshot taken after part ``seq``."""
    return numbered_name(SNAPSHOT_PREFIX, seq)


def parse_snapshot_name(name: str) -> int | None:
    """The ``seq`` of a snapshot's directory name, or None if ``name`` is not one."""
    return parse_numbered_name(SNAPSHOT_PREFIX, name)


def new_uid() -> str:
    """A new rollout's uid (16 hex characters): parts and snapshots carry it, so a reader tells a
    rollout created again under the same id from the one it was reading."""
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class IndexPart:
    """What one commit changed (index part ``seq``), or, read from a snapshot, the index after
    part ``seq`` (``requests`` then a :class:`ColumnRequests`).

    ``requests``: the whole new entry of each request made visible, extended or replaced;
    ``pending``: the whole new pending list of each request whose pending segments changed
    (empty: none left); ``arrays`` / ``shards``: the batch arrays added and their shard layout.
    """

    seq: int
    uid: str
    arrays: list[str]
    shards: dict[str, dict[str, Any]]
    requests: Requests
    pending: Pending

    def document(self) -> dict[str, Any]:
        """The part's attributes (``attributes.r3rdma`` of ``i<seq>/zarr.json``). A part that
        adds no array (a discarded pending request) has no ``shards``."""
        doc: dict[str, Any] = {"part": self.seq, "uid": self.uid, "arrays": self.arrays}
        if self.shards:
            doc["shards"] = self.shards
        doc["requests"] = {rid: entry.to_json() for rid, entry in self.requests.items()}
        doc["pending"] = _pending_json(self.pending)
        return doc


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
    requests: Requests = field(default_factory=dict)
    pending: Pending = field(default_factory=dict)
    arrays: list[str] = field(default_factory=list)
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)
    version: int = INDEX_FORMAT_VERSION
    snapshot: int = 0  # the snapshot the entry point names (0: none)

    @classmethod
    def from_format_1(cls, rollout_id: str, index: dict[str, Any], where: str) -> RolloutIndex:
        """The one-document index of format 1 (read-only: writers refuse format-1 roots)."""
        listed = set(index.get("arrays") or [])
        requests, pending = _parse_changes(rollout_id, index, listed.__contains__, where, "index")
        geometry = {k: index[k] for k in GEOMETRY_KEYS if k in index}
        if requests:
            _check_geometry(rollout_id, geometry, where)
        return cls(
            uid="format-1",
            geometry=geometry,
            requests=requests,
            pending={k: v for k, v in pending.items() if v},
            arrays=list(index["arrays"]),
            version=1,
        )

    @classmethod
    def from_snapshot(cls, snapshot: IndexPart, geometry: dict[str, Any]) -> RolloutIndex:
        """The index after part ``snapshot.seq`` (a snapshot read with :func:`check_snapshot`)."""
        return cls(
            uid=snapshot.uid,
            geometry=geometry,
            parts=snapshot.seq,
            requests=snapshot.requests,
            pending={k: v for k, v in snapshot.pending.items() if v},
            arrays=list(snapshot.arrays),
            shards=dict(snapshot.shards),
            snapshot=snapshot.seq,
        )

    def copy(self) -> RolloutIndex:
        """A copy later commits do not change (entries themselves are never changed in place)."""
        return RolloutIndex(
            uid=self.uid,
            geometry=self.geometry,
            parts=self.parts,
            requests=self.requests.copy(),
            pending=dict(self.pending),
            arrays=list(self.arrays),
            shards=dict(self.shards),
            version=self.version,
            snapshot=self.snapshot,
        )

    def snapshot_document(self) -> dict[str, Any]:
        """This index as a snapshot of its parts, requests in columns (:func:`encode_requests`)."""
        return {
            "snapshot": self.parts,
            "uid": self.uid,
            "arrays": self.arrays,
            "shards": self.shards,
            "requests": encode_requests(self.requests, self.arrays),
            "pending": _pending_json(self.pending),
        }

    def apply(self, part: IndexPart) -> None:
        """Apply the next part (read with :func:`check_part`, or written by this process)."""
        assert part.seq == self.parts + 1, (part.seq, self.parts)
        self.requests.update(part.requests)
        for rid, segments in part.pending.items():
            if segments:
                self.pending[rid] = segments
            else:
                self.pending.pop(rid, None)
        self.arrays.extend(part.arrays)
        self.shards.update(part.shards)
        self.parts = part.seq

    def entry_document(self) -> dict[str, Any]:
        """The entry point's attributes (``attributes.r3rdma`` of the rollout's ``zarr.json``)."""
        doc = {"format_version": INDEX_FORMAT_VERSION, "uid": self.uid, "parts": self.parts, **self.geometry}
        if self.snapshot:
            doc["snapshot"] = self.snapshot
        return doc

    def as_format_1(self) -> dict[str, Any]:
        """The merged index in format 1's one-document shape (``GET /v1/rollouts/{id}``)."""
        out = {
            "format_version": self.version,
            **self.geometry,
            "arrays": self.arrays,
            "requests": {rid: entry.to_json() for rid, entry in self.requests.items()},
        }
        if self.pending:
            out["pending"] = _pending_json(self.pending)
        return out


def _pending_json(pending: Pending) -> dict[str, list[dict[str, Any]]]:
    return {rid: [seg.to_json() for seg in segments] for rid, segments in pending.items()}


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
    if version not in READ_VERSIONS:
        raise CorruptDataError(
            f"rollout {rollout_id!r} on {where} has index format version {version!r}; this r3rdma reads "
            f"versions {', '.join(map(str, READ_VERSIONS))}: upgrade r3rdma to read it"
        )
    if not _is_int(index.get("parts"), 1) or not isinstance(index.get("uid"), str):
        raise _bad(rollout_id, where, "entry point", f"needs 'parts' >= 1 and a 'uid', got {str(index)[:200]}")
    if "snapshot" in index and not (_is_int(index["snapshot"], 1) and index["snapshot"] <= index["parts"]):
        raise _bad(
            rollout_id, where, "entry point", f"'snapshot' must be a part number 1..{index['parts']}, got {index['snapshot']!r}"
        )
    _check_geometry(rollout_id, index, where)
    return index


def check_part(rollout_id: str, seq: int, uid: str, attrs: Any, where: str) -> IndexPart:
    """Index part ``seq`` from its group's attributes, checked against the entry point's uid."""
    part, what = _checked_header(rollout_id, seq, uid, attrs, where, "part")
    requests, pending = _parse_changes(rollout_id, part, _any_batch_array(), where, what)
    return IndexPart(seq, uid, part["arrays"], part.get("shards", {}), requests, pending)


def check_snapshot(rollout_id: str, seq: int, uid: str, attrs: Any, where: str) -> IndexPart:
    """Index snapshot ``seq`` (parts ``1..seq`` merged) from its group's attributes, checked, its
    ``requests`` decoded from columns (:class:`ColumnRequests`)."""
    doc, what = _checked_header(rollout_id, seq, uid, attrs, where, "snapshot")
    # Checked as a part with no requests (pending), then the columns.
    _, pending = _parse_changes(rollout_id, {**doc, "requests": {}}, _any_batch_array(), where, what)
    requests = decode_requests(doc.get("requests"), doc["arrays"], rollout_id, where, f"index snapshot {snapshot_name(seq)}")
    return IndexPart(seq, uid, doc["arrays"], doc.get("shards", {}), requests, pending)


def _checked_header(rollout_id: str, seq: int, uid: str, attrs: Any, where: str, key: str) -> tuple[dict[str, Any], str]:
    """A part's or snapshot's document (``key``: "part" or "snapshot") with its number, uid,
    arrays and shards checked; and how messages name it."""
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
    if not isinstance(shards, dict) or not all(name in listed and shard_entry_ok(info) for name, info in shards.items()):
        raise _bad(rollout_id, where, what, f"'shards' must describe arrays it adds, got {str(shards)[:200]}")
    return part, what


class StalePartError(CorruptDataError):
    """An index part whose uid is not the entry point's: the rollout was deleted and created again
    while a reader fetched its parts (the reader reads the index afresh)."""

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
            raise CorruptDataError(
                f"rollout {rollout_id!r} on {where}: index snapshot {snapshot_name(entry['snapshot'])} is missing"
            )
        index = RolloutIndex.from_snapshot(
            check_snapshot(rollout_id, entry["snapshot"], entry["uid"], parse_attrs(raw, rollout_id, where), where), geometry
        )
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
    """The ``attributes`` of a ``zarr.json`` document, or None when ``raw`` is None or the
    document is not a JSON object; raises :class:`CorruptDataError` when it is not JSON."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CorruptDataError(f"rollout {rollout_id!r} on {where}: an index document is not JSON: {e}") from e
    return doc.get("attributes") if isinstance(doc, dict) else None


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_geometry(rollout_id: str, index: dict[str, Any], where: str) -> None:
    for key in ("num_layers", "top_k", "num_experts"):
        if not _is_int(index.get(key), 1):
            raise _bad(rollout_id, where, "index", f"{key!r} must be an int >= 1, got {index.get(key)!r}")
    if index.get("dtype") not in ("uint8", "uint16", "int32"):
        raise _bad(rollout_id, where, "index", f"dtype must be uint8/uint16/int32, got {index.get('dtype')!r}")
    layer_map = index.get("layer_map")
    if not isinstance(layer_map, list) or len(layer_map) != index["num_layers"] or not all(map(_is_int, layer_map)):
        raise _bad(rollout_id, where, "index", "'layer_map' must list num_layers ints")


def _parse_changes(
    rollout_id: str, doc: dict[str, Any], array_ok: Callable[[str], bool], where: str, what: str
) -> tuple[dict[str, RequestEntry], Pending]:
    """The request and pending maps of a document, as entries; malformed ones are refused up
    front (CorruptDataError), so a damaged or tampered document never surfaces as a
    TypeError/KeyError deep in a read (found by fuzzing). ``array_ok``: whether a segment may
    name that array."""
    if not isinstance(doc.get("requests"), dict):
        raise _bad(rollout_id, where, what, "'requests' must be a map")
    pending = doc.get("pending", {})
    if not isinstance(pending, dict) or not all(isinstance(v, list) for v in pending.values()):
        raise _bad(rollout_id, where, what, "'pending' must map request ids to lists of segments")

    def problem(why: str) -> CorruptDataError:
        return _bad(rollout_id, where, what, why)

    return parse_requests(doc["requests"], array_ok, problem), parse_pending(pending, array_ok, problem)


def _any_batch_array() -> Callable[[str], bool]:
    """``array_ok`` for a part: any batch array name. Names seen are kept: a part's ~20k
    segments name a few arrays, and checking each name again was a tenth of a part's parse."""
    seen: set[str] = set()

    def ok(name: str) -> bool:
        if name in seen:
            return True
        if parse_array_name(name) is None:
            return False
        seen.add(name)
        return True

    return ok
