"""The on-disk format: a Zarr v3 hierarchy per store root, one group per rollout.

::

    <root>/zarr.json                       group; attributes.r3rdma = {"format": ..., "format_version": 1}
    <root>/<rollout_id>/zarr.json          group; attributes.r3rdma = the rollout index (below)
    <root>/<rollout_id>/b00000001/         array [rows, L, K], one shard file of zstd chunks
    <root>/<rollout_id>/b00000002/         ... one array per committed batch of requests

A batch array holds the rows of many requests back to back (one file per batch, not one per
request or layer). The rollout index, in the group's attributes, lists committed requests:

    {"format_version": 1, "num_layers": L, "top_k": K, "num_experts": E, "dtype": "uint8",
     "layer_map": [...], "arrays": ["b00000001", ...],
     "requests": {request_id: {"rows": n, "start_row": s,
                               "segments": [{"array": "b00000001", "offset": o, "rows": n,
                                             "start_row": s, "crc32c": c}]}},
     "pending": {request_id: [{"array": ..., "offset": o, "rows": n, "start_row": s, "crc32c": c,
                               "final": bool, "total_rows": t or null}]}}

``pending`` (absent when empty) lists segments of requests that are stored durably but not yet
complete (a prefill engine's part whose decode part has not arrived, or parts with a gap);
readers ignore it. Once a request's segments cover its span, its segments move to
``requests`` (without the ``final`` / ``total_rows`` keys) in the same atomic index replace.
A visible request's segments are in row order; their concatenation is the request's rows.

Commit protocol (why requests appear only when complete): a batch array is written and
fsynced first; the group's ``zarr.json`` is then replaced atomically (write temp, fsync,
rename, fsync directory). A crash before the rename leaves an array no index points at, which
readers never see and the next writer removes when it opens the root (a rollout whose first
commit crashed leaves no directory behind; the array is written without a parent group
document, so nothing lists the rollout meanwhile).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_KEY",
    "array_name",
    "parse_array_name",
    "group_document",
    "write_json_atomic",
    "fsync_tree",
    "fsync_dir",
    "read_group_attrs",
]

FORMAT_NAME = "r3rdma-routing"
FORMAT_VERSION = 1
INDEX_KEY = "r3rdma"
_ARRAY_PREFIX = "b"


def array_name(seq: int) -> str:
    return f"{_ARRAY_PREFIX}{seq:08d}"


def parse_array_name(name: str) -> int | None:
    if len(name) == 9 and name.startswith(_ARRAY_PREFIX) and name[1:].isdigit():
        return int(name[1:])
    return None


def group_document(attributes: dict[str, Any]) -> dict[str, Any]:
    """A Zarr v3 group metadata document (``zarr.json``) with the given attributes."""
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes}


def write_json_atomic(path: Path, document: dict[str, Any]) -> None:
    """Replace ``path`` with ``document`` so that readers see the old or the new file, whole.

    Zarr's LocalStore writes in place; a crash mid-write would leave a truncated index, so the
    index alone is written here: temp file, fsync, rename over, fsync the directory.
    """
    data = json.dumps(document, separators=(",", ":"), sort_keys=True).encode()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        # Disk full / file size limit: leave no partial temp file behind.
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (and ``path`` itself)."""
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))
    _fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """fsync a directory (makes renames and unlinks in it durable)."""
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_group_attrs(path: Path) -> dict[str, Any] | None:
    """The attributes of the group whose ``zarr.json`` is at ``path``, or None if absent."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    doc = json.loads(raw)
    return doc.get("attributes", {})
