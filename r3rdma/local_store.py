"""The embedded store: commits batches of finished requests to a Zarr v3 root on local disk.

One writer owns a root (an exclusive ``flock`` on ``<root>/.r3rdma.lock`` refuses a second);
any number of readers may read it concurrently, and see a request only once its batch is
committed (see :mod:`r3rdma.zarr_layout` for the format and the commit protocol).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec
from zarr.storage import LocalStore

from .errors import DuplicateRequestError, R3Error, ShapeMismatchError, StoreError, UnknownRolloutError
from .ids import validate_id
from .records import RequestRecord
from .zarr_layout import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_KEY,
    array_name,
    fsync_tree,
    group_document,
    parse_array_name,
    read_group_attrs,
    write_json_atomic,
)

__all__ = ["LocalRoutingStore", "CommitResult", "zarr_codecs"]


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a commit did: requests newly stored, requests already stored with the same bytes."""

    committed: int
    duplicates: int
    bytes_written: int


def zarr_codecs(zstd_level: int) -> list[Any]:
    """Chunk codecs of batch arrays: zstd, then a CRC-32C so zarr itself detects corrupt chunks."""
    codecs: list[Any] = [ZstdCodec(level=zstd_level)] if zstd_level > 0 else []
    return codecs + [Crc32cCodec()]


class LocalRoutingStore:
    """Writer of one store root. Thread-safe; ``commit`` returns once the data is durable."""

    def __init__(self, root: str | os.PathLike[str], *, zstd_level: int = 3, chunk_rows: int = 1024) -> None:
        self.root = Path(root)
        self.zstd_level = zstd_level
        self.chunk_rows = chunk_rows
        self._lock = threading.Lock()
        self._indexes: dict[str, dict[str, Any]] = {}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.root / ".r3rdma.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreError(f"cannot open store root {self.root}: {e}") from e
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(self._lock_fd)
            raise StoreError(f"store root {self.root} is owned by another writer process (lock held)") from e
        if not (self.root / "zarr.json").exists():
            write_json_atomic(
                self.root / "zarr.json",
                group_document({INDEX_KEY: {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}}),
            )

    # -- public API -------------------------------------------------------------------------

    def commit(self, records: Sequence[RequestRecord]) -> CommitResult:
        """Durably store ``records`` (any mix of rollouts); all or nothing per rollout.

        A request already committed with the same bytes is skipped (retries are idempotent);
        with different bytes it raises :class:`DuplicateRequestError`. A record whose
        ``start_row`` continues a committed request exactly where it ends is appended to it as a
        new segment (a later turn of a multi-turn conversation).
        """
        by_rollout: dict[str, list[RequestRecord]] = {}
        for record in records:
            by_rollout.setdefault(record.rollout_id, []).append(record)
        committed = duplicates = written = 0
        with self._lock:
            for rollout_id, group in by_rollout.items():
                c, d, w = self._commit_rollout(rollout_id, group)
                committed, duplicates, written = committed + c, duplicates + d, written + w
        return CommitResult(committed, duplicates, written)

    def delete_rollout(self, rollout_id: str) -> None:
        """Remove a rollout: its index first (readers stop seeing it at once), then its arrays."""
        validate_id(rollout_id, "rollout_id")
        with self._lock:
            path = self.root / rollout_id
            if not (path / "zarr.json").exists():
                raise UnknownRolloutError(f"rollout {rollout_id!r} not found under {self.root}")
            os.unlink(path / "zarr.json")
            shutil.rmtree(path, ignore_errors=True)
            self._indexes.pop(rollout_id, None)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def __enter__(self) -> "LocalRoutingStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _index(self, rollout_id: str) -> dict[str, Any]:
        index = self._indexes.get(rollout_id)
        if index is None:
            path = self.root / rollout_id
            attrs = read_group_attrs(path / "zarr.json")
            index = attrs[INDEX_KEY] if attrs else {"format_version": FORMAT_VERSION, "arrays": [], "requests": {}}
            self._remove_orphans(path, set(index["arrays"]))
            self._indexes[rollout_id] = index
        return index

    @staticmethod
    def _remove_orphans(path: Path, referenced: set[str]) -> None:
        # Arrays no index points at are leftovers of a crash between array write and index
        # rename; only this writer (it holds the root lock) creates arrays, so they are safe to drop.
        if not path.is_dir():
            return
        for child in path.iterdir():
            if parse_array_name(child.name) is not None and child.name not in referenced:
                shutil.rmtree(child, ignore_errors=True)

    def _commit_rollout(self, rollout_id: str, records: list[RequestRecord]) -> tuple[int, int, int]:
        index = self._index(rollout_id)
        geometry = _geometry(records[0])
        if "num_layers" in index:
            stored = {k: index[k] for k in geometry}
            if stored != geometry:
                raise ShapeMismatchError(
                    f"rollout {rollout_id!r} stores routing with {stored}; request "
                    f"{records[0].request_id!r} arrived with {geometry}"
                )
        new: list[RequestRecord] = []
        seen: dict[str, RequestRecord] = {}
        duplicates = 0
        for record in records:
            if _geometry(record) != geometry:
                raise ShapeMismatchError(
                    f"request {record.request_id!r} has geometry {_geometry(record)}, "
                    f"but {records[0].request_id!r} in the same batch has {geometry}"
                )
            if record.request_id in seen:
                prior = seen[record.request_id]
                if prior.crc32c == record.crc32c and prior.start_row == record.start_row and prior.num_rows == record.num_rows:
                    duplicates += 1
                    continue
                raise DuplicateRequestError(f"request {record.request_id!r} appears twice in one batch with different rows")
            seen[record.request_id] = record
            entry = index["requests"].get(record.request_id)
            if entry is None:
                new.append(record)
            elif any(
                s["start_row"] == record.start_row and s["rows"] == record.num_rows and s["crc32c"] == record.crc32c
                for s in entry["segments"]
            ):
                duplicates += 1
            elif record.start_row == entry["start_row"] + entry["rows"]:
                new.append(record)  # continuation: a later turn's rows
            else:
                end = entry["start_row"] + entry["rows"]
                raise DuplicateRequestError(
                    f"request {record.request_id!r} of rollout {rollout_id!r} is already stored "
                    f"(rows {entry['start_row']}..{end - 1}, crc32c {entry['segments'][-1]['crc32c']:#010x}); "
                    f"a record with different bytes arrived (start_row {record.start_row}, "
                    f"{record.num_rows} rows, crc32c {record.crc32c:#010x}); only start_row {end} would extend it"
                )
        if not new:
            return 0, duplicates, 0
        data = np.concatenate([r.ids_TLK for r in new]) if len(new) > 1 else new[0].ids_TLK
        seq = max((parse_array_name(a) or 0 for a in index["arrays"]), default=0) + 1
        name = array_name(seq)
        rollout_path = self.root / rollout_id
        try:
            self._write_array(rollout_path, name, data)
        except R3Error:
            raise
        except OSError as e:
            shutil.rmtree(rollout_path / name, ignore_errors=True)
            raise StoreError(f"writing {len(new)} requests ({data.nbytes} bytes) to {rollout_path / name} failed: {e}") from e
        updated = dict(index, **geometry)
        updated["arrays"] = index["arrays"] + [name]
        requests = dict(index["requests"])
        offset = 0
        for record in new:
            segment = {"array": name, "offset": offset, "rows": record.num_rows, "start_row": record.start_row, "crc32c": record.crc32c}
            offset += record.num_rows
            prior = requests.get(record.request_id)
            if prior is None:
                requests[record.request_id] = {"rows": record.num_rows, "start_row": record.start_row, "segments": [segment]}
            else:
                requests[record.request_id] = {
                    "rows": prior["rows"] + record.num_rows,
                    "start_row": prior["start_row"],
                    "segments": prior["segments"] + [segment],
                }
        updated["requests"] = requests
        try:
            write_json_atomic(rollout_path / "zarr.json", group_document({INDEX_KEY: updated}))
        except OSError as e:
            shutil.rmtree(rollout_path / name, ignore_errors=True)
            raise StoreError(f"committing the index of rollout {rollout_id!r} failed: {e}") from e
        self._indexes[rollout_id] = updated
        return len(new), duplicates, int(data.nbytes)

    def _write_array(self, rollout_path: Path, name: str, data: np.ndarray) -> None:
        rows, layers, top_k = data.shape
        chunk = max(1, min(self.chunk_rows, rows))
        shard = -(-rows // chunk) * chunk  # one shard file per batch: few files, ranged reads
        rollout_path.mkdir(parents=True, exist_ok=True)
        zarr.create_array(
            LocalStore(rollout_path),
            name=name,
            data=data,
            chunks=(chunk, layers, top_k),
            shards=(shard, layers, top_k),
            compressors=zarr_codecs(self.zstd_level),
            dimension_names=("token", "layer", "k"),
            fill_value=0,
        )
        fsync_tree(rollout_path / name)


def _geometry(record: RequestRecord) -> dict[str, Any]:
    return {
        "num_layers": len(record.layer_map),
        "top_k": record.top_k,
        "num_experts": record.num_experts,
        "dtype": record.ids_TLK.dtype.name,
        "layer_map": list(record.layer_map),
    }
