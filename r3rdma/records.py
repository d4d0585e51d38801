"""Values that cross process boundaries: one request's routing, and the dtype rule."""

from __future__ import annotations

from dataclasses import dataclass, field

import google_crc32c  # a dependency of zarr (its crc32c codec)
import numpy as np

from .errors import ShapeMismatchError
from .ids import validate_id

__all__ = ["RequestRecord", "routing_dtype", "checksum"]


def routing_dtype(num_experts: int) -> np.dtype:
    """Narrowest dtype that holds every expert id ``0 .. num_experts - 1``.

    ``num_experts`` counts every id a router can emit, shared experts included.
    uint8 up to 256 experts, uint16 up to 65536, int32 beyond.
    """
    if num_experts < 1:
        raise ShapeMismatchError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 1 << 8:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def checksum(ids_TLK: np.ndarray) -> int:
    """CRC-32C of the C-order bytes of a routing array; stored in the rollout index."""
    return int(google_crc32c.value(np.ascontiguousarray(ids_TLK).tobytes()))


@dataclass(frozen=True, slots=True, eq=False)
class RequestRecord:
    """The routing of one finished request (or one segment of it).

    ``ids_TLK[t]`` is the routing row of position ``start_row + t``: the experts chosen when
    that token was the *input* of a forward, for each MoE layer in ``layer_map`` order.
    """

    rollout_id: str
    request_id: str
    ids_TLK: np.ndarray
    layer_map: tuple[int, ...]
    num_experts: int
    start_row: int = 0
    crc32c: int = field(default=-1)

    def __post_init__(self) -> None:
        validate_id(self.rollout_id, "rollout_id")
        validate_id(self.request_id, "request_id")
        ids = self.ids_TLK
        if not isinstance(ids, np.ndarray) or ids.ndim != 3:
            raise ShapeMismatchError(
                f"ids_TLK must be a 3-D numpy array [rows, layers, top_k], got "
                f"{type(ids).__name__} with shape {getattr(ids, 'shape', None)}"
            )
        if ids.shape[1] != len(self.layer_map):
            raise ShapeMismatchError(
                f"ids_TLK has {ids.shape[1]} layers but layer_map lists {len(self.layer_map)}"
            )
        expected = routing_dtype(self.num_experts)
        if ids.dtype != expected:
            raise ShapeMismatchError(
                f"ids_TLK dtype must be {expected} for {self.num_experts} experts, got {ids.dtype}"
            )
        if self.start_row < 0:
            raise ShapeMismatchError(f"start_row must be >= 0, got {self.start_row}")
        if not ids.flags.c_contiguous:
            object.__setattr__(self, "ids_TLK", np.ascontiguousarray(ids))
        object.__setattr__(self, "layer_map", tuple(int(x) for x in self.layer_map))
        crc = checksum(self.ids_TLK)
        if self.crc32c not in (-1, crc):
            raise ShapeMismatchError(
                f"request {self.request_id}: checksum {self.crc32c:#010x} given, bytes hash to {crc:#010x}"
            )
        object.__setattr__(self, "crc32c", crc)

    @property
    def num_rows(self) -> int:
        return int(self.ids_TLK.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.ids_TLK.shape[2])

    @property
    def nbytes(self) -> int:
        return int(self.ids_TLK.nbytes)
