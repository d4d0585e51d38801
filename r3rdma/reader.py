"""Trainer-side reads of committed routing, from a local root (remote roots: see ``source``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import zarr
import zarr.errors
from zarr.storage import LocalStore

from .errors import CorruptDataError, UnknownRequestError, UnknownRolloutError
from .ids import validate_id
from .records import checksum
from .zarr_layout import INDEX_KEY

__all__ = ["RoutingReader", "PackedRouting", "RolloutInfo", "to_torch"]


@dataclass(frozen=True, slots=True)
class RolloutInfo:
    """Geometry and contents of one rollout."""

    rollout_id: str
    num_layers: int
    top_k: int
    num_experts: int
    dtype: str
    layer_map: tuple[int, ...]
    request_ids: tuple[str, ...]
    total_rows: int


@dataclass(frozen=True, slots=True, eq=False)
class PackedRouting:
    """Routing of several requests packed along tokens, as trainers batch packed sequences.

    Rows of request ``i`` are ``ids_TLK[cu_seqlens[i]:cu_seqlens[i + 1]]``; their first row is
    position ``start_rows[i]`` of that request (0 unless only later turns were stored). A request
    stored in segments (turns of a conversation, prefill and decode parts) comes back whole:
    its segments concatenated in row order. Requests whose segments do not yet cover every row
    are invisible (pending).
    """

    request_ids: tuple[str, ...]
    ids_TLK: torch.Tensor
    cu_seqlens: torch.Tensor  # int32 [N + 1]
    start_rows: tuple[int, ...]
    layer_map: tuple[int, ...]
    num_experts: int


def to_torch(array: np.ndarray) -> torch.Tensor:
    """Routing ids as a tensor; uint16 widens to int32 because torch's uint16 lacks most ops."""
    if array.dtype == np.uint16:
        array = array.astype(np.int32)
    return torch.from_numpy(np.ascontiguousarray(array))


class RoutingReader:
    """Reads committed requests of a store root.

    ``source`` is a local directory or any zarr ``StoreLike`` (e.g. an ``FsspecStore`` over
    HTTP). Each returned segment is verified against the CRC-32C in the index unless
    ``verify=False``.
    """

    def __init__(self, source: str | os.PathLike[str] | Any, *, verify: bool = True) -> None:
        if isinstance(source, (str, os.PathLike)):
            source = LocalStore(os.fspath(source), read_only=True)
        self._store = source
        self._verify = verify
        self._indexes: dict[str, dict[str, Any]] = {}

    def info(self, rollout_id: str) -> RolloutInfo:
        index = self._index(rollout_id, refresh=True)
        requests = index["requests"]
        return RolloutInfo(
            rollout_id=rollout_id,
            num_layers=index["num_layers"],
            top_k=index["top_k"],
            num_experts=index["num_experts"],
            dtype=index["dtype"],
            layer_map=tuple(index["layer_map"]),
            request_ids=tuple(requests),
            total_rows=sum(r["rows"] for r in requests.values()),
        )

    def get_numpy(self, rollout_id: str, request_ids: Iterable[str]) -> dict[str, np.ndarray]:
        """Per-request routing ``[rows, L, K]`` in the stored dtype, keyed by request id."""
        request_ids = list(request_ids)
        for rid in request_ids:
            validate_id(rid, "request_id")
        index = self._index(rollout_id)
        if any(rid not in index["requests"] for rid in request_ids):
            index = self._index(rollout_id, refresh=True)  # committed since we last looked?
        missing = [rid for rid in request_ids if rid not in index["requests"]]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            pending = [rid for rid in missing if rid in index.get("pending", {})]
            note = (
                f"; {', '.join(repr(p) for p in pending[:5])} pending: stored segments do not cover every row yet"
                if pending
                else ""
            )
            raise UnknownRequestError(
                f"rollout {rollout_id!r} has no committed request {shown} ({len(index['requests'])} requests committed){note}"
            )
        # Read each array once over the span its wanted segments cover when that span is dense,
        # so a batch of requests costs a few ranged reads instead of one per request.
        wanted: dict[str, list[tuple[str, int, dict[str, Any]]]] = {}
        for rid in dict.fromkeys(request_ids):
            for seg_no, seg in enumerate(index["requests"][rid]["segments"]):
                wanted.setdefault(seg["array"], []).append((rid, seg_no, seg))
        parts: dict[tuple[str, int], np.ndarray] = {}
        for name, segs in wanted.items():
            array = self._open_array(rollout_id, name)
            lo = min(s["offset"] for _, _, s in segs)
            hi = max(s["offset"] + s["rows"] for _, _, s in segs)
            if hi - lo <= 2 * sum(s["rows"] for _, _, s in segs):
                span = _read(array, lo, hi, rollout_id, name)
                for rid, seg_no, seg in segs:
                    parts[(rid, seg_no)] = span[seg["offset"] - lo : seg["offset"] - lo + seg["rows"]]
            else:
                for rid, seg_no, seg in segs:
                    parts[(rid, seg_no)] = _read(array, seg["offset"], seg["offset"] + seg["rows"], rollout_id, name)
        out: dict[str, np.ndarray] = {}
        for rid in dict.fromkeys(request_ids):
            segments = index["requests"][rid]["segments"]
            pieces = [parts[(rid, n)] for n in range(len(segments))]
            if self._verify:
                for seg, piece in zip(segments, pieces):
                    if checksum(piece) != seg["crc32c"]:
                        raise CorruptDataError(
                            f"request {rid!r} of rollout {rollout_id!r}, array {seg['array']} rows "
                            f"{seg['offset']}..{seg['offset'] + seg['rows'] - 1}: crc32c {checksum(piece):#010x}, "
                            f"index says {seg['crc32c']:#010x}"
                        )
            out[rid] = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return out

    def get(self, rollout_id: str, request_ids: Iterable[str]) -> dict[str, torch.Tensor]:
        """Per-request routing tensors ``[rows, L, K]`` (uint8, or int32 for wider ids)."""
        return {rid: to_torch(a) for rid, a in self.get_numpy(rollout_id, request_ids).items()}

    def get_packed(self, rollout_id: str, request_ids: Sequence[str]) -> PackedRouting:
        """Requests concatenated along tokens in the given order, with ``cu_seqlens``."""
        arrays = self.get_numpy(rollout_id, request_ids)
        index = self._index(rollout_id)
        ordered = [arrays[rid] for rid in request_ids]
        lengths = [a.shape[0] for a in ordered]
        cu = np.zeros(len(ordered) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        if cu[-1] >= 2**31:
            raise CorruptDataError(f"packed batch has {cu[-1]} rows; cu_seqlens is int32, split the batch")
        if ordered:
            packed = np.concatenate(ordered)
        else:
            packed = np.zeros((0, index["num_layers"], index["top_k"]), dtype=index["dtype"])
        return PackedRouting(
            request_ids=tuple(request_ids),
            ids_TLK=to_torch(packed),
            cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
            start_rows=tuple(index["requests"][rid]["start_row"] for rid in request_ids),
            layer_map=tuple(index["layer_map"]),
            num_experts=index["num_experts"],
        )

    # -- internals --------------------------------------------------------------------------

    def _index(self, rollout_id: str, *, refresh: bool = False) -> dict[str, Any]:
        validate_id(rollout_id, "rollout_id")
        if refresh or rollout_id not in self._indexes:
            try:
                group = zarr.open_group(self._store, path=rollout_id, mode="r")
                index = group.attrs.asdict().get(INDEX_KEY)
            except (FileNotFoundError, KeyError, zarr.errors.GroupNotFoundError, zarr.errors.NodeTypeValidationError) as e:
                raise UnknownRolloutError(f"rollout {rollout_id!r} not found in {self._store}") from e
            if not index or "requests" not in index:
                raise UnknownRolloutError(f"{rollout_id!r} in {self._store} is not an r3rdma rollout (no index)")
            self._indexes[rollout_id] = index
        return self._indexes[rollout_id]

    def _open_array(self, rollout_id: str, name: str) -> zarr.Array:
        try:
            return zarr.open_array(self._store, path=f"{rollout_id}/{name}", mode="r")
        except Exception as e:  # zarr raises several types for missing/garbled metadata
            raise CorruptDataError(f"array {name} of rollout {rollout_id!r} listed in the index cannot be opened: {e}") from e


def _read(array: zarr.Array, lo: int, hi: int, rollout_id: str, name: str) -> np.ndarray:
    try:
        return array[lo:hi]
    except Exception as e:  # zarr reports a chunk checksum mismatch as ValueError, decode errors otherwise
        raise CorruptDataError(f"rollout {rollout_id!r} array {name} rows {lo}..{hi - 1} cannot be read: {e}") from e
