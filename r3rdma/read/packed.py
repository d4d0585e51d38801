"""Routing of several requests packed along tokens: what a trainer's micro-batch holds, and the
buffer a read decodes a batch into."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from r3rdma.errors import ConfigError
from r3rdma.read.rows import Spans, rows_wanted
from r3rdma.store.index_entries import RequestEntry

# torch is imported where a tensor is made, not with the module: the readers that stay in numpy
# (`r3rdma inspect` and `check`, get_numpy) then start without it, most of their start-up time.
if TYPE_CHECKING:
    import torch

__all__ = ["PackedRouting", "PackedBuffer", "pack", "packed_routing", "cu_seqlens_of", "to_torch"]


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
    import torch

    if array.dtype == np.uint16:
        array = array.astype(np.int32)
    return torch.from_numpy(np.ascontiguousarray(array))


def cu_seqlens_of(lengths: Sequence[int]) -> np.ndarray:
    """``cu_seqlens`` (int64, ``[N + 1]``) of requests of ``lengths`` rows packed in order;
    :class:`ConfigError` when the batch is past what int32 ``cu_seqlens`` can index."""
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    if cu[-1] >= 2**31:
        raise ConfigError(f"packed batch has {cu[-1]} rows; cu_seqlens is int32, split the batch")
    return cu


def packed_routing(
    request_ids: Sequence[str], packed: np.ndarray, cu: np.ndarray, start_rows: Sequence[int], geometry: dict[str, Any]
) -> PackedRouting:
    """:class:`PackedRouting` of ``packed`` (``[T, L, K]``, request ``i`` at rows
    ``cu[i]:cu[i + 1]``), filled by the caller."""
    import torch

    return PackedRouting(
        request_ids=tuple(request_ids),
        ids_TLK=to_torch(packed),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        start_rows=tuple(start_rows),
        layer_map=tuple(geometry["layer_map"]),
        num_experts=geometry["num_experts"],
    )


def pack(
    request_ids: Sequence[str], pieces: Sequence[Sequence[np.ndarray]], start_rows: Sequence[int], geometry: dict[str, Any]
) -> PackedRouting:
    """Requests' segments (``pieces[i]``: request ``i``'s, in row order) packed along tokens."""
    cu = cu_seqlens_of([sum(p.shape[0] for p in segs) for segs in pieces])
    # One copy of every row, into the packed buffer (no per-request concatenation first).
    packed = np.empty((int(cu[-1]), geometry["num_layers"], geometry["top_k"]), dtype=geometry["dtype"])
    row = 0
    for segs in pieces:
        for piece in segs:
            packed[row : row + piece.shape[0]] = piece
            row += piece.shape[0]
    return packed_routing(request_ids, packed, cu, start_rows, geometry)


class PackedBuffer:
    """The packed buffer of a batch being read, and where each request's rows go in it
    (``outs``): rows are decoded straight into it, no per-request array, no copy."""

    def __init__(
        self, request_ids: list[str], entries: list[RequestEntry], geometry: dict[str, Any], spans: Spans | None
    ) -> None:
        """``entries[i]``: the index entry of ``request_ids[i]``; ``geometry``: of the layers read;
        ``spans``: the rows read of some requests (:mod:`r3rdma.read.rows`)."""
        self.request_ids, self.geometry = request_ids, geometry
        self.start_rows = [entry.start_row for entry in entries]
        self.cu = cu_seqlens_of(rows_wanted(entries, request_ids, spans))
        self.packed = np.empty((int(self.cu[-1]), geometry["num_layers"], geometry["top_k"]), dtype=geometry["dtype"])
        bounds = self.cu.tolist()
        self.outs = {rid: self.packed[bounds[i] : bounds[i + 1]] for i, rid in enumerate(request_ids)}

    def result(self) -> PackedRouting:
        """The :class:`PackedRouting`, once every request's rows are read."""
        return packed_routing(self.request_ids, self.packed, self.cu, self.start_rows, self.geometry)
