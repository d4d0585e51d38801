"""Opening a root for writing: its format marker checked, and every trace of commits a crash
interrupted removed (this process now owns the root: docs/FORMAT.md, "Commit protocol")."""

from __future__ import annotations

import shutil
from pathlib import Path

from r3rdma.errors import InvalidIdError, StoreError
from r3rdma.store.layout import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_KEY,
    check_rollout_dir_name,
    fsync_dir,
    group_document,
    parse_array_name,
    read_group_attrs,
    write_json_atomic,
)
from r3rdma.store.rollout_index import check_entry, parse_part_name, parse_snapshot_name

__all__ = ["check_format", "recover_root", "remove_orphans"]


def check_format(root: Path, holds_rollouts: bool) -> None:
    """Write the root's format marker, or refuse a root of another format version.

    A format-1 root (one index document per rollout, rewritten by every commit) is read by
    :class:`~r3rdma.read.reader.RoutingReader` but not appended to: its rollouts would need
    their index rewritten in format 2. An empty format-1 root is simply marked format 2.
    """
    try:
        attrs = read_group_attrs(root / "zarr.json")
    except ValueError as e:
        raise StoreError(f"store root {root}: zarr.json is not JSON: {e}") from e
    marker = (attrs or {}).get(INDEX_KEY) or {}
    version = marker.get("format_version", FORMAT_VERSION) if isinstance(marker, dict) else None
    if attrs is not None and version != FORMAT_VERSION:
        if holds_rollouts:
            raise StoreError(
                f"store root {root} holds r3rdma format version {version!r}; this r3rdma writes format "
                f"version {FORMAT_VERSION} (an index that grows by parts). RoutingReader still reads it: start the "
                "store on a new root, or delete its rollouts (r3rdma delete) before writing here"
            )
    if attrs is None or version != FORMAT_VERSION:
        write_json_atomic(
            root / "zarr.json",
            group_document({INDEX_KEY: {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}}),
        )


def recover_root(root: Path) -> None:
    """Remove every trace of commits a crash interrupted.

    A commit writes its batch array and index part, then replaces the rollout's entry
    point; a crash before that leaves an array and a part the entry point does not count,
    which readers never see (a rollout's first commit leaves no entry point at all: the
    array and part are written without a parent group document, so nothing lists the
    rollout meanwhile). Left alone, a plain Zarr listing would show them and the next
    commit would reuse their names. So, on opening: arrays and parts numbered above the
    entry point's count are deleted, index temp files too, a bare group ``zarr.json``
    without an index, and a rollout directory left empty. Anything else (files r3rdma did
    not write) is left in place. Costs one directory listing per rollout.
    """
    for child in root.iterdir():
        try:
            check_rollout_dir_name(child.name)
        except InvalidIdError:
            continue
        if not child.is_dir():
            continue
        index_path = child / "zarr.json"
        try:
            attrs = read_group_attrs(index_path)
        except ValueError:  # a bare group document zarr wrote in place, torn by the crash
            attrs = {}
        entry = check_entry(child.name, attrs, str(root)) if attrs else None
        if entry is not None and entry.get("format_version", 1) == 1:
            continue  # not this format's (refused by check_format unless the root says otherwise)
        if entry is None and attrs is not None:
            index_path.unlink()  # a bare parent group zarr wrote before the array
        remove_orphans(child, entry["parts"] if entry is not None else 0, entry.get("snapshot", 0) if entry is not None else 0)
        for tmp in child.glob("**/.zarr.json.tmp-*"):
            tmp.unlink(missing_ok=True)
        if entry is None:
            try:
                child.rmdir()  # only when nothing else is left
            except OSError:
                pass
            else:
                fsync_dir(root)


def remove_orphans(path: Path, parts: int, snapshot: int) -> None:
    """Remove what a rollout's entry point (``parts``, ``snapshot``) does not count.

    Arrays and parts numbered above the entry point's count are leftovers of a crash before
    its replace; only the writer (it holds the root lock) creates them, so they are safe to
    drop, and the next commit reuses their numbers. Snapshots other than the one the entry
    point names: a crash's, or older ones (a reader that read an older entry point and finds
    its snapshot gone reads the entry point again).
    """
    if not path.is_dir():
        return
    for child in path.iterdir():
        seq = parse_array_name(child.name) or parse_part_name(child.name)
        old_snapshot = parse_snapshot_name(child.name)
        if (seq is not None and seq > parts) or (old_snapshot is not None and old_snapshot != snapshot):
            shutil.rmtree(child, ignore_errors=True)
