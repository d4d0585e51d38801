"""The on-disk hierarchy: a Zarr v3 group per store root, one group per rollout.

::

    <root>/zarr.json                       group; attributes.r3rdma = {"format": ..., "format_version": 2}
    <root>/<rollout_id>/zarr.json          group; attributes.r3rdma = the index entry point
    <root>/<rollout_id>/i00000001/         group; the index part commit 1 wrote (immutable)
    <root>/<rollout_id>/s00000064/         group; index parts 1..64 merged (immutable, optional)
    <root>/<rollout_id>/b00000001/         array [rows, L, K], one shard file of zstd chunks

A batch array holds the rows of many requests back to back (one file per batch, not one per
request or layer). The rollout index (which requests, where their rows are) and the commit
protocol are in :mod:`r3rdma.store.rollout_index` and :mod:`r3rdma.store.local_store`;
docs/FORMAT.md is the reference. Here: names, and writing JSON documents atomically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from r3rdma.errors import InvalidIdError
from r3rdma.ids import validate_id
from r3rdma.store.pools import submit

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_KEY",
    "array_name",
    "parse_array_name",
    "check_rollout_dir_name",
    "group_document",
    "write_json_atomic",
    "write_json",
    "tree_paths",
    "fsync_paths",
    "fsync_dir",
    "read_group_attrs",
]

FORMAT_NAME = "r3rdma-routing"
FORMAT_VERSION = 2  # 2: the rollout index is an entry point plus immutable parts (rollout_index.py)
INDEX_KEY = "r3rdma"
ARRAY_PREFIX = "b"  # batch arrays: b00000001, ...
PART_PREFIX = "i"  # index parts: i00000001, ... (r3rdma.store.rollout_index)
SNAPSHOT_PREFIX = "s"  # index snapshots: s00000064 = parts 1..64 merged (r3rdma.store.rollout_index)


def numbered_name(prefix: str, seq: int) -> str:
    """``prefix`` and commit number ``seq`` as 8 digits: the names of a commit's files."""
    return f"{prefix}{seq:08d}"


def parse_numbered_name(prefix: str, name: str) -> int | None:
    """The commit number in ``name`` (see :func:`numbered_name`), or None if it is not one."""
    if len(name) == 9 and name.startswith(prefix) and name[1:].isdigit():
        return int(name[1:])
    return None


def check_rollout_dir_name(rollout_id: str) -> str:
    """Validate ``rollout_id`` and refuse ids that collide with the root's own files.

    A rollout id is a directory under the root: a valid id starting with ``.`` (``.r3rdma.lock``,
    an index temp file) or named ``zarr.json`` would write into the store's own files (seen as
    a NotADirectoryError that reached clients as an internal error), and hidden names are never
    served over HTTP, so such data could not be read back.
    """
    validate_id(rollout_id, "rollout_id")
    if rollout_id.startswith(".") or rollout_id == "zarr.json":
        raise InvalidIdError(f"rollout_id {rollout_id!r} is reserved: rollout ids must not start with '.' or be 'zarr.json'")
    return rollout_id


def array_name(seq: int) -> str:
    """The directory name of batch array ``seq`` (the array the rollout's part ``seq`` added)."""
    return numbered_name(ARRAY_PREFIX, seq)


def parse_array_name(name: str) -> int | None:
    """The ``seq`` of a batch array's directory name, or None if ``name`` is not one."""
    return parse_numbered_name(ARRAY_PREFIX, name)


def group_document(attributes: dict[str, Any]) -> dict[str, Any]:
    """A Zarr v3 group metadata document (``zarr.json``) with the given attributes."""
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes}


def write_json_atomic(path: Path, document: dict[str, Any], *, sync_with: Sequence[Path] = ()) -> None:
    """Replace ``path`` with ``document`` so that readers see the old or the new file, whole.

    Zarr's LocalStore writes in place; a crash mid-write would leave a truncated index, so the
    index alone is written here: temp file, fsync, rename over, fsync the directory.
    ``sync_with``: files and directories that must be durable before the rename (what the new
    document points at); they are fsynced together with the temp file (:func:`fsync_paths`).
    """
    data = json.dumps(document, separators=(",", ":"), sort_keys=True).encode()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        fsync_paths([tmp, *sync_with])
        os.replace(tmp, path)
    except BaseException:
        # Disk full / file size limit: leave no partial temp file behind.
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` in place, not synced: for files nothing names yet (an
    index part before the entry point counts it; a crash's torn file is removed on opening)."""
    path.write_bytes(json.dumps(document, separators=(",", ":"), sort_keys=True).encode())


def tree_paths(path: Path) -> list[Path]:
    """Every file and directory under ``path``, and ``path``: what makes a new tree durable."""
    out = []
    for dirpath, _dirnames, filenames in os.walk(path):
        out.append(Path(dirpath))
        out.extend(Path(dirpath, name) for name in filenames)
    return out


def fsync_paths(paths: Sequence[Path]) -> None:
    """fsync files and directories, all at once.

    Why concurrently: a commit makes ~10 new files and directories durable (a batch array's
    shard, its metadata and four directory levels, the index part and the entry point's temp
    file). One after another, each fsync waited for its own journal commit (~1 ms on the CPU
    VM, more on the GPU hosts' disks); issued together, the filesystem commits them in one
    journal transaction. Raises the first error.
    """
    if len(paths) <= 1:
        for p in paths:
            _fsync_path(p)
        return
    global _fsync_pool
    if _fsync_pool is None:
        _fsync_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="r3rdma-fsync")
    for future in [submit(_fsync_pool, _fsync_path, p) for p in paths]:
        future.result()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a directory too (Linux)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_fsync_pool: ThreadPoolExecutor | None = None


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
