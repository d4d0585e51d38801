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

Readers fetch the entry point, then only the parts they have not seen.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from r3rdma.errors import CorruptDataError
from r3rdma.store.layout import INDEX_KEY, PART_PREFIX, numbered_name, parse_array_name, parse_numbered_name

__all__ = [
    "INDEX_FORMAT_VERSION",
    "GEOMETRY_KEYS",
    "RolloutIndex",
    "part_name",
    "parse_part_name",
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
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)
    pending: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    arrays: list[str] = field(default_factory=list)
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)
    version: int = INDEX_FORMAT_VERSION

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
        return {"format_version": INDEX_FORMAT_VERSION, "uid": self.uid, "parts": self.parts, **self.geometry}

    def as_format_1(self) -> dict[str, Any]:
        """The merged index in format 1's one-document shape (``GET /v1/rollouts/{id}``)."""
        out = {"format_version": self.version, **self.geometry, "arrays": self.arrays, "requests": self.requests}
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
    _check_geometry(rollout_id, index, where)
    return index


def check_part(rollout_id: str, seq: int, uid: str, attrs: Any, where: str) -> dict[str, Any]:
    """Index part ``seq`` from its group's attributes, checked against the entry point's uid."""
    part = attrs.get(INDEX_KEY) if isinstance(attrs, dict) else None
    what = f"index part {part_name(seq)}"
    if not isinstance(part, dict):
        raise _bad(rollout_id, where, what, "has no r3rdma attributes")
    if part.get("part") != seq:
        raise _bad(rollout_id, where, what, f"says it is part {part.get('part')!r}")
    if part.get("uid") != uid:
        # Written for another rollout of the same id (deleted and created again): the caller
        # re-reads the entry point.
        raise StalePartError(rollout_id, where, seq)
    arrays = part.get("arrays")
    if not isinstance(arrays, list) or not all(isinstance(a, str) and parse_array_name(a) is not None for a in arrays):
        raise _bad(rollout_id, where, what, f"'arrays' must list batch array names, got {str(arrays)[:100]}")
    shards = part.get("shards", {})
    if not isinstance(shards, dict) or not all(name in arrays and _shard_ok(info) for name, info in shards.items()):
        raise _bad(rollout_id, where, what, f"'shards' must describe arrays it adds, got {str(shards)[:200]}")
    return _check_changes(rollout_id, part, None, where, what)


def _shard_ok(info: Any) -> bool:
    """``{"rows", "chunk_rows", "zstd", "chunks": [offset, nbytes, ...]}`` of one batch array's
    single shard (offset and nbytes -1 for a chunk zarr left out as all fill value)."""
    if not isinstance(info, dict) or not _is_int(info.get("rows"), 1) or not _is_int(info.get("chunk_rows"), 1):
        return False
    chunks = info.get("chunks")
    return (isinstance(info.get("zstd"), bool) and isinstance(chunks, list)
            and len(chunks) == 2 * -(-info["rows"] // info["chunk_rows"])
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= -1 for v in chunks))


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
    index = RolloutIndex(uid=entry["uid"], geometry={k: entry[k] for k in GEOMETRY_KEYS})
    for seq in range(1, entry["parts"] + 1):
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
